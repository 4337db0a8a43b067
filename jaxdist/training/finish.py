"""How a run ends: its `RunResult`; the results of a run that ends before writing (stopped during
start-up, nothing left to train); the summary line of metrics.jsonl and the closing lines."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from jaxdist.checkpoint.saving import Saver
from jaxdist.data.loader import Loader
from jaxdist.observe import metrics, report
from jaxdist.training.opening import local_devices
from jaxdist.training.signals import StopSignal
from jaxdist.training.state import RunResult

if TYPE_CHECKING:
    from jaxdist.training.state import RunState


def stopped_before_training(stopper: StopSignal, run_dir: Path, log: Callable[..., None]) -> RunResult | None:
    """A stop (SIGTERM, Ctrl-C) that came before the first step: said, nothing saved."""
    if not stopper.requested():
        return None
    log(
        f"stopped by {stopper.received} during start-up: no step was taken and nothing was saved; "
        "run the same command to start"
    )
    return RunResult(run_dir, float("nan"), None, 0.0, 0)


def before_writing(run: RunState) -> RunResult | None:
    """A result without writing anything: stopped during start-up, or nothing left to train."""
    run_dir, start, steps = run.run_dir, run.start, run.cfg.train.steps
    if (stopped := stopped_before_training(run.stopper, run_dir, run.log)) is not None:
        return stopped
    if start >= steps:
        assert run.restored is not None  # start > 0 only when restored
        run.log(
            f"nothing to do: {run.restored.path} is already at step {start} of train.steps={steps} "
            "(raise --steps to train further, or pass --run-dir for a new run)"
        )
        return RunResult(run_dir, float("nan"), None, 0.0, start)
    return None


def finish(run: RunState) -> RunResult:
    """The summary line of metrics.jsonl, the closing lines; -> the run's result."""

    stopper, saver, progress = run.stopper, run.saver, run.progress
    run_dir, steps_done, plotted = run.run_dir, run.steps_done, run.plotted
    summary = progress.summary(steps_done, run.compile_s)
    devices = local_devices(run.mesh)
    summary.update(report.memory_summary(run.compiled, run.predicted, metrics.device_memory(devices)))
    mix = run.loader.mixture if isinstance(run.loader, Loader) else None
    skipped = mix.skip_counts() if mix is not None else {}
    if skipped:  # documents a streamed source left out (not UTF-8), each counted once
        summary["data_skipped"] = skipped
    try:
        run.writer.write(summary)
        run.writer.close()
    except (metrics.OutputFailed, OSError) as e:
        kept = f"checkpoint step {saver.last_saved} is saved" if saver.last_saved else "no checkpoint was saved"
        raise metrics.OutputFailed(
            f"{e if isinstance(e, metrics.OutputFailed) else metrics.reason(e)}; stopping: {kept}; free space "
            "or fix the folder, then run the same command to resume"
        ) from None
    log = run.log
    ev = f", eval loss {summary['eval_loss']:.4f}" if summary["eval_loss"] is not None else ""
    log(report.memory_line(summary))
    # a stopped run is not done: say so here, and let the stop line (signal, step, checkpoint) close
    head = "stopped early" if stopper.received else "done"
    log(
        f"{head}: {steps_done} steps, loss {summary['final_loss']:.4f} (smoothed {summary['final_loss_smooth']:.4f})"
        f"{ev} nats/token, {summary['tokens_per_sec']:,.0f} tokens/s, {progress.throughput_text(summary)}, "
        f"run dir {run_dir}, "
        + (f"loss plot {plotted}" if isinstance(plotted, Path) else f"no loss plot ({plotted})")
        + (mix.skip_note() if mix is not None else "")
    )
    if stopper.received:
        log(_stopped_line(stopper, saver, steps_done))
    return RunResult(run_dir, summary["final_loss"], summary["eval_loss"], summary["tokens_per_sec"], steps_done)


def _stopped_line(stopper: StopSignal, saver: Saver, steps_done: int) -> str:
    if saver.last_saved is not None:
        return (
            f"stopped by {stopper.received} at step {steps_done}; latest checkpoint: step {saver.last_saved} "
            f"in {saver.directory}; run the same command to resume"
        )
    return (
        f"stopped by {stopper.received} at step {steps_done}; no checkpoint was saved in {saver.directory}; "
        "run the same command to start again"
    )
