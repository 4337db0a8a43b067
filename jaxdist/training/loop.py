"""One training run: start-up checks, restore, the step loop (`hooks`), the closing report.

`run` is what `python -m jaxdist.train` calls after parsing the command line; tests and notebooks call
it directly. Everything that can fail on input fails before the run folder is written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jaxdist import checkpoint
from jaxdist import config as config_mod
from jaxdist.config import relative
from jaxdist.data import run_tokenizer
from jaxdist.errors import JaxdistError
from jaxdist.observe import plots, report, trackers
from jaxdist.training import hooks, rundir

# A write that fails for these reasons (the lock, config.yaml, the tokenizer record, ...) is the
# user's environment, not a bug: one line instead of a traceback.
WRITE_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO, errno.EFBIG}


def with_resolved_mesh(cfg, num_devices: int):
    """`cfg` with `mesh.shape` as the sizes it resolves to on `num_devices` (fsdp=-1 -> fsdp=8)."""
    # deferred: jax loads on first use, not when python -m jaxdist.train starts
    from jaxdist.distributed import mesh as mesh_mod

    return cfg.replace(mesh=dict(shape=mesh_mod.format_mesh(mesh_mod.parse_mesh(cfg.mesh.shape, num_devices))))


@dataclasses.dataclass
class RunResult:
    run_dir: Path
    final_loss: float
    eval_loss: float | None
    tokens_per_sec: float
    steps: int


def run(
    cfg,
    run_dir: Path,
    log=print,
    restore: str | None = None,
    stopper=None,
    allowed: frozenset[str] = frozenset(),
    origin: str = "",
) -> RunResult:
    """Train `cfg` and write the run folder. Everything that can fail on input fails before writing.

    Starts from this run dir's latest checkpoint if it has one, else from `restore` (another run's
    checkpoint), else from scratch. SIGTERM / SIGINT stop after the current step with a checkpoint
    (before the first step, if they come during start-up: `stopper` is installed by `main`).
    `allowed`: config keys that may differ from the resumed checkpoint's. `origin`: how the run dir was
    chosen, for the start-up line that says whether it resumed.
    """
    own = stopper is None
    stopper = stopper or checkpoint.StopSignal()
    lock = rundir.RunLock(run_dir)
    # `closers`: the progress bar and metric writers, closed however the run ends (a failed save must
    # leave its one error line on a line of its own, and no flush traceback at exit).
    with stopper if own else contextlib.nullcontext(), contextlib.ExitStack() as closers:
        try:
            return _run(cfg, Path(run_dir), log, restore, stopper, allowed, lock, closers, origin)
        except OSError as e:
            if e.errno not in WRITE_ERRORS:
                raise
            raise JaxdistError(
                f"cannot write {e.filename or run_dir} ({(e.strerror or str(e)).lower()}); stopping: "
                "free space or fix the folder, then run the same command to resume"
            ) from None
        finally:
            with contextlib.suppress(OSError):  # a full disk cannot hide the run's own error
                lock.release()


def _quietly(close):
    def call():
        with contextlib.suppress(OSError):  # e.g. a full disk: the run's own error says so
            close()

    return call


def _stopped_before_training(stopper, run_dir: Path, log) -> RunResult | None:
    if not stopper.requested():
        return None
    log(
        f"stopped by {stopper.received} during start-up: no step was taken and nothing was saved; "
        "run the same command to start"
    )
    return RunResult(run_dir, float("nan"), None, 0.0, 0)


@dataclasses.dataclass
class _Setup:
    """What set-up decides before anything is written: the resolved config, the mesh, the program, the data."""

    cfg: Any
    mesh: Any
    prog: Any
    loader: Any
    run_tok: Any  # run_tokenizer.RunTokenizer: what the token ids mean (recorded once writing starts)
    is_main: bool
    log: Callable
    no_eval: str | None  # why evaluation is off, decided now (said below the data line)
    flops_tok: float
    peak: float | None
    peak_source: str


def _run(cfg, run_dir: Path, log, restore, stopper, allowed, lock, closers, origin) -> RunResult:
    """Set up, restore, (start writing), compile, run, finish: what the trainer does, in that order."""
    s = _set_up(cfg, run_dir, log, lock)
    resuming, from_hf, restored = _restore(s.cfg, run_dir, s.prog, s.loader, restore, allowed, s.is_main, s.log)
    start = restored.step if restored else 0
    if (early := _before_writing(s, run_dir, stopper, restored, start)) is not None:
        return early
    # Input is valid: from here on we write.
    writer = _start_writing(s, run_dir, lock, closers, restored, resuming, restore, origin, start)
    if restored is not None:
        _restored_lines(s, run_dir, restored, resuming, from_hf, start)
    saver = _saver(s, run_dir)
    state, first, compiled, compile_s, predicted = _compile(s, restored)
    eval_arrays = s.loader.eval_arrays()
    progress = _progress(s, writer, closers, saver, state, restored if resuming else None, start)
    if (stopped := _stopped_before_training(stopper, run_dir, s.log)) is not None:
        saver.close()
        return stopped
    steps_done, plotted = _train(s, run_dir, stopper, saver, progress, compiled, state, first, eval_arrays, start)
    return _finish(s, run_dir, stopper, saver, progress, writer, compiled, compile_s, predicted, steps_done, plotted)


def _set_up(cfg, run_dir: Path, log, lock) -> _Setup:
    """Every check on input, then the config resolved on the mesh, the program and the data loader."""
    # deferred: flax, grain, jax, optax load on first use, not when python -m jaxdist.train starts
    import jax

    from jaxdist.data import loader as data
    from jaxdist.distributed import mesh as mesh_mod
    from jaxdist.models import flops
    from jaxdist.observe import metrics
    from jaxdist.training import step

    rundir.check_storable(run_dir)
    cfg = data.source_of_prepared(cfg, log)
    lock.check()  # another trainer on this run dir: refused before anything is read or written
    trackers.check_installed(cfg.train.trackers)  # a missing extra fails before any work
    run_tok = run_tokenizer.of_config(cfg)  # what the token ids mean, its files checked (recorded below)
    # matplotlib loads while the step compiles, so a SIGTERM only waits for drawing loss.png, not for imports
    threading.Thread(target=plots.pyplot, daemon=True).start()
    mesh = mesh_mod.mesh_from_string(cfg.mesh.shape, dcn_text=cfg.mesh.dcn)
    cfg = with_resolved_mesh(cfg, mesh.size)  # config.yaml records the sizes used, not -1
    cfg = data.resolve_token_dtype(cfg)  # ... and the token dtype read (a prepared folder's manifest decides)
    cfg = relative.resolve(cfg)  # ... and the steps that warm-up, eval and checkpoint fractions come to
    prog = step.build_program(cfg, mesh, eos_id=data.mask_eos(cfg))  # the step reads no files
    loader = data.Loader(cfg, prog.batch_sharding)
    is_main = jax.process_index() == 0
    log = log if is_main else (lambda *a, **k: None)  # multi-process: only process 0 speaks
    no_eval = data.no_eval_reason(cfg, loader)
    if no_eval:  # decided now, not at the first evaluation (said below the data line)
        cfg = cfg.replace(train=dict(eval_every=0))
    flops_tok = flops.flops_per_token(cfg.model, cfg.lora)
    peak, peak_source = metrics.peak_flops(
        list(mesh.devices.flat), str(step.compute_dtype(cfg.model)), cfg.train.peak_flops
    )
    return _Setup(cfg, mesh, prog, loader, run_tok, is_main, log, no_eval, flops_tok, peak, peak_source)


def _before_writing(s: _Setup, run_dir: Path, stopper, restored, start: int) -> RunResult | None:
    """A result without writing anything: stopped during start-up, or nothing left to train."""
    if (stopped := _stopped_before_training(stopper, run_dir, s.log)) is not None:
        return stopped
    if start >= s.cfg.train.steps:
        s.log(
            f"nothing to do: {restored.path} is already at step {start} of train.steps={s.cfg.train.steps} "
            "(raise --steps to train further, or pass --run-dir for a new run)"
        )
        return RunResult(run_dir, float("nan"), None, 0.0, start)
    return None


def _start_writing(s: _Setup, run_dir: Path, lock, closers, restored, resuming, restore, origin, start: int):
    """Take the lock, record the config and tokenizer, say the start-up lines; -> the metrics writer."""
    # deferred: jax, optax load on first use, not when python -m jaxdist.train starts
    from jaxdist.observe import metrics
    from jaxdist.optim import adamw

    cfg, log, is_main = s.cfg, s.log, s.is_main
    if not checkpoint.all_agree(not is_main or _take(lock, log)):
        raise lock.refused()
    run_dir.mkdir(parents=True, exist_ok=True)
    changes = restored.changes if restored is not None else {}
    if is_main:
        rundir.record_config(run_dir, config_mod.dump(cfg), start, changes)
        run_tokenizer.record(s.run_tok, run_dir)
        for line in [
            report.run_dir_line(run_dir, origin, restored, resuming, restore, cfg),
            *report.summary_lines(cfg, s.prog, s.flops_tok),
            report.data_line(cfg, s.loader),
            *([f"warning: {s.no_eval}; evaluation is off"] if s.no_eval else []),
            report.units_line(cfg),
            report.peak_line(s.peak, s.peak_source),
            *report.artefact_lines(cfg, run_dir),
        ]:
            log(line)
        log(relative.cadence_line(cfg))
        for line in adamw.schedule_notes(cfg, start, changes):
            log(line)
    tracked = trackers.Trackers(cfg.train.trackers, run_dir, cfg.to_dict(), config_mod.dump(cfg)) if is_main else None
    writer = metrics.MetricWriter(run_dir, enabled=is_main, resume_step=start if resuming else None, trackers=tracked)
    closers.callback(_quietly(writer.close))
    return writer


def _restored_lines(s: _Setup, run_dir: Path, restored, resuming: bool, from_hf: bool, start: int) -> None:
    """After a restore: newer checkpoints set aside, a Hugging Face source kept, the line that says what."""
    if resuming:
        checkpoint.set_aside_newer(run_dir, restored.step, s.log)
    if from_hf and s.is_main:
        # deferred: flax, jax, ml_dtypes load on first use, not when python -m jaxdist.train starts
        from jaxdist.hf import export

        export.keep_source(restored.path, run_dir)  # token ids and tokenizer for a later export
    what = "parameters" if (s.cfg.checkpoint.params_only or from_hf) and not resuming else f"step {start}"
    s.log(f"restored {what} from {restored.path} in {restored.seconds:.1f}s")


def _saver(s: _Setup, run_dir: Path):
    return checkpoint.Saver(run_dir, s.cfg, log=s.log if s.is_main else lambda *a: None)


def _compile(s: _Setup, restored):
    """-> (the first state, the first batch, the compiled step, seconds, the planner's predicted bytes
    per device)."""
    t0 = time.perf_counter()
    state = restored.state if restored else s.prog.init_state(s.cfg.train.seed)
    first = next(s.loader)
    compiled = s.prog.train_step.lower(state, first).compile()
    compile_s = time.perf_counter() - t0
    predicted = report.predicted_bytes(s.cfg, s.mesh)
    if s.is_main:
        s.log(
            f"compiled in {compile_s:.1f}s; {report.compiled_line(compiled)}"
            + (f"; planner predicts {predicted / 2**20:,.1f} MiB per device" if predicted else "")
        )
    return state, first, compiled, compile_s, predicted


def _local_devices(mesh):
    # deferred: jax loads on first use, not when python -m jaxdist.train starts
    import jax

    return [d for d in mesh.devices.flat if d.process_index == jax.process_index()]


def _progress(s: _Setup, writer, closers, saver, state, resumed, start: int):
    """The progress bar and per-step bookkeeping (`resumed`: the checkpoint it carries on from, or None);
    checkpoint messages go above the bar from now on."""
    # deferred: jax loads on first use, not when python -m jaxdist.train starts
    import jax

    from jaxdist.observe import metrics
    from jaxdist.observe.progress import Progress  # imports JAX: not before main() has its signal handlers

    local = _local_devices(s.mesh)
    progress = Progress(
        s.cfg,
        writer,
        s.cfg.train.global_batch * s.cfg.model.seq_len,
        s.flops_tok,
        s.peak,
        start=start,
        enabled=s.is_main,
        skipped_in_a_row=int(jax.device_get(state.skipped)),
        memory=lambda: metrics.device_memory(local),
        log=s.log,
        carry=resumed.progress if resumed is not None else None,
    )
    closers.callback(progress.close)
    saver.log = progress.say  # checkpoint messages go above the progress bar, not into it
    return progress


def _train(s: _Setup, run_dir: Path, stopper, saver, progress, compiled, state, first, eval_arrays, start: int):
    """The step loop with its hooks (profile, checkpoint, batches, metrics) -> (steps done, the loss
    plot or why there is none). The plot is drawn however the loop ends."""
    # deferred: jax loads on first use, not when python -m jaxdist.train starts
    from jaxdist.observe import metrics, profiling

    def evaluate(params) -> float:
        sums = [s.prog.eval_step(params, b) for b in eval_arrays]
        return float(sum(float(x) for x, _ in sums) / sum(float(c) for _, c in sums))

    stopper.training = True
    batches = hooks.Batches(s.loader, first)
    saver.carry = progress.carry  # the smoothed loss goes into each checkpoint
    metrics_hook = hooks.Metrics(progress, evaluate, s.cfg.train.eval_every)
    per_step = [
        hooks.Profile(profiling.StepTrace(s.cfg.train.profile_steps, run_dir / "profile", progress.say)),
        hooks.Checkpoint(saver, s.loader, before_save=metrics_hook.flush),
        batches,
        metrics_hook,
    ]
    steps_done = start
    plotted = None
    try:
        with contextlib.closing(saver):
            try:
                state, steps_done = hooks.run_steps(
                    lambda st: compiled(st, batches.current),
                    state,
                    start,
                    s.cfg.train.steps,
                    stopper.requested,
                    per_step,
                )
            except metrics.OutputFailed as e:  # metrics.jsonl or a tracker: stop, keeping the work if there is room
                raise metrics.OutputFailed(f"{e}; stopping: {_save_after_failure(saver, per_step, s.loader)}") from None
        for h in per_step:
            h.close(state)
    finally:  # also on a stop, a crash or a second Ctrl-C: the picture of what was done
        progress.close()
        if s.is_main:
            plotted = _plot(run_dir)
    return steps_done, plotted


def _finish(s: _Setup, run_dir, stopper, saver, progress, writer, compiled, compile_s, predicted, steps_done, plotted):
    """The summary line of metrics.jsonl, the closing lines; -> the run's result."""
    # deferred: jax loads on first use, not when python -m jaxdist.train starts
    from jaxdist.observe import metrics

    summary = progress.summary(steps_done, compile_s)
    summary.update(report.memory_summary(compiled, predicted, metrics.device_memory(_local_devices(s.mesh))))
    try:
        writer.write(summary)
        writer.close()
    except (metrics.OutputFailed, OSError) as e:
        kept = f"checkpoint step {saver.last_saved} is saved" if saver.last_saved else "no checkpoint was saved"
        raise metrics.OutputFailed(
            f"{e if isinstance(e, metrics.OutputFailed) else metrics.reason(e)}; stopping: {kept}; free space "
            "or fix the folder, then run the same command to resume"
        ) from None
    log = s.log
    ev = f", eval loss {summary['eval_loss']:.4f}" if summary["eval_loss"] is not None else ""
    log(report.memory_line(summary))
    log(
        f"done: {steps_done} steps, loss {summary['final_loss']:.4f} (smoothed {summary['final_loss_smooth']:.4f})"
        f"{ev} nats/token, {summary['tokens_per_sec']:,.0f} tokens/s, {progress.throughput_text(summary)}, "
        f"run dir {run_dir}, " + (f"loss plot {plotted}" if isinstance(plotted, Path) else f"no loss plot ({plotted})")
    )
    if stopper.received:
        log(_stopped_line(stopper, saver, steps_done))
    return RunResult(run_dir, summary["final_loss"], summary["eval_loss"], summary["tokens_per_sec"], steps_done)


