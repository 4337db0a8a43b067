import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from jaxdist import config
from jaxdist.errors import JaxdistError

ROOT = Path(__file__).resolve().parent.parent


def test_defaults_load_and_overrides_apply():
    cfg = config.load(None, ["optim.lr=1e-3", "train.steps=7", "model.remat=full", "mesh.rules={embed: [fsdp, dp]}"])
    assert cfg.optim.lr == 1e-3 and cfg.train.steps == 7 and cfg.model.remat == "full"
    assert cfg.mesh.rules == {"embed": ["fsdp", "dp"]}
    assert cfg.model.d_model == 256 and cfg.train.global_batch == 8  # tiny.yaml


def test_dump_roundtrips(tmp_path):
    cfg = config.load(None, ["train.seed=3"])
    path = tmp_path / "c.yaml"
    path.write_text(config.dump(cfg))
    assert config.load(path) == cfg


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.stepz=3", "did you mean 'train.steps'"),
        ("trian.steps=3", "unknown config key 'trian.steps': did you mean 'train.steps'"),
        ("train.steps=abc", "train.steps must be int"),
        ("train.steps=2.5", "train.steps must be int"),
        ("model.tie_embeddings=3", "model.tie_embeddings must be bool"),
        ("optim.schedule=exp", "not one of cosine, linear, constant"),
        ("train.global_batch=0", "train.global_batch=0 is out of range: it must be >= 1"),
        ("train.grad_accum_steps=3", "not divisible by train.grad_accum_steps=3"),
        ("model.num_kv_heads=3", "not a multiple of model.num_kv_heads"),
        ("train.profile_steps=5", "START:STOP"),
        ("steps=3", "section.key=value"),
        ("train.microbatches=2", "train.microbatches was renamed train.grad_accum_steps; use train.grad_accum_steps=2"),
    ],
)
def test_bad_values_are_one_line_errors(override, message):
    with pytest.raises(JaxdistError, match=message) as err:
        config.load(None, [override])
    assert "\n" not in str(err.value)


def test_error_feedback_off_under_dgc_is_refused():
    with pytest.raises(JaxdistError, match="no effect with reduce.topk.dgc=update.*set reduce.topk.dgc=off"):
        config.load(None, ["reduce.method=topk", "reduce.error_feedback=false"])
    # a bare `off` is a bool to YAML 1.1; the choice field takes it back as the word
    plain = config.load(None, ["reduce.method=topk", "reduce.error_feedback=false", "reduce.topk.dgc=off"])
    assert plain.reduce.topk.dgc == "off" and not plain.reduce.error_feedback
    assert config.load(None, [f"reduce.{k}={v}" for k, v in plain.to_dict()["reduce"].items()]) == plain


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(JaxdistError, match="not found"):
        config.load(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed")
    with pytest.raises(JaxdistError, match="not valid YAML"):
        config.load(bad)


def test_replace_validates():
    cfg = config.load()
    assert cfg.replace(train=dict(steps=5)).train.steps == 5
    with pytest.raises(JaxdistError):
        cfg.replace(train=dict(steps=-1))


@pytest.mark.parametrize("name", ["tiny", "125m", "1b", "llama2-7b", "llama3-8b", "llama2-70b"])
def test_shipped_configs_load(name):
    assert name in config.shipped_configs()
    assert config.load(name) == config.load(config.CONFIGS_DIR / f"{name}.yaml")
    assert config.load(f"configs/{name}.yaml").model.num_layers > 0


def test_an_unknown_config_name_lists_the_shipped_ones():
    with pytest.raises(
        JaxdistError,
        match=r"config file tinyy not found; pass --config with an existing YAML path or a shipped config name \(125m, .*tiny, tiny-moe\)",
    ):
        config.load("tinyy")


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.lr=inf", "optim.lr=inf must be a finite number"),
        ("optim.lr=.nan", "optim.lr=nan must be a finite number"),
        ("optim.lr=0", "optim.lr=0.0 is out of range: it must be > 0"),
        ("train.eval_every=-1", "train.eval_every=-1 is out of range: it must be >= 0"),
        ("checkpoint.every=-5", "checkpoint.every=-5 is out of range: it must be >= 0"),
        ("optim.b2=1", "optim.b2=1.0 is out of range: it must be >= 0 and < 1"),
        ("optim.clip_norm=-1", "optim.clip_norm=-1.0 is out of range: it must be >= 0"),
        ("train.max_skipped_steps=0", "train.max_skipped_steps=0 is out of range: it must be >= 1"),
        ("data.separator=256", "data.separator=256 is out of range: it must be >= 0 and <= 255"),
        ("train.seed=-1", "train.seed=-1 is out of range: it must be >= 0"),
        ("reduce.ratio=0", "reduce.ratio=0.0 is out of range: it must be > 0 and <= 1"),
        (
            "model.remat=ful",
            "model.remat='ful' is not one of none, full, dots_saveable, offload_dots; did you mean 'full'",
        ),
        ("mesh.rules={embd: [fsdp]}", "mesh.rules names unknown logical axis 'embd'; did you mean 'embed'"),
        ("mesh.rules={embed: [fdsp]}", "mesh.rules.embed names unknown mesh axis 'fdsp'"),
        ("reduce.axis=xp", "reduce.axis='xp' is not a mesh axis; use one of dp, pp, fsdp, cp, ep, tp"),
        ("train.zzzzzz=1", "unknown config key 'train.zzzzzz': known keys: train.eval_batch_size, train.eval_batches"),
    ],
)
def test_ranges_and_names_are_checked_in_one_place(override, message):
    with pytest.raises(JaxdistError, match="^" + re.escape(message)) as err:
        config.load(None, [override])
    assert "\n" not in str(err.value)


