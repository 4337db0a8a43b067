"""One training run, in order: set up, restore, start writing, compile, run, finish.

`run` is what `python -m jaxdist.train` calls after parsing the command line; tests and notebooks call
it directly. Everything that can fail on input fails before the run folder is written. Each step is a
module of this package: `startup` (checks, config, mesh, program, data), `resume` (where it starts
from), `opening` (lock, records, start-up lines, writers, progress bar), `stepping` (compile, the step
loop and its hooks, the loss plot), `finish` (the summary and closing lines, the result).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from jaxdist import checkpoint
from jaxdist.errors import JaxdistError
from jaxdist.training import opening, resume, rundir, startup, stepping
from jaxdist.training.finish import RunResult, before_writing, finish, stopped_before_training


def run(
    cfg,
    run_dir: Path,
    log=print,
    restore: str | None = None,
    stopper=None,
    allowed: frozenset[str] = frozenset(),
    origin: str = "",
    tasks=None,
) -> RunResult:
    """Train `cfg` and write the run folder. Everything that can fail on input fails before writing.

    Starts from this run dir's latest checkpoint if it has one, else from `restore` (another run's
    checkpoint), else from scratch. SIGTERM / SIGINT stop after the current step with a checkpoint
    (before the first step, if they come during start-up: `stopper` is installed by `main`).
    `allowed`: config keys that may differ from the resumed checkpoint's. `origin`: how the run dir was
    chosen, for the start-up line that says whether it resumed. `tasks`: what `train.eval_tasks` needs,
    `jaxdist.evaluation.in_training.task_evaluator` (`(setup, run_dir) -> (params -> eval/TASK/METRIC
    numbers)`, built before anything is written; passed in because the harness sits above training).
    """
    own = stopper is None
    stopper = stopper or checkpoint.StopSignal()
    lock = rundir.RunLock(run_dir)
    # `closers`: the progress bar and metric writers, closed however the run ends (a failed save must
    # leave its one error line on a line of its own, and no flush traceback at exit).
    with stopper if own else contextlib.nullcontext(), contextlib.ExitStack() as closers:
        try:
            return _run(cfg, Path(run_dir), log, restore, stopper, allowed, lock, closers, origin, tasks)
        except OSError as e:
            if e.errno not in rundir.WRITE_ERRORS:
                raise
            raise JaxdistError(
                f"cannot write {e.filename or run_dir} ({(e.strerror or str(e)).lower()}); stopping: "
                "free space or fix the folder, then run the same command to resume"
            ) from None
        finally:
            with contextlib.suppress(OSError):  # a full disk cannot hide the run's own error
                lock.release()


def _run(cfg, run_dir: Path, log, restore, stopper, allowed, lock, closers, origin, tasks) -> RunResult:
    """Set up, restore, (start writing), compile, run, finish: what the trainer does, in that order."""
    s = startup.set_up(cfg, run_dir, log, lock)
    task_eval = None
    if s.cfg.train.eval_tasks and s.cfg.train.eval_every:  # checked (tasks known, mesh usable) before writing
        if tasks is None:
            raise JaxdistError(
                "train.eval_tasks needs the evaluation harness: python -m jaxdist.train passes it; from Python, "
                "pass tasks=jaxdist.evaluation.in_training.task_evaluator to jaxdist.run"
            )
        task_eval = tasks(s, Path(run_dir))
    resuming, from_hf, restored = resume.start_from(
        s.cfg, run_dir, s.prog, s.loader, restore, allowed, s.is_main, s.log
    )
    start = restored.step if restored else 0
    if (early := before_writing(s, run_dir, stopper, restored, start)) is not None:
        return early
    # Input is valid: from here on we write.
    writer = opening.start_writing(s, run_dir, lock, closers, restored, resuming, restore, origin, start)
    if restored is not None:
        resume.after_restore(s, run_dir, restored, resuming, from_hf, start)
    saver = opening.saver(s, run_dir)
    state, first, compiled, compile_s, predicted = stepping.compile_step(s, restored)
    eval_arrays = s.loader.eval_arrays()
    progress = opening.progress(s, writer, closers, saver, state, restored if resuming else None, start)
    if (stopped := stopped_before_training(stopper, run_dir, s.log)) is not None:
        saver.close()
        return stopped
    steps_done, plotted = stepping.train(
        s, run_dir, stopper, saver, progress, compiled, state, first, eval_arrays, start, task_eval
    )
    return finish(s, run_dir, stopper, saver, progress, writer, compiled, compile_s, predicted, steps_done, plotted)
