"""Seeing a run: a 5-step run writes RUN_DIR/loss.png and plain log lines (stdout is not a terminal under
pytest); `python -m jaxdist.plot` overlays runs labelled by the config keys in which they differ."""

import json
import os
import shutil
import signal

import matplotlib.image
import pytest
from conftest import MICRO_MODEL

import jaxdist
from jaxdist import config, plot
from jaxdist.observe import plots, progress

SMALL = MICRO_MODEL


def five_step_config():
    return config.load(
        None, ["train.steps=5", "optim.warmup_steps=2", "train.eval_every=4", "train.log_every=2", "checkpoint.every=0"]
    ).replace(model=SMALL)


@pytest.fixture(scope="module")
def five_steps(tmp_path_factory):
    """(run dir, every line the run logged)."""
    run_dir = tmp_path_factory.mktemp("plot") / "run"
    lines = []
    jaxdist.run(five_step_config(), run_dir, log=lines.append)
    return run_dir, lines


def test_sigterm_still_writes_loss_png(tmp_path):
    """SIGTERM arrives when step 2 is logged: the run stops after the next step, saves, and draws loss.png
    (the same program as five_steps: loaded from the compilation cache)."""
    lines = []

    def log(line):
        lines.append(line)
        if line.startswith("step 2/5"):
            os.kill(os.getpid(), signal.SIGTERM)

    result = jaxdist.run(five_step_config(), tmp_path / "run", log=log)
    assert result.steps == 4 and lines[-1].startswith("stopped by SIGTERM at step 4; latest checkpoint"), lines
    assert lines[-2].startswith("stopped early: 4 steps, loss ") and not any(x.startswith("done") for x in lines)
    assert (tmp_path / "run" / "loss.png").stat().st_size > 20_000
    assert plots.read_metrics(tmp_path / "run")[-1]["step"] == 4


def test_run_writes_a_decodable_loss_png(five_steps):
    run_dir, _ = five_steps
    png = run_dir / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    pixels = matplotlib.image.imread(png)
    assert pixels.shape[0] > 300 and pixels.shape[1] > 500
    assert pixels[..., :3].std() > 0.05  # curves and text, not a blank canvas


def test_plain_log_lines_with_units_smoothing_eval_and_eta(five_steps):
    _, lines = five_steps
    steps = [x for x in lines if x.startswith("step ")]
    assert [x.split(" | ")[0] for x in steps] == ["step 2/5", "step 4/5", "step 5/5"]  # log_every, eval, last
    for x in steps:
        assert " nats/token (" in x and " bits/byte)" in x and "| smoothed " in x and " tok/s | " in x
        assert " GFLOP/s | " in x and "MFU" not in x  # CPU: achieved FLOP/s, no MFU against a probed peak
    assert "| eval loss " in steps[1] and "| eval loss " in steps[2] and "eval" not in steps[0]
    assert "ETA " in steps[0] and steps[2].endswith("| done")
    text = "\n".join(lines)
    assert "uniform baseline ln 256 = 5.545 nats/token = 8.00 bits/byte" in text
    assert "throughput: achieved model FLOP/s (flops_per_sec), no MFU (CPU: no datasheet peak" in text
    assert "probe" not in text
    assert "epochs" in text and "text files (the Python standard library)" in text
    assert f"loss plot {five_steps[0] / 'loss.png'}" in text
    assert any(x.startswith("memory per device: compiled step ") and "planner predicted" in x for x in lines)


def test_smoothed_loss_is_unbiased_and_ignores_skipped_steps(tiny_cfg):
    """A constant loss smooths to itself from the first step (bias-corrected EMA, not 0.1 x loss); a
    skipped (non-finite) step leaves it unchanged; a noisy loss smooths to within its range."""
    from jaxdist.observe import metrics

    lines = []
    p = progress.Progress(
        tiny_cfg.replace(train={"log_every": 1}), metrics.MetricWriter(None), 100, 1.0, 0.0, log=lines.append
    )
    step = lambda i, loss, skipped=0.0: p.record(i, {"loss": loss, "lr": 1e-3, "grad_norm": 1.0, "skipped": skipped})
    step(0, 2.0)
    assert p.smoothed == pytest.approx(2.0, rel=1e-12)
    step(1, 2.0)
    step(2, float("nan"), skipped=1.0)
    assert p.smoothed == pytest.approx(2.0, rel=1e-12) and "skipped steps [3]" in lines[-1]
    for i, loss in enumerate([3.0, 1.0] * 20, start=3):
        step(i, loss)
    assert 1.8 < p.smoothed < 2.2  # the mean of the alternation, not its last value
    assert p.summary(43, 0.0)["final_loss_smooth"] == p.smoothed
    p.close()