def test_yaml_reads_values_as_written(tmp_path):
    """YAML 1.1 reads `10:15` as the base-60 integer 615 and `1e-3` as a string; we read what is written."""
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  profile_steps: 10:15\noptim:\n  lr: 1e-3\n")
    cfg = config.load(path)
    assert cfg.train.profile_steps == "10:15" and cfg.optim.lr == 1e-3
    assert config.load(None, ["train.profile_steps=10:15"]).train.profile_steps == "10:15"
    assert config.parse_step_range(cfg.train.profile_steps) == (10, 15)


@pytest.mark.parametrize(
    "text, message",
    [
        ("train: 5\n", "config section 'train' in .* must be a mapping of keys to values"),
        ("- a\n- b\n", "must be a mapping of sections"),
        ("model:\n  d_model: 64\n  num_heads: [4]\n", "model.num_heads must be int"),
    ],
)
def test_malformed_sections(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(JaxdistError, match=message):
        config.load(path)


def test_config_file_that_is_not_utf8(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes("train:\n  steps: 5 # caf\u00e9\n".encode("latin-1"))
    with pytest.raises(JaxdistError, match="is not UTF-8 text .*save it as UTF-8"):
        config.load(path)


def test_help_lists_every_key_with_its_doc():
    text = config.keys_help()
    for key, (_, _, doc) in config.iter_keys():
        assert f"  {key} = " in text
        assert doc, f"{key} has no doc comment in its section's module (jaxdist/config/*_section*.py)"
    assert "model.remat = 'none'  [none | full | dots_saveable | offload_dots]" in text


def test_every_package_is_listed_in_pyproject():
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "jaxdist").rglob("__init__.py")}
    assert found <= listed and "jaxdist.configs" in listed


