"""Checkpoints: bit-exact resume after SIGKILL, a save killed half-way, SIGTERM, restore onto another
mesh / device count, params-only, an unreadable latest checkpoint, the non-finite guard.

Resume, kill and signal tests run the `jaxdist.train` command on a very small model: as real subprocesses
where the test is about the process (B killed, T signalled, T4 on another device count), in-process
(`train.main`) where it is not (A, C, R; same XLA flags and compilation cache as the subprocesses).
All runs share one schedule (40 steps, a checkpoint every 10) so they are comparable step by step:
  A  straight 40 steps on fsdp=8 (the reference)
  B  same, SIGKILLed while the step-30 save is in flight (so after the step-20 save completed)
  C  B's command again: resumes from step 20, must equal A bitwise (losses 21-40 and parameters)
  T  same, SIGTERM once the step-10 save is under way: saves at the current step and exits 0
  T4 T's command again on 4 devices: resumes, loss curve within 1e-5 of A
  R  --restore A's step 20 into a new run dir on dp=2,fsdp=4: loss curve within 1e-5 of A
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import MICRO_ARGS
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist import checkpoint, config, train
from jaxdist.checkpoint import storage
from jaxdist.data import loader as loader_mod
from jaxdist.distributed.mesh import mesh_from_string
from jaxdist.errors import JaxdistError
from jaxdist.training import step
from jaxdist.training.signals import StopSignal

REPO = Path(__file__).resolve().parent.parent
SMALL = [
    *MICRO_ARGS,
    "optim.warmup_steps=2",
    "train.eval_every=0",
    "train.log_every=1",
]
SCHEDULE = ["train.steps=40", "checkpoint.every=10", "checkpoint.keep=2"]


class Train:
    """`python -m jaxdist.train` in a subprocess; stdout is read by a thread as lines come. `signal_on=(regex,
    signal)` sends the signal the moment a matching line appears (from the reader thread, so another
    run's wait cannot delay it)."""

    def __init__(self, run_dir: Path, *args: str, signal_on: tuple[str, int] | None = None):
        self.run_dir, self.signal_on, self.signalled_at = run_dir, signal_on, None
        self.stderr = open(f"{run_dir}.stderr", "w")  # noqa: SIM115 (the child's stderr for its lifetime)
        cmd = [sys.executable, "-u", "-m", "jaxdist.train", "--run-dir", str(run_dir), *SMALL, *SCHEDULE, *args]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=self.stderr, text=True)
        self.out: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if self.signal_on and self.signalled_at is None and re.search(self.signal_on[0], line):
                self.proc.send_signal(self.signal_on[1])
                self.signalled_at = time.monotonic()
            self.out.append(line)

    def finish(self, timeout: float = 300) -> int:
        rc = self.proc.wait(timeout)
        self.reader.join(timeout)
        self.stderr.close()
        return rc

    def text(self) -> str:
        return "".join(self.out) + Path(f"{self.run_dir}.stderr").read_text()[-3000:]


def losses(run_dir: Path) -> dict[int, float]:
    """Loss per step from metrics.jsonl; after a resume, a step's later line wins."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            out[record["step"]] = record["loss"]
    return out


def listing(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    started: list[Train] = []
    try:
        yield _run_all(root, started)
    finally:
        for proc in started:
            if proc.proc.poll() is None:
                proc.proc.kill()


def in_process(run_dir: Path, *args: str) -> str:
    """The same command as `Train` run by `train.main` in this process: its printed lines."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = train.main(["--run-dir", str(run_dir), *SMALL, *SCHEDULE, *args])
    assert rc == 0, out.getvalue()[-3000:]
    return out.getvalue()