def test_smoothed_loss_carried_through_a_resume_equals_the_uninterrupted_one(tiny_cfg):
    """Progress.carry() (saved with each checkpoint) makes a resumed run's smoothed loss the same as an
    uninterrupted run's; a fresh start at the resume step would restart the average from that loss."""
    from jaxdist.observe import metrics

    cfg = tiny_cfg.replace(train={"log_every": 1})
    losses = [5.0 - 0.1 * i + (0.3 if i % 3 else 0.0) for i in range(12)]

    def feed(p, start, stop):
        for i in range(start, stop):
            p.record(i, {"loss": losses[i], "lr": 1e-3, "grad_norm": 1.0, "skipped": 0.0})
        return p.smoothed

    whole = progress.Progress(cfg, metrics.MetricWriter(None), 100, 1.0, 0.0, log=lambda *a: None)
    reference = feed(whole, 0, 12)
    first = progress.Progress(cfg, metrics.MetricWriter(None), 100, 1.0, 0.0, log=lambda *a: None)
    feed(first, 0, 5)
    carried = json.loads(json.dumps(first.carry()))  # as the checkpoint's meta stores it
    resumed = progress.Progress(cfg, metrics.MetricWriter(None), 100, 1.0, 0.0, start=5, carry=carried)
    assert feed(resumed, 5, 12) == pytest.approx(reference, rel=1e-12)
    fresh = progress.Progress(cfg, metrics.MetricWriter(None), 100, 1.0, 0.0, start=5)
    assert abs(feed(fresh, 5, 12) - reference) > 0.05  # the test can fail: without the carry it differs
    for p in (whole, first, resumed, fresh):
        p.close()


