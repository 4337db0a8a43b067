"""A training run's state: `RunState`, the fields `Run` (jaxdist/training/run.py) owns and its phases read
and set — config, mesh, program, data, saver, writers, progress, stopper. A new piece of run state is one
field here. The phase modules (startup, resume, opening, stepping, finish) take it as their one argument.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from jaxdist.config import Config

if TYPE_CHECKING:  # the types of what the phases build (each phase imports its own modules)
    from jax.sharding import Mesh

    from jaxdist.checkpoint.restoring import Restored
    from jaxdist.checkpoint.saving import Saver
    from jaxdist.data.run_tokenizer import RunTokenizer
    from jaxdist.observe.metrics import MetricWriter
    from jaxdist.observe.progress import Progress
    from jaxdist.training import rundir
    from jaxdist.training.signals import StopSignal
    from jaxdist.training.step import Program, TrainState


@dataclasses.dataclass
class RunResult:
    """What `jaxdist.run` returns: the run dir, the last and held-out losses, tokens/s, steps trained."""

    run_dir: Path
    final_loss: float
    eval_loss: float | None
    tokens_per_sec: float
    steps: int


class BatchStream(Protocol):
    """What a run draws its batches from: the data loader (data/loader.py's `Loader`) or, for
    objective.method=grpo, the prompt stream (data/prompt_stream.py's `PromptStream`); a checkpoint keeps
    its state."""

    def __next__(self) -> Any: ...

    def has_eval(self) -> bool: ...

    def eval_arrays(self) -> list[Any]: ...

    def get_state(self) -> dict: ...

    def set_state(self, state: dict) -> None: ...


# `tasks` of jaxdist.run: (run, run_dir) -> evaluate(params) -> {"eval/TASK/METRIC": value}
TaskEvaluator = Callable[["RunState", Path], Callable[[Any], dict[str, float]]]


@dataclasses.dataclass(eq=False)
class RunState:
    """A training run's state. The first fields are what `jaxdist.run` is given; the others are set by
    the phase named beside them and read by the later ones."""

    cfg: Config  # set_up replaces it with the config resolved on the mesh (what config.yaml records)
    run_dir: Path
    log: Callable[..., None]  # set_up silences it on processes other than 0
    stopper: StopSignal
    lock: rundir.RunLock
    closers: contextlib.ExitStack  # the progress bar and metric writers, closed however the run ends
    restore: str | None = None  # another run's checkpoint, or hf:DIR, to start from
    allowed: frozenset[str] = frozenset()  # config keys that may differ from the resumed checkpoint's
    origin: str = ""  # how the run dir was chosen (for the start-up line)
    tasks: TaskEvaluator | None = None  # train.eval_tasks' evaluator factory (the harness sits above training)
    rollouts: Callable[[RunState], Any] | None = (
        None  # objective.method=grpo: its driver's factory (inference sits above training)
    )

    # set_up: before anything is written
    mesh: Mesh = dataclasses.field(init=False)
    prog: Program = dataclasses.field(init=False)
    loader: BatchStream = dataclasses.field(init=False)  # a Loader, or GRPO's PromptStream
    run_tok: RunTokenizer = dataclasses.field(init=False)  # what the token ids mean (recorded by open)
    is_main: bool = dataclasses.field(init=False)
    no_eval: str | None = dataclasses.field(init=False)  # why evaluation is off, decided now
    flops_tok: float = dataclasses.field(init=False)
    peak: float | None = dataclasses.field(init=False)
    peak_source: str = dataclasses.field(init=False)
    task_eval: Callable[[Any], dict[str, float]] | None = dataclasses.field(init=False)
    driver: Any = dataclasses.field(init=False)  # GRPO: samples, scores and trains each step (None otherwise)
    # restore
    resuming: bool = dataclasses.field(init=False)  # from this run dir's own latest checkpoint
    from_hf: bool = dataclasses.field(init=False)  # from a Hugging Face model's weights (restore=hf:DIR)
    restored: Restored | None = dataclasses.field(init=False)
    start: int = dataclasses.field(init=False)  # the first step this process trains
    # open
    writer: MetricWriter = dataclasses.field(init=False)
    saver: Saver = dataclasses.field(init=False)
    # compile
    state: TrainState = dataclasses.field(init=False)
    first: Any = dataclasses.field(init=False)  # the first batch (the compile's example input)
    compiled: Any = dataclasses.field(init=False)  # the compiled train step (jax.stages.Compiled)
    compile_s: float = dataclasses.field(init=False)
    predicted: float | None = dataclasses.field(init=False)  # the planner's bytes per device
    eval_arrays: list = dataclasses.field(init=False)  # the held-out batches
    progress: Progress = dataclasses.field(init=False)
    # loop
    steps_done: int = dataclasses.field(init=False)
    plotted: Path | str | None = dataclasses.field(init=False)  # loss.png, or why there is none
