"""`jaxdist.run`: one training run — the stop signal, the run dir's lock and what must be closed however it
ends, around `Run(...).train()` (jaxdist/training/run.py: the run's state, its phases as methods).

`run` is what `python -m jaxdist.train` calls after parsing the command line; tests and notebooks call
it directly. Everything that can fail on input fails before the run folder is written; a write that
fails on a full or read-only disk is one line saying so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

from jaxdist.config import Config
from jaxdist.errors import JaxdistError
from jaxdist.training import rundir
from jaxdist.training.run import Run
from jaxdist.training.signals import StopSignal
from jaxdist.training.state import RunResult, TaskEvaluator


def run(
    cfg: Config,
    run_dir: Path | str,
    log: Callable[..., None] = print,
    restore: str | None = None,
    stopper: StopSignal | None = None,
    allowed: frozenset[str] = frozenset(),
    origin: str = "",
    tasks: TaskEvaluator | None = None,
    rollouts: Callable | None = None,
) -> RunResult:
    """Train `cfg` and write the run folder. Everything that can fail on input fails before writing.

    Starts from this run dir's latest checkpoint if it has one, else from `restore` (another run's
    checkpoint), else from scratch. SIGTERM / SIGINT stop after the current step with a checkpoint
    (before the first step, if they come during start-up: `stopper` is installed by `main`).
    `allowed`: config keys that may differ from the resumed checkpoint's. `origin`: how the run dir was
    chosen, for the start-up line that says whether it resumed. `tasks`: what `train.eval_tasks` needs,
    `jaxdist.evaluation.in_training.task_evaluator` (`(run, run_dir) -> (params -> eval/TASK/METRIC
    numbers)`, built before anything is written; passed in because the harness sits above training).
    `rollouts`: objective.method=grpo's driver, `jaxdist.inference.rollout.for_run` (`run -> driver`;
    `jaxdist.run` passes it for GRPO configs; passed in because the decoder sits above training).
    """
    own = stopper is None
    stopper = stopper or StopSignal()
    lock = rundir.RunLock(run_dir)
    # `closers`: the progress bar and metric writers, closed however the run ends (a failed save must
    # leave its one error line on a line of its own, and no flush traceback at exit).
    with stopper if own else contextlib.nullcontext(), contextlib.ExitStack() as closers:
        try:
            return Run(
                cfg, Path(run_dir), log, stopper, lock, closers, restore, allowed, origin, tasks, rollouts
            ).train()
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