def _run_all(root: Path, started: list) -> dict:
    def spawn(*args, **kwargs):
        started.append(Train(*args, **kwargs))
        return started[-1]

    b = spawn(root / "b", signal_on=(r"checkpoint step 30: writing in background", signal.SIGKILL))
    t = spawn(root / "t", signal_on=(r"checkpoint step 10: writing in background", signal.SIGTERM))
    in_process(root / "a", "checkpoint.keep=3")  # while B and T run
    out = {"root": root}

    out["b_rc"] = b.finish()
    out["b_listing"] = listing(root / "b")
    out["b_text"] = b.text()

    out["t_rc"] = t.finish()
    out["t_exit_s"] = time.monotonic() - t.signalled_at
    out["t_text"] = t.text()

    t4 = spawn(root / "t", "--cpu-devices", "4")
    out["c_text"] = in_process(root / "b")  # the same command again resumes B
    out["r_text"] = in_process(root / "r", "--restore", str(root / "a" / "checkpoints" / "20"), "--mesh", "dp=2,fsdp=4")
    assert t4.finish() == 0, t4.text()
    out["t4_text"] = t4.text()
    return out


def test_sigkill_mid_save_resumes_bit_exact(runs):
    root = runs["root"]
    assert runs["b_rc"] == -signal.SIGKILL
    # The step-30 save was in flight: only its tmp folder exists, it is not a step, and step 10 (which
    # keep=2 would drop once 30 is complete) was not deleted early.
    assert runs["b_listing"] == ["10", "20", "30.orbax-checkpoint-tmp"], runs["b_listing"]
    assert re.search(r"restored step 20 from .*checkpoints/20", runs["c_text"]), runs["c_text"]
    ref, resumed = losses(root / "a"), losses(root / "b")
    assert sorted(ref) == list(range(1, 41))
    assert [resumed[s] for s in range(21, 41)] == [ref[s] for s in range(21, 41)]  # exact floats
    want = checkpoint.load_params(root / "a" / "checkpoints" / "40")
    got = checkpoint.load_params(root / "b" / "checkpoints" / "40")
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got)):
        assert x.tobytes() == y.tobytes(), jax.tree_util.keystr(path)
    assert listing(root / "b") == ["30", "40"]  # the stale tmp folder was cleaned, keep=2 applied


def test_sigterm_saves_current_step_and_resumes_on_4_devices(runs):
    root = runs["root"]
    assert runs["t_rc"] == 0, runs["t_text"]
    # From the signal to the exit: the step in flight, one save, the shut-down. Bounded far above that
    # (it took 56 s at load 25 on 2 cores, against 30 s allowed before) and far below the 40 steps the
    # run would need if the signal were ignored; `stopped < 40` below is the sharp check.
    assert runs["t_exit_s"] < 120, runs["t_exit_s"]
    m = re.search(r"stopped by SIGTERM at step (\d+); latest checkpoint: step (\d+)", runs["t_text"])
    assert m and m.group(1) == m.group(2), runs["t_text"]
    stopped = int(m.group(1))
    assert 10 < stopped < 40
    assert re.search(rf"restored step {stopped} from .*checkpoints/{stopped}", runs["t4_text"])
    assert "over 4 cpu devices" in runs["t4_text"]
    ref, resumed = losses(root / "a"), losses(root / "t")
    steps = range(stopped + 1, 41)
    np.testing.assert_allclose([resumed[s] for s in steps], [ref[s] for s in steps], rtol=1e-5)


def test_restore_from_another_run_onto_another_mesh(runs):
    root = runs["root"]
    assert "mesh dp=2,fsdp=4 over" in runs["r_text"]
    ref, other = losses(root / "a"), losses(root / "r")
    assert min(other) == 21  # started at step 20 of run A, not from scratch
    steps = range(21, 41)
    np.testing.assert_allclose([other[s] for s in steps], [ref[s] for s in steps], rtol=1e-5)


# ---- in-process: restore paths on run A's checkpoints ------------------------------------------------


@pytest.fixture(scope="module")
def small_program():
    cfg = config.load(None, SMALL + SCHEDULE)
    prog = step.build_program(cfg, mesh_from_string("fsdp=8"))
    return cfg, prog, loader_mod.Loader(cfg, prog.batch_sharding)


