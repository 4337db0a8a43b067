"""Never lose work (issue 14): one test per class of fault, each asserting the outcome — refused with
exit 2 and one line and nothing written, or saved and resumed exactly.

Classes: run-dir paths orbax cannot store; config drift on resume (+ config history, stale lock,
partial metrics line, eval without held-out data, MFU after a resume); a second trainer on one run
dir; token ids beyond the vocabulary anywhere in a file; start-up signals; bad command-line input;
the LR schedule's clamping and extension; the YAML reading of 10:15; one-line warnings; MFU timing.
Fault injection and the full disk are in tests/test_faults.py.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import SMALL_ARGS, SignalOnLine

from jaxdist import bench, checkpoint, config, plan
from jaxdist.data import loader as loader_mod
from jaxdist.distributed.mesh import mesh_from_string
from jaxdist.errors import JaxdistError
from jaxdist.observe import quiet
from jaxdist.optim import adamw
from jaxdist.train import main
from jaxdist.training import rundir, step
from jaxdist.training.signals import StopSignal

REPO = Path(__file__).resolve().parent.parent
# The schedule is pinned, so every run here (and in test_faults.py) compiles one program: the
# persistent compilation cache makes all but the first compile a load.
SMALL = [
    *SMALL_ARGS,
    "optim.warmup_steps=2",
    "optim.schedule_steps=8",
    "train.eval_every=0",
    "train.log_every=1",
    "checkpoint.every=1",
]


def snapshot(*roots: Path) -> dict:
    out = {}
    for root in roots:
        for path in [root, *root.rglob("*")] if root.exists() else []:
            st = path.lstat()
            out[str(path)] = (st.st_size, st.st_mtime_ns)
    return out


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [x for x in err.replace("\r", "\n").splitlines() if x.strip() and not re.search(r"\d+%\|", x)]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def small():
    cfg = config.load(None, SMALL + ["train.steps=2"])
    prog = step.build_program(cfg, mesh_from_string("fsdp=8"))
    return cfg, prog, prog.init_state(0)


@pytest.fixture(scope="module")
def saved(small, tmp_path_factory) -> Path:
    """A run dir with config.yaml and one checkpoint at step 1 (written directly, no training)."""
    cfg, prog, state = small
    run_dir = tmp_path_factory.mktemp("saved") / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(config.dump(cfg))
    saver = checkpoint.Saver(run_dir, cfg, log=lambda *a: None)
    saver.save(state, 1, loader_mod.Loader(cfg, prog.batch_sharding))
    saver.close()
    return run_dir


# ---- run-dir paths -----------------------------------------------------------------------------------

STORABLE = ["lr{3e-3}", "a b", "ünï©ode-λ", "100%", "a:b,x=1;y", 'it\'s "q"', "a!b&c#d~"]
UNSTORABLE = ["lr[3e-3]", "a*b", "what?", "back\\slash"]


def test_awkward_run_dir_names_save_and_resume_or_are_refused(small, tmp_path, capsys):
    cfg, prog, state = small
    loader = loader_mod.Loader(cfg, prog.batch_sharding)
    for name in STORABLE:  # accepted: saved and restored bit for bit
        run_dir = tmp_path / name
        rundir.check_storable(run_dir)
        saver = checkpoint.Saver(run_dir, cfg, log=lambda *a: None)
        saver.save(state, 1, loader)
        saver.close()
        assert saver.last_saved == 1, name
        got = checkpoint.restore(run_dir, prog, loader, cfg, log=lambda *a: None).state
        for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(got)):
            assert np.asarray(x).tobytes() == np.asarray(y).tobytes(), name
    for name in UNSTORABLE:  # refused up front, nothing written
        before = snapshot(tmp_path)
        assert main(["--run-dir", str(tmp_path / name / "run"), *SMALL]) == 2, name
        assert re.search(r"checkpoints cannot be stored under a path containing", one_error_line(capsys)), name
        assert snapshot(tmp_path) == before


def test_refused_bracket_name_is_really_unreadable_by_orbax(small, tmp_path):
    """Why brackets are refused: orbax saves 'lr[3e-3]' without a word, and the step cannot be read.
    If this starts to fail, orbax handles brackets and rundir.UNSTORABLE may drop them."""
    cfg, prog, state = small
    saver = checkpoint.Saver(tmp_path / "lr[3e-3]", cfg, log=lambda *a: None)
    saver.save(state, 1, loader_mod.Loader(cfg, prog.batch_sharding))
    saver.close()
    with pytest.raises(JaxdistError, match="could be restored"):
        checkpoint.restore(tmp_path / "lr[3e-3]", prog, None, cfg, log=lambda *a: None)


# ---- resuming with a changed config ------------------------------------------------------------------


def test_config_drift_is_refused_listing_keys_and_allowed_by_name(saved, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(saved, run_dir)
    before = snapshot(run_dir)
    for extra, message in (
        (
            ["optim.lr=1e-3", "data.separator=7"],
            r"changed config \(data.separator 0 -> 7, optim.lr 0.003 -> 0.001\); pass --allow-config-change "
            r"data.separator,optim.lr",
        ),
        (["--allow-config-change", "optim.lrr"], r"unknown config key 'optim.lrr': did you mean 'optim.lr'"),
    ):
        assert main(["--run-dir", str(run_dir), *SMALL, "train.steps=2", *extra]) == 2
        assert re.search(message, one_error_line(capsys))
        assert snapshot(run_dir) == before  # nothing written, config.yaml untouched

    # Allowed by name, with free keys changed too (train.steps, eval settings): resumes. On the way: a
    # stale lock left by a dead trainer, a partial last line in metrics.jsonl, no held-out batches.
    original = (run_dir / "config.yaml").read_bytes()
    (run_dir / rundir.LOCK).write_text('{"host": "gone", "pid": 999999999, "since": "yesterday"}\n')
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n{"step": 2, "lo')
    rc = main(
        [
            "--run-dir",
            str(run_dir),
            *SMALL,
            "train.steps=3",
            "data.separator=7",
            "train.eval_every=1",
            "train.eval_batches=0",
            "--allow-config-change",
            "data.separator",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    assert "restored step 1 from" in out and "done: 3 steps" in out
    assert "took over the stale lock of pid 999999999 on host gone" in out
    assert "warning: train.eval_every=1 but train.eval_batches=0; evaluation is off" in out
    assert (run_dir / "config.yaml").read_bytes() == original  # never overwritten: history beside it
    history = (run_dir / "config.1.yaml").read_text()
    assert history.startswith("# resumed at step 1") and "data.separator: 0 -> 7, train.steps: 2 -> 3" in history
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]  # the partial line was dropped
    # timed records of the resumed run (steps 2, 3, the summary): a CPU has no peak, so FLOP/s and no MFU
    timed = [r for r in records if "flops_per_sec" in r]
    assert len(timed) == 3 and all(r["flops_per_sec"] > 0 and 0 <= r.get("mfu", 0) <= 1 for r in timed), timed


# ---- two trainers on one run dir ---------------------------------------------------------------------


def test_second_trainer_on_a_run_dir_is_refused(saved, tmp_path, capsys):
    """The lock is a flock on its own open file: the kernel keeps two opens of one file apart whether they
    are in two processes or one, so this process holds it (RunLock.acquire, as a trainer does) and the
    trainer run next opens it anew and is refused, naming the holder. A holder's death is the kernel
    closing its file: closing the descriptor without release() leaves the lock stale, and the next trainer
    takes it over and says whose it was."""
    import os

    run_dir = tmp_path / "run"
    shutil.copytree(saved, run_dir)
    holder = rundir.RunLock(run_dir)
    assert holder.acquire() is None
    try:
        before = snapshot(run_dir)
        assert main(["--run-dir", str(run_dir), *SMALL, "train.steps=2"]) == 2
        line = one_error_line(capsys)
        assert re.search(rf"run dir .* is in use by another trainer \(pid {os.getpid()} on host ", line), line
        assert snapshot(run_dir) == before
    finally:
        os.close(holder.fd)  # as at the holder's death: its record stays, its flock goes
    rundir.RunLock(run_dir).check()  # stale by construction
    taker = rundir.RunLock(run_dir)
    assert re.fullmatch(rf"took over the stale lock of pid {os.getpid()} on host .*", taker.acquire() or "")
    taker.release()


# ---- data ----------------------------------------------------------------------------------------------


def test_token_ids_beyond_the_vocabulary_anywhere_in_a_file_are_refused(tmp_path):
    tokens = np.zeros((1 << 20) + 4096, np.uint16)
    (tmp_path / "a.bin").write_bytes(tokens.tobytes())
    tokens[-7] = 300  # far beyond the first 2^20 tokens the old check sampled
    (tmp_path / "b.bin").write_bytes(tokens.tobytes())
    cfg = config.load(None, SMALL + ["data.source=tokens", f"data.path={tmp_path}/*.bin"])
    with pytest.raises(
        JaxdistError,
        match=rf"token id 300 at position {len(tokens) - 7} of .*b.bin is >= "
        r"model.vocab_size=256",
    ):
        loader_mod.load_windows(cfg)


# ---- signals during start-up ---------------------------------------------------------------------------


@pytest.mark.slow
def test_signal_during_start_up_stops_cleanly_before_the_first_step(tmp_path, capsys, monkeypatch):
    """SIGTERM as compilation starts (main is about to `compile`; the handler runs once it returns). main
    runs in this process and a real SIGTERM is sent to it (os.kill) from stdout's write of the `mesh`
    line, the summary printed just before compilation (a child cost ~5 CPU-s of imports)."""
    sig = signal.SIGTERM
    run_dir = tmp_path / "run"
    monkeypatch.setenv("TQDM_DISABLE", "1")

    capsys.readouterr()
    with monkeypatch.context() as m:
        m.setattr(sys, "stdout", SignalOnLine(sys.stdout, lambda text: text.startswith("mesh "), sig))
        code = main(["--run-dir", str(run_dir), *SMALL, "train.steps=3"])
    captured = capsys.readouterr()
    text, err = captured.out, captured.err
    assert code == 0, text + err
    assert f"stopped by {sig.name} during start-up: no step was taken and nothing was saved" in text
    assert "aborted" not in err and "Traceback" not in err, err
    assert not list((run_dir / "checkpoints").glob("[0-9]*")) if (run_dir / "checkpoints").exists() else True


@pytest.mark.slow
def test_resume_error_from_the_command_line_is_exactly_one_line(saved):
    """As a user sees it (a subprocess): no absl WARNING lines around a resume error."""
    r = subprocess.run(
        [sys.executable, "-m", "jaxdist.train", "--run-dir", str(saved), *SMALL, "train.seed=1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and r.stderr.startswith(
        "error: train.seed=1 differs from the seed 0 of checkpoint"
    ), r.stderr


def test_first_ctrl_c_during_start_up_stops_and_the_second_aborts(capsys):
    import os
    import time

    with StopSignal() as stopper:  # as main() installs it, before JAX work
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)
        assert stopper.received == "SIGINT" and stopper.requested()
        assert "SIGINT received: stopping before the first step (Ctrl-C again aborts)" in capsys.readouterr().err
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)


# ---- bad command-line input ----------------------------------------------------------------------------


def _train(*args):
    return lambda tmp: main(["--run-dir", str(tmp / "run"), *SMALL, *args])


CLI_ROWS = [  # (id, callable(tmp) -> exit code, expected message)
    ("--cpu-devices 0", _train("--cpu-devices", "0"), r"--cpu-devices 0 must be at least 1"),
    ("--cpu-devices -2", _train("--cpu-devices", "-2"), r"--cpu-devices -2 must be at least 1"),
    (
        "--dcn-mesh on one process",
        _train("--dcn-mesh", "dp=2"),
        r"--dcn-mesh 'dp=2' must lay out the run's 1 process\(es\) .* counted in processes, not devices",
    ),
    (
        "bench --mesh dp=a",
        lambda tmp: bench.main(["--mesh", "dp=a", *SMALL]),
        r"mesh axis 'dp' needs an integer size, got 'dp=a'",
    ),
    ("bench --steps 0", lambda tmp: bench.main(["--steps", "0", *SMALL]), r"--steps 0 / --warmup 3: bench times"),
    (
        "plan --plot into a missing folder",
        lambda tmp: plan.main(["--plot", str(tmp / "no" / "s.png")]),
        r"--plot .*s.png: folder .*/no does not exist",
    ),
]


@pytest.mark.parametrize("call, message", [pytest.param(c, m, id=i) for i, c, m in CLI_ROWS])
def test_bad_command_line_exits_2_with_one_line(call, message, tmp_path, capsys):
    before = snapshot(tmp_path)
    assert call(tmp_path) == 2
    assert re.search(message, one_error_line(capsys))
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("value", ["0", "abc", "-1"])
def test_bad_jax_num_cpu_devices_is_one_line(value, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("JAX_NUM_CPU_DEVICES", value)
    assert main(["--run-dir", str(tmp_path / "run"), *SMALL]) == 2
    assert f"JAX_NUM_CPU_DEVICES='{value}' must be a positive whole number" in one_error_line(capsys)


def test_the_compilation_cache_stays_off_where_a_loaded_cpu_program_can_hang(monkeypatch):
    """platform.enable_compilation_cache: a step loaded from JAX's persistent cache deadlocked in its first
    collectives on CPU (several processes; one process with several devices, some meshes:
    scripts/checks/cpu_cache_deadlock.py), so there the cache stays off; one CPU device, GPU and a
    JAX_COMPILATION_CACHE_DIR the user set keep it."""
    from jaxdist.distributed import platform

    calls = []
    monkeypatch.setattr(jax.config, "update", lambda key, value: calls.append((key, value)))
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    folder = platform.cache_folder()

    def enabled(backend, devices, processes=1):
        monkeypatch.setattr(jax, "default_backend", lambda: backend)
        monkeypatch.setattr(jax, "device_count", lambda: devices)
        monkeypatch.setattr(jax, "process_count", lambda: processes)
        calls.clear()
        platform.enable_compilation_cache()
        return list(calls)

    assert enabled("cpu", 8) == [] and enabled("cpu", 4, processes=2) == [("jax_compilation_cache_dir", None)]
    assert enabled("cpu", 1) == enabled("gpu", 8) == [("jax_compilation_cache_dir", folder)]
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/elsewhere")
    assert enabled("cpu", 8) == [] and platform.cache_folder() == "/elsewhere"  # the user's folder wins


def test_launch_local_refuses_an_uneven_split():
    env = {k: v for k, v in __import__("os").environ.items() if k != "JAX_NUM_CPU_DEVICES"}
    r = subprocess.run(
        ["bash", str(REPO / "scripts/cluster/launch_local.sh"), "3"],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        "error: 8 simulated devices do not split evenly over 3 processes; set JAX_NUM_CPU_DEVICES "
        "(devices per process, e.g. JAX_NUM_CPU_DEVICES=3)"
    ]


# ---- the LR schedule -----------------------------------------------------------------------------------


def test_schedule_clamping_and_extension_are_said_and_schedule_steps_pins_it():
    cfg = config.load(None, ["train.steps=30", "optim.warmup_steps=50"])
    assert adamw.schedule_notes(cfg) == [
        "note: optim.warmup_steps=50 does not fit the 30-step LR schedule: warm-up is clamped to 29 steps, so the "
        "LR peaks at the end with 1 step(s) of decay; lower optim.warmup_steps or set optim.schedule_steps"
    ]
    longer = config.load(None, ["train.steps=40", "optim.warmup_steps=5"])
    notes = adamw.schedule_notes(longer, 30, {"train.steps": (30, 40)})
    old = float(adamw.schedule(longer.optim, 30, 8)(30))
    new = float(adamw.schedule(longer.optim, 40, 8)(30))
    assert old < new and notes == [
        f"note: the LR schedule now spans 40 steps instead of 30: from step 30 on the LR follows the new "
        f"schedule ({old:.3g} -> {new:.3g} at step 30); pass optim.schedule_steps=30 to keep the schedule the run had"
    ]
    pinned = longer.replace(optim=dict(schedule_steps=30))
    assert adamw.schedule_notes(pinned, 30, {"train.steps": (30, 40), "optim.schedule_steps": (0, 30)}) == []
    # the pinned 40-step program follows the 30-step schedule (optax clamps it at the end)
    _, lr = adamw.make_optimizer(pinned.optim, pinned.optim.schedule_steps or 40, 8)
    assert [float(lr(s)) for s in range(0, 40, 3)] == [
        float(adamw.schedule(longer.optim, 30, 8)(s)) for s in range(0, 40, 3)
    ]


def test_profile_steps_as_yaml_reads_them():
    cfg = config.load(None, ["train.profile_steps=10:15"])  # YAML 1.1: the integer 615
    assert config.parse_step_range(cfg.train.profile_steps) == (10, 15)
    assert config.parse_step_range("3:7") == (3, 7)
    assert config.parse_step_range(config.load(None, ["train.profile_steps=0:5"]).train.profile_steps) == (0, 5)


# ---- warnings and MFU ------------------------------------------------------------------------------------


def test_compressed_method_with_one_replica_warns_in_one_line():
    quiet.libraries()
    cfg = config.load(None, SMALL + ["reduce.method=topk"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step.build_program(cfg, mesh_from_string("fsdp=8"))
    printed = {warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line) for w in caught}
    assert printed == {
        "warning: reduce.method=topk does nothing with dp=1 (one replica, nothing to compress); reducing dense\n"
    }, printed


class FakeMetric:
    def __init__(self, value: float, ready: bool):
        self.value, self.ready = value, ready

    def is_ready(self) -> bool:
        return self.ready

    def __float__(self) -> float:
        return self.value


def test_mfu_is_timed_from_real_waits_and_never_above_100_percent(monkeypatch, capsys):
    """Step 2's metrics were read late (the host was saving: they were ready before it asked), then
    step 3's at once: step 3 must not be timed from that late read."""
    from jaxdist.observe import progress

    now = [0.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(progress.jax, "device_get", lambda m: m)
    records = []
    writer = type("W", (), {"write": lambda self, r: records.append(r)})()
    cfg = config.load(None, ["train.log_every=1"])
    p = progress.Progress(cfg, writer, tokens_per_step=100, flops_per_token=1.0, peak_flops=150.0)

    def metrics(ready):
        return {k: FakeMetric(0.0 if k == "skipped" else 1.0, ready) for k in progress.STEP_KEYS}

    for s, (t, ready) in enumerate([(1.0, False), (2.0, False), (5.0, True), (5.01, True), (6.0, False)]):
        now[0] = t
        p.record(s, metrics(ready))
    times = [r["step_time_s"] for r in records]
    # steps 1, 2 waited (1 s each); step 3 read late at 5.0: no restart; step 4 at 5.01 is still timed
    # from 2.0 (upper bound 1.5 s), not 0.01 s; step 5 waited: (6.0 - 2.0) / 3 steps
    assert times == pytest.approx([1.0, 1.0, 3.0, 1.505, 4.0 / 3])
    assert all(0 < r["mfu"] <= 1 for r in records)
    assert records[0]["mfu"] == pytest.approx(100 / 150)
    fast = progress.Progress(cfg, writer, tokens_per_step=100, flops_per_token=1.0, peak_flops=50.0)
    assert fast.mfu(100.0) == 1.0 and "exceeds the peak estimate" in capsys.readouterr().out