def _stopped_line(stopper, saver, steps_done: int) -> str:
    if saver.last_saved is not None:
        return (
            f"stopped by {stopper.received} at step {steps_done}; latest checkpoint: step {saver.last_saved} "
            f"in {saver.directory}; run the same command to resume"
        )
    return (
        f"stopped by {stopper.received} at step {steps_done}; no checkpoint was saved in {saver.directory}; "
        "run the same command to start again"
    )


def _restore(cfg, run_dir: Path, prog, loader, restore, allowed, is_main: bool, log):
    """-> (resuming, from_hf, restored or None): this run dir's latest checkpoint, else `restore` (another
    run's checkpoint, or hf:DIR for a Hugging Face model's weights with a fresh optimizer), else nothing."""
    resuming = checkpoint.has_checkpoints(run_dir / checkpoint.SUBDIR)
    if not resuming:
        checkpoint.check_run_dir_model(run_dir, cfg)
    restored = None
    from_hf = bool(restore and restore.startswith("hf:")) and not resuming
    if from_hf:  # fine-tune a Hugging Face checkpoint: its weights, a fresh optimizer
        # deferred: flax, jax, ml_dtypes load on first use, not when python -m jaxdist.train starts
        from jaxdist.hf import tensors

        restored = tensors.restore_for_training(restore[3:], prog, cfg)
    elif resuming or restore:
        if resuming and restore and is_main:
            log(f"{run_dir} has its own checkpoints: resuming them (--restore {restore} ignored)")
        restored = checkpoint.restore(
            run_dir if resuming else Path(restore),
            prog,
            loader,
            cfg,
            params_only=cfg.checkpoint.params_only and not resuming,
            log=log,
            allowed=allowed,
            drift=resuming,
        )
    return resuming, from_hf, restored