def test_unreadable_latest_is_reported_and_previous_used(runs, small_program, tmp_path):
    import shutil

    cfg, prog, loader = small_program
    copy = tmp_path / "run"
    shutil.copytree(runs["root"] / "a", copy)
    for f in (copy / "checkpoints" / "40" / "params").rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage")
    messages = []
    restored = checkpoint.restore(copy, prog, loader, cfg, log=messages.append)
    assert restored.step == 30 and restored.path == copy / "checkpoints" / "30"
    assert any("checkpoints/40 could not be restored" in m for m in messages), messages
    assert loader.get_state() == {"next_index": 30}
    want = checkpoint.load_params(runs["root"] / "a" / "checkpoints" / "30")
    for x, y in zip(jax.tree.leaves(want), jax.tree.leaves(restored.state.params)):
        assert x.tobytes() == np.asarray(y).tobytes()


def test_params_only_starts_a_fresh_optimizer(runs, small_program):
    cfg, prog, loader = small_program
    source = runs["root"] / "a" / "checkpoints" / "20"
    restored = checkpoint.restore(source, prog, loader, cfg, params_only=True)
    assert restored.step == 0 and int(restored.state.step) == 0
    want = checkpoint.load_params(source)
    for x, y in zip(jax.tree.leaves(want), jax.tree.leaves(restored.state.params)):
        assert x.tobytes() == np.asarray(y).tobytes()
    assert all(float(jnp.abs(x).max()) == 0 for x in jax.tree.leaves(restored.state.opt_state))


def test_different_model_names_the_tensor(runs):
    cfg = config.load(None, SMALL + SCHEDULE + ["model.mlp_dim=256"])
    prog = step.build_program(cfg, mesh_from_string("fsdp=8"))
    with pytest.raises(
        JaxdistError,
        match=r"tensor params/blocks/mlp/w_down_FD has shape \(1, 64, 32\) "
        r"there but \(1, 256, 32\)",
    ):
        checkpoint.restore(runs["root"] / "a", prog, None, cfg)


# ---- the non-finite guard ------------------------------------------------------------------------------


def test_nonfinite_step_leaves_state_unchanged(small_program):
    cfg, prog, loader = small_program
    state = prog.init_state(0)
    good = next(loader)
    bad = jnp.full(good.shape, cfg.model.vocab_size, jnp.int32)  # out-of-vocab ids: NaN loss
    bad = jax.device_put(bad, prog.batch_sharding)
    before = jax.tree.map(np.asarray, state)
    state, m = prog.train_step(state, bad)
    assert int(m["skipped"]) == 1 and not np.isfinite(float(m["grad_norm"]))
    assert int(state.step) == 1 and int(state.skipped) == 1
    for x, y in zip(
        jax.tree.leaves((before.params, before.opt_state)), jax.tree.leaves((state.params, state.opt_state))
    ):
        assert x.tobytes() == np.asarray(y).tobytes()
    state, m = prog.train_step(state, good)
    assert int(m["skipped"]) == 0 and int(state.skipped) == 0 and np.isfinite(float(m["loss"]))


# 8 steps on run A's LR schedule (40 steps): the same train-step program as run A's, loaded from the
# compilation cache when the file runs whole instead of compiled again.
POISONED = ["train.steps=8", "optim.schedule_steps=40"]