def test_print_config_from_another_directory(tmp_path):
    """A shipped config by name from any directory; --print-config resolves the mesh and exits 0."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxdist.train",
            "--config",
            "llama3-8b",
            "--print-config",
            "--cpu-devices",
            "8",
            "train.steps=3",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    cfg = config.from_dict(yaml.safe_load(out.stdout))
    assert cfg.mesh.shape == "fsdp=8" and cfg.model.vocab_size == 128256 and cfg.train.steps == 3
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.slow
def test_shipped_configs_from_a_non_editable_install(tmp_path):
    """`pip install .` (not -e) builds the wheel and installs it; outside the checkout its configs/ are found
    by name (package data) and `python -m jaxdist.train --help` and `--config tiny --print-config` run."""
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",  # built in isolation, as a user's pip builds it (the venv's own setuptools may be older)
            "--target",
            str(target),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    code = "from jaxdist import config; print(config.CONFIGS_DIR); print(config.load('llama3-8b').model.d_model)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(target)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    where, d_model = out.stdout.split()
    assert where.startswith(str(target)) and d_model == "4096"
    # the installed command itself, outside the checkout: --help (every config key) and a shipped config
    train = [sys.executable, "-m", "jaxdist.train"]
    env = {**os.environ, "PYTHONPATH": str(target)}
    for args in (["--help"], ["--config", "tiny", "--print-config"]):
        out = subprocess.run([*train, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, (args, out.stderr)
        if args == ["--help"]:
            assert "usage: python -m jaxdist.train" in out.stdout and "  model.remat = 'none'" in out.stdout
        else:
            cfg = config.from_dict(yaml.safe_load(out.stdout))
            assert cfg.model.d_model == 256 and cfg.mesh.shape == "fsdp=8"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["site"]  # nothing written outside the install


@pytest.mark.parametrize("steps", [7, 30, 1000])
def test_finetune_config_fits_any_run_length(steps):
    """configs/finetune.yaml is relative to train.steps: no clamped warm-up note at --steps 30 (tiny's
    50 warm-up steps gave one), an eval every ceil(steps / 5) steps and a checkpoint every ceil(steps / 4),
    and both at the end."""
    from jaxdist.checkpoint.saving import Saver
    from jaxdist.config import relative
    from jaxdist.optim import adamw
    from jaxdist.training.hooks import Metrics, StepEnd

    cfg = relative.resolve(config.load("finetune", [f"train.steps={steps}"]))
    assert adamw.schedule_notes(cfg) == []
    assert cfg.optim.warmup_steps == 0 and relative.warmup(cfg.optim, steps) == int(0.05 * steps)
    ends = [StepEnd(i, None, {}, steps, False) for i in range(steps)]
    evals = [e.done for e in ends if Metrics(None, None, cfg.train.eval_every).eval_due(e)]
    saver = type("S", (), {"cfg": cfg, "due": Saver.due})()
    saves = [e.done for e in ends if saver.due(e.done, e.last)]
    want = {7: ([2, 4, 6, 7], [2, 4, 6, 7]), 30: ([6, 12, 18, 24, 30], [8, 16, 24, 30])}  # every ceil(steps / n)
    if steps in want:
        assert (evals, saves) == want[steps]
    else:
        assert len(evals) == 5 and len(saves) == 4 and evals[-1] == saves[-1] == steps
    line = relative.cadence_line(cfg)
    assert f"(optim.warmup_fraction=0.05 of {steps})" in line and "(train.evals=5)" in line, line
    assert "(checkpoint.saves=4)" in line, line
    tiny = config.load(None, [f"train.steps={steps}"])
    assert bool(adamw.schedule_notes(tiny)) == (steps <= 50)  # the pretraining schedule clamps short runs


def test_warmup_fraction_sets_the_schedule_and_replaces_warmup_steps():
    from jaxdist.config import relative
    from jaxdist.optim import adamw

    cfg = relative.resolve(config.load(None, ["optim.warmup_fraction=0.1", "train.steps=40"]))
    assert cfg.optim.warmup_steps == 0  # recorded as not in effect
    lr = adamw.schedule(cfg.optim, 40, cfg.train.global_batch)
    peak = cfg.optim.lr
    assert float(lr(0)) == pytest.approx(peak / 4) and float(lr(3)) == pytest.approx(peak)  # 4 warm-up steps
    assert float(lr(10)) < float(lr(4))
    same = adamw.schedule(config.load(None, ["optim.warmup_steps=4"]).optim, 40, cfg.train.global_batch)
    assert [float(lr(s)) for s in range(40)] == pytest.approx([float(same(s)) for s in range(40)])


def test_a_key_given_twice_says_which_value_wins(capsys):
    """`train.steps=5 train.steps=6`: the last wins, as for a repeated flag, with one warning line (was
    silent); the same value twice says nothing."""
    assert config.load(None, ["train.steps=5", "train.steps=6"]).train.steps == 6
    err = capsys.readouterr().err
    assert err == "warning: train.steps is given twice (5, then 6); using 6\n"
    config.load(None, ["train.steps=6", "train.steps=6"])
    assert capsys.readouterr().err == ""


# ---------------------------------------------------------------------------------------------------
# reduce.* grouped by method (issue 43): each method's own options in its section


@pytest.mark.parametrize("old", sorted(config.REGROUPED))
def test_flat_reduce_key_is_a_one_line_rename(old, tmp_path):
    """Every moved key, as an override and in a YAML file, is refused in one line naming its new key."""
    new = config.REGROUPED[old]
    with pytest.raises(JaxdistError, match=rf"^config key {re.escape(old)} was renamed {re.escape(new)}; use "):
        config.load(None, [f"{old}=1"])
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"reduce": {old.split(".", 1)[1]: 1}}))
    with pytest.raises(JaxdistError, match=rf"{re.escape(old)} was renamed {re.escape(new)}"):
        config.load(path)
    assert len(config.REGROUPED) == 10 and set(config.REGROUPED.values()) <= {k for k, _ in config.iter_keys()}


def test_method_sections_read_from_overrides_yaml_and_replace(tmp_path):
    """reduce.topk.dgc=off, a YAML `reduce: {topk: {dgc: off}}` and replace(reduce=dict(topk=...)) set
    the same key and keep the section's others; an unknown key inside a section names its neighbours."""
    over = config.load(None, ["reduce.method=topk", "reduce.topk.dgc=off"])
    path = tmp_path / "c.yaml"
    path.write_text("reduce:\n  method: topk\n  topk:\n    dgc: off\n")
    replaced = config.Config().replace(reduce=dict(method="topk", topk=dict(dgc="off")))
    assert over == config.load(path) == replaced
    assert over.reduce.topk.dgc == "off" and over.reduce.topk.warmup_density == 0.0625
    assert config.load(None, ["reduce.diloco.sync_every=4"]).reduce.diloco.outer_codec == "dense"
    with pytest.raises(JaxdistError, match=r"unknown config key 'reduce.topk.dgcc': did you mean 'reduce.topk.dgc'"):
        config.load(None, ["reduce.topk.dgcc=off"])
    with pytest.raises(JaxdistError, match=r"config section 'reduce.topk' must be a mapping"):
        config.load(None, ["reduce.topk=off"])
    with pytest.raises(JaxdistError, match=r"reduce.powersgd.rank=0 is out of range: it must be >= 1"):
        config.load(None, ["reduce.powersgd.rank=0"])
    path.write_text(config.dump(over))  # config.yaml as a run writes it: read back the same
    assert config.load(path) == over


