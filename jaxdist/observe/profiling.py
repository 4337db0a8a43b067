"""`train.profile_steps=START:STOP`: a JAX profiler trace of steps START..STOP-1 (0-based) under the run dir.

    python -m jaxdist.train train.profile_steps=10:15 --run-dir runs/prof
    tensorboard --logdir runs/prof/profile        # Profile tab (pip install tensorboard-plugin-profile)
    # or open runs/prof/profile/plugins/profile/*/*.trace.json.gz in https://ui.perfetto.dev

Each traced step carries a step marker (TensorBoard's step-time overview uses them). The trace starts
and stops between steps, after the device has finished the previous one, so it holds whole steps.
"""

from __future__ import annotations

from pathlib import Path

import jax

from jaxdist.config import parse_step_range


class StepTrace:
    """Call `at_step(s)` before dispatching step s, and `close()` after the loop."""

    def __init__(self, steps: str, directory: Path, log=print):
        self.range = parse_step_range(steps) if steps else None
        self.directory, self.log = Path(directory), log
        self.active, self.marker = False, None

    def at_step(self, s: int, state=None) -> None:
        if self.range is None:
            return
        self._end_marker()
        start, stop = self.range
        if s == start and not self.active:
            jax.block_until_ready(state)  # keep the previous steps out of the trace
            self.directory.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.directory), create_perfetto_trace=True)
            self.active = True
        elif s == stop:
            self._stop(state)
        if self.active:
            self.marker = jax.profiler.StepTraceAnnotation("train", step_num=s)
            self.marker.__enter__()

    def close(self, state=None) -> None:
        self._end_marker()
        self._stop(state)

    def _end_marker(self) -> None:
        if self.marker is not None:
            self.marker.__exit__(None, None, None)
            self.marker = None

    def _stop(self, state) -> None:
        if self.active and self.range is not None:  # active: a range was given
            jax.block_until_ready(state)  # the traced steps' device work belongs in the trace
            jax.profiler.stop_trace()
            self.active = False
            self.log(f"profiler trace of steps {self.range[0]}..{self.range[1] - 1} written under {self.directory}")