def test_cpu_reports_achieved_flops_and_a_known_peak_reports_mfu_too(tiny_cfg):
    """metrics.jsonl and the log line say which: `flops_per_sec` always, `mfu` only with a peak."""
    records = []
    writer = type("W", (), {"write": lambda self, r: records.append(r)})()
    cfg = tiny_cfg.replace(train={"log_every": 1})
    for peak in (0.0, 1e15):
        lines = []
        p = progress.Progress(cfg, writer, 100, 1000.0, peak, log=lines.append)
        p.record(0, {"loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "skipped": 0.0})
        r, line = records[-1], p.line(1, records[-1])
        assert r["flops_per_sec"] == pytest.approx(r["tokens_per_sec"] * 1000.0)
        if peak:
            assert r["mfu"] == pytest.approx(r["flops_per_sec"] / peak) and f"| MFU {r['mfu']:.1%} |" in line
        else:
            assert "mfu" not in r and f"| {r['flops_per_sec'] / 1e9:.3g} GFLOP/s |" in line and "MFU" not in line
        summary = p.summary(1, 0.0)
        assert ("mfu" in summary) == bool(peak) and summary["flops_per_sec"] > 0
        p.close()


def test_overlay_labels_runs_by_their_differing_config_keys(five_steps, tmp_path, capsys):
    run_a, _ = five_steps
    run_b = tmp_path / "run_b"
    shutil.copytree(run_a, run_b, ignore=shutil.ignore_patterns("checkpoints", "tb"))
    cfg_b = config.load(run_a / "config.yaml", ["optim.lr=0.01"])
    (run_b / "config.yaml").write_text(config.dump(cfg_b))
    out = tmp_path / "cmp.png"
    assert plot.main([str(run_a), str(run_b), "--out", str(out)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "runs: optim.lr=0.003; optim.lr=0.01"
    assert matplotlib.image.imread(out).shape[0] > 300
    assert plot.main([str(run_a), str(run_b), "--metric", "eval_loss", "--out", str(tmp_path / "e.png")]) == 0


def test_runs_are_never_labelled_by_a_token_dtype_that_had_no_effect(tmp_path):
    """config.yaml records the dtype read (data.data_rules.resolve_token_dtype), so runs that read the same tokens
    have the same data.token_dtype whatever was passed, and the overlay does not label them by it."""
    import numpy as np
    import yaml

    from jaxdist.data import data_rules

    np.arange(100, dtype=np.uint16).tofile(tmp_path / "t.bin")
    tokens = ["data.source=tokens", f"data.path={tmp_path / 't.bin'}"]
    cases = [  # (run a's overrides, run b's): the same tokens are read
        (tokens + ["data.token_dtype=uint16"], tokens),  # plain files: uint16 explicitly, or auto
        (["data.token_dtype=uint32"], []),  # a text source reads no token files
    ]
    for a, b in cases:
        flat = [
            plots.read_config(_write(tmp_path / name, data_rules.resolve_token_dtype(config.load(None, over))))
            for name, over in (("a", a), ("b", b))
        ]
        assert plots.differing_labels(flat, ["a", "b"]) == ["a", "b"], flat
    assert yaml.safe_load((tmp_path / "b" / "config.yaml").read_text())["data"]["token_dtype"] == "auto"
    # A text run recorded before (token_dtype uint16, which it never read) still resumes without a drift.
    from jaxdist.checkpoint import compat

    old = config.load(None, ["data.token_dtype=uint16"]).to_dict()
    assert compat.changed_keys(old, data_rules.resolve_token_dtype(config.load(None, []))) == {}


def _write(run_dir, cfg):
    run_dir.mkdir(exist_ok=True)
    (run_dir / "config.yaml").write_text(config.dump(cfg))
    return run_dir


def test_long_legend_labels_are_broken_at_their_separators():
    label = ", ".join(f"optim.key_{i}=0.00{i}" for i in range(7))  # seven differing keys: 131 characters
    text = plots.legend_text(label)
    assert all(len(line) <= 48 for line in text.splitlines()) and len(text.splitlines()) == 4
    assert text.replace(",\n", ", ") == label  # nothing lost or reordered
    assert plots.legend_text("a=1, b=2") == "a=1, b=2"
    assert plots.legend_text("x" * 60 + ", b=2") == "x" * 60 + ",\nb=2"  # a long pair keeps its own line
    edge = "a" * 20 + ", " + "b" * 26 + ", c=1"  # 48 characters before the second comma: that comma counts
    assert [len(line) for line in plots.legend_text(edge).splitlines()] == [21, 31]


def test_plot_cli_errors_are_one_line(tmp_path, capsys):
    assert plot.main([str(tmp_path)]) == 2
    assert (
        capsys.readouterr().err.strip() == f"error: {tmp_path / 'metrics.jsonl'} not found; pass a run dir "
        "written by python -m jaxdist.train"
    )


def test_resumed_segments_are_joined_by_step(tmp_path):
    lines = [
        {"step": 2, "loss": 3.0},
        {"step": 4, "loss": 2.5},
        {"summary": True, "steps": 4},
        {"step": 4, "loss": 2.4},
        {"step": 6, "loss": 2.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 8, "lo')
    assert [(r["step"], r["loss"]) for r in plots.read_metrics(tmp_path)] == [(2, 3.0), (4, 2.4), (6, 2.0)]


def test_tqdm_disable_and_non_terminals_get_plain_lines(monkeypatch):
    class Tty:
        def isatty(self):
            return True

    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    assert not progress.plain_output(Tty())
    monkeypatch.setenv("TQDM_DISABLE", "1")
    assert progress.plain_output(Tty())
    monkeypatch.setenv("TQDM_DISABLE", "0")
    assert not progress.plain_output(Tty())
    with open(os.devnull, "w") as null:
        assert progress.plain_output(null)


def test_the_bar_shows_the_step_an_evaluation_line_names(tiny_cfg, monkeypatch):
    """The bar counted a step after its evaluation's line: it showed 35/60 while "eval at step 36" printed."""
    from jaxdist.observe import metrics

    monkeypatch.setattr(progress, "plain_output", lambda stream=None: False)
    p = progress.Progress(tiny_cfg.replace(train={"log_every": 100}), metrics.MetricWriter(None), 100, 1.0, 0.0)
    seen = []
    monkeypatch.setattr(p, "say", lambda message: seen.append((message, p.bar.n)))
    vals = {"loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "skipped": 0.0}
    for i in range(36):
        p.record(i, vals, evaluate=(lambda: 1.5) if i == 35 else None)
    p.close()
    assert [(m.split(":")[0], n) for m, n in seen] == [("eval at step 36", 36)], seen


def test_the_optimizer_line_counts_the_gradient_stages_state(tiny_cfg):
    """Under reduce.method=topk (DGC) the optimizer's state is the gradient stage's (momentum, residuals):
    the start-up line said "optimizer 0.0 MiB"; it now names that state's bytes per device, exactly the
    abstract state's shards (two-sided: the same sum)."""
    import math

    import jax

    from jaxdist.distributed import mesh as mesh_mod
    from jaxdist.observe import report
    from jaxdist.training import step

    cfg = tiny_cfg.replace(model=SMALL, reduce=dict(method="topk"), mesh=dict(shape="dp=8"))
    prog = step.build_program(cfg, mesh_mod.mesh_from_string("dp=8"))
    st, sh = prog.abstract_state.reducer_state, prog.state_shardings.reducer_state
    want = sum(
        math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize for a, s in zip(jax.tree.leaves(st), jax.tree.leaves(sh))
    )
    assert want > 0 and report.reducer_state_bytes(prog) == want
    line = report.summary_lines(cfg, prog, 1.0)[1]
    assert f"gradient-stage state {want / 2**20:.1f} MiB ({prog.gradients.name})" in line, line