def test_poisoned_batch_is_skipped_counted_and_training_continues(tmp_path, monkeypatch):
    from jaxdist import run

    monkeypatch.setenv("JAXDIST_TEST_POISON_STEP", "4")
    cfg = config.load(None, SMALL + POISONED + ["checkpoint.every=2"])
    run(cfg, tmp_path / "run", log=lambda *a: None)
    records = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r for r in records if "loss" in r}
    assert [by_step[s]["skipped_steps"] for s in range(1, 9)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert not np.isfinite(by_step[5]["grad_norm"])
    assert all(np.isfinite(by_step[s]["loss"]) and np.isfinite(by_step[s]["grad_norm"]) for s in (6, 7, 8))
    assert by_step[8]["loss"] < by_step[4]["loss"]  # still learning after the skipped step
    assert by_step[8]["skipped_steps"] == 1 and records[-1]["skipped_steps"] == 1
    assert listing(tmp_path / "run") == ["2", "4", "6", "8"][-cfg.checkpoint.keep :]


def test_too_many_skips_stop_and_keep_the_last_good_checkpoint(tmp_path, monkeypatch):
    from jaxdist import run

    monkeypatch.setenv("JAXDIST_TEST_POISON_STEP", "5")
    cfg = config.load(None, SMALL + POISONED + ["checkpoint.every=2", "train.max_skipped_steps=1"])
    messages = []
    with pytest.raises(JaxdistError, match="1 consecutive steps had non-finite"):
        run(cfg, tmp_path / "run", log=messages.append)
    # Step 6 is the poisoned one (index 5): its metrics are read before its save (a checkpoint step's
    # are read at once), so the run stops there and never writes step 6; 4 stays the latest.
    assert listing(tmp_path / "run") == ["2", "4"]
    assert not any(m.startswith("checkpoint step 6") for m in messages), messages


def test_reducer_state_is_saved_and_restored(tmp_path):
    """Error-feedback residuals (reduce.method=topk) travel with the train state: restored bitwise, and
    the next step from the restored state equals the next step from the original."""
    cfg = config.load(None, SMALL + SCHEDULE + ["reduce.method=topk", "reduce.ratio=0.05", "reduce.warmup_fraction=0"])
    prog = step.build_program(cfg, mesh_from_string("dp=2,fsdp=4"))
    loader = loader_mod.Loader(cfg, prog.batch_sharding)
    state = prog.init_state(0)
    for _ in range(2):
        state, _ = prog.train_step(state, next(loader))
    assert any(float(jnp.abs(x).max()) > 0 for x in jax.tree.leaves(state.reducer_state))
    saver = checkpoint.Saver(tmp_path, cfg, log=lambda *a: None)
    saver.save(state, 2, loader)
    saver.close()
    restored = checkpoint.restore(tmp_path, prog, loader, cfg).state
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(restored)):
        assert x.sharding == y.sharding and np.asarray(x).tobytes() == np.asarray(y).tobytes()
    batch = next(loader)
    (a, _), (b, _) = prog.train_step(state, batch), prog.train_step(restored, batch)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


def test_first_signal_requests_a_stop_second_sigint_aborts():
    with StopSignal() as stopper:
        assert not stopper.requested()
        # raise_signal delivers to this (the main) thread before it returns, so the Python handler runs at
        # the next bytecode; os.kill may land on another thread and run it later, past the block below
        signal.raise_signal(signal.SIGTERM)
        assert stopper.requested() and stopper.received == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGTERM) is not stopper._handle  # previous handlers are back


def test_pipeline_layout_change_is_named():
    """A checkpoint saved with pp=2 (stack stored (stage, layers/stage, ...)) restored on pp=1 says so."""
    saved = {"blocks": {"w": jax.ShapeDtypeStruct((2, 2, 8, 16), jnp.float32)}}
    wanted = {"blocks": {"w": jax.ShapeDtypeStruct((4, 8, 16), jnp.float32)}}
    with pytest.raises(JaxdistError, match="another pipeline layout: params/blocks/w"):
        checkpoint.check_model(saved, wanted, Path("ckpt"))
    with pytest.raises(JaxdistError, match="different model: tensor params/blocks/w"):
        checkpoint.check_model({"blocks": {"w": jax.ShapeDtypeStruct((4, 8, 32), jnp.float32)}}, wanted, Path("c"))


