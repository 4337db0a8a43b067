"""Compile the train step and run the step loop with its hooks (profile, checkpoint, batches, metrics);
after a failed output, save what there is; draw the loss plot however the loop ends."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from jaxdist.checkpoint.saving import Saver
from jaxdist.data import mixture, prompt_stream
from jaxdist.data.loader import Loader
from jaxdist.errors import JaxdistError
from jaxdist.objectives import registry as objectives
from jaxdist.observe import metrics, plots, profiling, report
from jaxdist.observe.metrics import reason
from jaxdist.training import hooks

if TYPE_CHECKING:
    from jaxdist.training.state import BatchStream, RunState


def compile_step(run: RunState) -> None:
    """`run`'s first state, first batch, compiled step, its seconds, the planner's predicted bytes per device."""
    t0 = time.perf_counter()
    run.state = run.restored.state if run.restored else run.prog.init_state(run.cfg.train.seed)
    run.first = next(run.loader)
    if run.driver is not None:  # GRPO: the first batch is prompts; the step's batch is the scored rollouts
        batch = jax.ShapeDtypeStruct(run.driver.batch_shape, jnp.int32, sharding=run.prog.batch_sharding)
        run.compiled = run.prog.train_step.lower(run.state, batch).compile()
        run.driver.use(run.compiled)
    else:
        run.compiled = run.prog.train_step.lower(run.state, run.first).compile()
    run.compile_s = time.perf_counter() - t0
    run.predicted = predicted = report.predicted_bytes(run.cfg, run.mesh)
    if run.is_main:
        run.log(
            f"compiled in {run.compile_s:.1f}s; {report.compiled_line(run.compiled)}"
            + (f"; planner predicts {predicted / 2**20:,.1f} MiB per device" if predicted else "")
        )


def train(run: RunState) -> None:
    """The step loop with its hooks (profile, checkpoint, batches, metrics) -> `run.steps_done`, `run.plotted`
    (the loss plot or why there is none). The plot is drawn however the loop ends. `run.task_eval(params) ->
    {eval/TASK/METRIC: value}` runs beside the held-out loss at each evaluation (train.eval_tasks)."""

    run_dir, stopper, saver, progress = run.run_dir, run.stopper, run.saver, run.progress
    eval_arrays, task_eval, state, start = run.eval_arrays, run.task_eval, run.state, run.start

    def held_out(state) -> float | dict:
        """The held-out loss; a preference objective's also its statistics ({"loss": ..., "rewards/...": ...});
        GRPO's: the reward of completions sampled for the held-out prompts ({"reward": ..., ...}, no loss)."""
        if run.driver is not None:
            return run.driver.evaluate(state.params, eval_arrays, prompt_stream.seed(run.cfg, -1))
        if not objectives.is_default(run.cfg):
            sums = jax.device_get([run.prog.eval_step(state.params, state.reducer_state, b) for b in eval_arrays])
            pairs = sum(float(c) for _, c, _ in sums)
            stats = {k: sum(float(st[k]) for _, _, st in sums) / pairs for k in sums[0][2]}
            return {"loss": sum(float(x) for x, _, _ in sums) / pairs, **stats}
        sums = [run.prog.eval_step(state.params, b) for b in eval_arrays]
        if names := getattr(run.loader, "eval_names", None):  # data.sources: each source's loss too (eval_loss/NAME)
            return mixture.eval_losses(names, [(float(x), float(c)) for x, c in sums])
        return float(sum(float(x) for x, _ in sums) / sum(float(c) for _, c in sums))

    def evaluate(state) -> float | dict:
        """held_out, with train.eval_tasks' {"eval/TASK/METRIC": ...} beside it."""
        got = held_out(state)
        if task_eval is None:
            return got
        return (got if isinstance(got, dict) else {"loss": got}) | task_eval(state.params)

    stopper.training = True
    batches = hooks.Batches(run.loader, run.first)
    saver.carry = progress.carry  # the smoothed loss goes into each checkpoint
    metrics_hook = hooks.Metrics(progress, evaluate, run.cfg.train.eval_every)
    per_step = [
        hooks.Profile(profiling.StepTrace(run.cfg.train.profile_steps, run_dir / "profile", progress.say)),
        hooks.Checkpoint(saver, run.loader, before_save=metrics_hook.flush),
        batches,
        metrics_hook,
    ]
    steps_done = start
    plotted = None
    try:
        with contextlib.closing(saver):
            try:
                state, steps_done = hooks.run_steps(
                    step_function(run, batches),
                    state,
                    start,
                    run.cfg.train.steps,
                    stopper.requested,
                    per_step,
                )
            except metrics.OutputFailed as e:  # metrics.jsonl or a tracker: stop, keeping the work if there is room
                raise metrics.OutputFailed(
                    f"{e}; stopping: {_save_after_failure(saver, per_step, run.loader)}"
                ) from None
            except hooks.DataFailed as e:  # the next batch cannot be read: the steps done are kept
                metrics_hook.flush(e.end)  # their log lines and metrics.jsonl records first
                kept = _save_after_failure(saver, per_step, run.loader, then="fix the data, then run the same command")
                skips = run.loader.skip_note() if isinstance(run.loader, Loader) else ""
                raise JaxdistError(f"{e}{skips}; stopping: {kept}") from None
        for h in per_step:
            h.close(state)
    finally:  # also on a stop, a crash or a second Ctrl-C: the picture of what was done
        progress.close()
        if run.is_main:
            plotted = _plot(run_dir) if run.cfg.train.plot else "train.plot=false"
        run.steps_done, run.plotted = steps_done, plotted


def step_function(run: RunState, batches: hooks.Batches):
    """`state -> (state, metrics)` on the current batch: the compiled step, or GRPO's driver (sample the
    batch's prompts with the step's seed, score, train)."""
    driver = run.driver
    if driver is None:
        return lambda st: run.compiled(st, batches.current)
    cfg = run.cfg

    def grpo_step(st):
        batch = batches.current
        if batch is None:
            raise RuntimeError("a step was dispatched after the last one (no batch drawn)")
        return driver.step(st, batch.records, prompt_stream.seed(cfg, batch.step))

    return grpo_step


def _plot(run_dir: Path):
    """loss.png, or why there is none: a picture must never hide the run's own outcome or error."""
    try:
        return plots.loss_png(run_dir)
    except Exception as e:
        return str(e) if isinstance(e, JaxdistError) else reason(e)


def _save_after_failure(
    saver: Saver,
    per_step: list[hooks.Hook],
    loader: BatchStream,
    then: str = "free space or fix the folder, then run the same command",
) -> str:
    """After metrics, a tracker or the data failed: a checkpoint of the last step if there is room, else why not."""
    ckpt = next(h for h in per_step if isinstance(h, hooks.Checkpoint))
    batches = next(h for h in per_step if isinstance(h, hooks.Batches))
    then += " to resume"
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