def test_regrouping_keeps_run_names_and_reads_old_saved_configs():
    """Run folders hash the moved keys under their old flat names: these hashes are what jaxdist
    computed before the regrouping (main at 2351f4c, the same overrides in the flat spelling), so a
    command finds its old folder. An old run's saved config.yaml (flat reduce.dgc) is read under the
    new names: resuming it with the same settings reports no change, and a real change by its new name."""
    from jaxdist.checkpoint.compat import changed_keys
    from jaxdist.training import rundir

    before = {
        (): "bef0e0b4",
        (
            "reduce.method=topk",
            "reduce.ratio=0.05",
            "reduce.topk.dgc=off",
            "reduce.topk.warmup_density=0.1",
        ): "6b206ad7",
        (
            "reduce.method=diloco",
            "reduce.diloco.sync_every=4",
            "reduce.diloco.outer_codec=int8",
            "reduce.int8.block_size=128",
            "reduce.diloco.outer_lr=0.7",
            "reduce.diloco.outer_momentum=0.9",
        ): "38d4b507",
        ("reduce.method=demo", "reduce.demo.chunk=32", "reduce.demo.momentum_decay=0.9"): "cde5a899",
        ("reduce.method=powersgd", "reduce.powersgd.rank=2"): "64ae474d",
    }
    for over, name in before.items():
        assert rundir.identity(config.load(None, list(over))) == name, over
    cfg = config.load(None, ["reduce.method=topk", "reduce.topk.dgc=off"])
    old = cfg.to_dict()
    old["reduce"] = {k: v for k, v in old["reduce"].items() if not isinstance(v, dict)}
    old["reduce"] |= {"dgc": "off", "warmup_density": 0.0625, "rank": 4, "sync_every": 16}  # as 2351f4c saved it
    assert changed_keys(old, cfg) == {}
    assert changed_keys(old, cfg.replace(reduce=dict(topk=dict(dgc="gradient")))) == {
        "reduce.topk.dgc": ("off", "gradient")
    }