def test_train_state_layout_change_is_named():
    """Optimizer or reducer state of another layout (another reduce.method, or int8 state from before
    its requantisation feedback) is named with the setting and the fix, not left to orbax's tree error."""
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    adam = {"mu": {"w": f32(4, 8)}, "nu": {"w": f32(4, 8)}, "count": jax.ShapeDtypeStruct((), jnp.int32)}
    int8 = config.load(None, ["reduce.method=int8"])
    now = {"opt_state": adam, "reducer_state": {"residual": {"w": f32(8, 4, 8)}, "chunk": {"w": f32(8, 256)}}}
    older = {"opt_state": adam, "reducer_state": {"residual": {"w": f32(8, 4, 8)}}}
    saved_config = {"reduce": {"method": "int8"}}
    checkpoint.check_train_state(now, now, saved_config, int8, Path("c"))  # same layout: passes
    with pytest.raises(
        JaxdistError, match=r"holds reduce.method=int8 state in another layout \(1 tensors saved, 2 "
    ) as err:
        checkpoint.check_train_state(older, now, saved_config, int8, Path("c"))
    assert "\n" not in str(err.value)  # one line
    with pytest.raises(JaxdistError, match="holds reduce.method=dense state, which reduce.method=int8 cannot"):
        dense = {"opt_state": adam, "reducer_state": ()}
        checkpoint.check_train_state(dense, now, {"reduce": {"method": "dense"}}, int8, Path("c"))
    sgd = {"opt_state": {"count": adam["count"]}, "reducer_state": now["reducer_state"]}
    with pytest.raises(JaxdistError, match="optimizer state in another layout than this config's optim"):
        checkpoint.check_train_state(sgd, now, saved_config, int8, Path("c"))


def test_read_only_manager_logs_no_notice(tmp_path):
    """Every reader opens a read-only manager; orbax's 'Given directory is read only' warning is dropped
    at the source (convert and generate printed it three or four times per call)."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    absl_logger = logging.getLogger("absl")
    absl_logger.addHandler(handler)
    level = absl_logger.level
    absl_logger.setLevel(logging.DEBUG)
    try:
        checkpoint.open_manager(tmp_path, read_only=True).all_steps()
        absl_logger.warning("Given directory is read only=%s", tmp_path)  # as orbax words it
        absl_logger.warning("another warning")
    finally:
        absl_logger.removeHandler(handler)
        absl_logger.setLevel(level)
    assert [r.getMessage() for r in records if r.levelno >= logging.WARNING] == ["another warning"]


def test_one_process_saves_whole_shards(tmp_path, monkeypatch):
    """With one process, each shard is copied to the host whole, once (orbax's replica-parallel default
    slices every replicated shard per replica: 288 slices per dp=2,fsdp=4 save of the SMALL model), opening
    the manager logs no warning, and both checkpoints, this one and one in orbax's default layout (as
    earlier versions wrote on CPU), read back bit for bit."""
    slices, warnings = [], []
    real = jax.lax.slice_in_dim
    monkeypatch.setattr(jax.lax, "slice_in_dim", lambda *a, **k: slices.append(a) or real(*a, **k))
    mesh = mesh_from_string("dp=2,fsdp=4")
    tree = {
        "replicated": jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P())),
        "half": jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(mesh, P("fsdp"))),  # 2 replicas each
    }
    save = ocp.args.Composite(params=ocp.args.StandardSave(tree))
    default = ocp.type_handlers.ArrayHandler(use_replica_parallel=True)  # orbax's own on CPU
    ocp.type_handlers.register_type_handler(jax.Array, default, override=True)
    try:
        parallel = ocp.CheckpointManager(tmp_path / "parallel")
        parallel.save(0, args=save)
        parallel.wait_until_finished()
        parallel.close()
    finally:  # the process-wide handler back to jaxdist's, whatever happened
        storage.whole_shards()
    assert slices  # orbax's default sliced, and the count sees it
    slices.clear()
    handler = logging.Handler(logging.WARNING)
    handler.emit = warnings.append
    logging.getLogger("absl").addHandler(handler)
    try:
        manager = checkpoint.open_manager(tmp_path / "whole")  # registers whole shards, as every writer does
    finally:
        logging.getLogger("absl").removeHandler(handler)
    assert [r.getMessage() for r in warnings] == []  # not orbax's "overriding jax.Array"
    manager.save(0, args=save)
    manager.wait_until_finished()
    assert slices == []
    restore = ocp.args.Composite(params=ocp.args.StandardRestore(tree))
    for reader in (manager, checkpoint.open_manager(tmp_path / "parallel", read_only=True)):
        back = reader.restore(0, args=restore)["params"]
        for k, v in tree.items():
            np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(v))
        reader.close()