def _plot(run_dir: Path):
    """loss.png, or why there is none: a picture must never hide the run's own outcome or error."""
    try:
        return plots.loss_png(run_dir)
    except Exception as e:
        # deferred: jax loads on first use, not when python -m jaxdist.train starts
        from jaxdist.observe.metrics import reason

        return str(e) if isinstance(e, JaxdistError) else reason(e)


def _save_after_failure(saver, per_step, loader) -> str:
    """After metrics or a tracker failed: a checkpoint of the last step if there is room, else why not."""
    ckpt = next(h for h in per_step if isinstance(h, hooks.Checkpoint))
    batches = next(h for h in per_step if isinstance(h, hooks.Batches))
    then = "free space or fix the folder, then run the same command to resume"
    if ckpt.latest is None:
        return f"no step was completed; {then}"
    state, done = ckpt.latest
    try:
        saver.wait()
        if saver.last_saved != done:
            if batches.before is not None and batches.before[0] == done:
                loader.set_state(batches.before[1])  # the iterator as it was at this step, as a save expects
            saver.save(state, done, loader)
            saver.wait()
    except JaxdistError as e:
        return f"no checkpoint for step {done} either ({e})"
    if saver.last_saved == done:
        return f"checkpoint step {done} saved in {saver.directory}; {then}"
    return f"step {done} was not saved (non-finite); the latest checkpoint is {saver.last_saved}; {then}"


def _take(lock, log) -> bool:
    try:
        note = lock.acquire()
    except JaxdistError:
        return False
    except OSError as e:  # e.g. a full disk at the lock's write: not another trainer
        if e.errno not in WRITE_ERRORS:
            raise
        raise JaxdistError(
            f"cannot write the lock {lock.path} ({(e.strerror or str(e)).lower()}); free space or fix the "
            "folder, then run the same command to resume"
        ) from None
    if note:
        log(note)
    return True
