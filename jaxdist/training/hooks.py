"""The training loop as a list of things done each step.

    for each step: every hook's before_step; dispatch the step (asynchronous); every hook's after_step,
    in list order; stop if a stop was requested.

The default list (jaxdist.training.stepping): profile window, checkpoint (before the next batch is drawn, so the
saved data iterator is at this step; it first has the metrics hook read this step, so a step's log line
comes before its checkpoint message and the checkpoint holds the smoothed loss up to its step), next
batch (drawn while the device works), metrics (the previous step's, read one step late; the last step's
and an eval step's at once). One more per-step concern is one more hook in that list.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxdist.errors import JaxdistError


@dataclasses.dataclass(frozen=True)
class StepEnd:
    """What the hooks know after optimizer step `index` (0-based) was dispatched."""

    index: int
    state: Any  # the state this step produced (device arrays, maybe not computed yet)
    metrics: dict
    total: int  # train.steps
    stop: bool  # a stop (SIGTERM / Ctrl-C) was requested: this is the last step of this process

    @property
    def done(self) -> int:
        return self.index + 1

    @property
    def last(self) -> bool:
        return self.stop or self.done == self.total


class Hook:
    def before_step(self, index: int, state) -> None:
        pass

    def after_step(self, end: StepEnd) -> None:
        pass

    def close(self, state) -> None:
        pass


class Profile(Hook):
    """train.profile_steps: start and stop the profiler between steps."""

    def __init__(self, trace):
        self.trace = trace

    def before_step(self, index, state):
        self.trace.at_step(index, state)

    def close(self, state):
        self.trace.close(state)


class Checkpoint(Hook):
    """Save when due (and on the last step), then report background saves that have finished."""

    def __init__(self, saver, loader, before_save=lambda end: None):
        self.saver, self.loader, self.before_save = saver, loader, before_save
        self.latest = None  # (state, steps done): what a save after a failure elsewhere would write

    def after_step(self, end):
        self.latest = (end.state, end.done)
        if end.stop or self.saver.due(end.done, end.last):
            self.before_save(end)  # Metrics.flush: this step's log line (and smoothed loss) first
            self.saver.save(end.state, end.done, self.loader)
        self.saver.poll()


class DataFailed(JaxdistError):
    """The next batch could not be read (a streamed file became unreadable or malformed) after step
    `end.index` was dispatched: the steps before are done and can still be saved."""

    def __init__(self, message: str, end: StepEnd):
        super().__init__(message)
        self.end = end


class Batches(Hook):
    """Holds the batch of the next step; draws it once this step is dispatched (and saved)."""

    def __init__(self, loader, first):
        self.loader, self.current = loader, first
        self.before = None  # (steps done, the loader's state before the batch drawn after them)

    def after_step(self, end):
        self.before = (end.done, self.loader.get_state())
        try:
            self.current = None if end.last else next(self.loader)
        except JaxdistError as e:
            raise DataFailed(str(e), end) from None


class Metrics(Hook):
    """Read step s's metrics after step s+1 was dispatched; the last step's, an eval step's (the
    evaluation needs this step's state) and a checkpoint step's (`flush`, called by the Checkpoint hook:
    the save waits for this step anyway), at once."""

    def __init__(self, progress, evaluate, eval_every: int):
        self.progress, self.evaluate, self.eval_every = progress, evaluate, eval_every
        self.pending = None
        self.flushed = -1  # the step index already read by flush

    def eval_due(self, end: StepEnd) -> bool:
        return bool(self.eval_every) and (end.done % self.eval_every == 0 or end.done == end.total)

    def flush(self, end: StepEnd) -> None:
        """Read the pending step's metrics and this one's now (evaluating if due)."""
        if end.index == self.flushed:
            return
        if self.pending is not None:
            self.progress.record(*self.pending)
            self.pending = None
        due, state = self.eval_due(end), end.state
        self.progress.record(
            end.index, end.metrics, final=end.last, evaluate=(lambda: self.evaluate(state)) if due else None
        )
        self.flushed = end.index

    def after_step(self, end):
        if end.last or self.eval_due(end) or end.index == self.flushed:
            self.flush(end)
            return
        if self.pending is not None:
            self.progress.record(*self.pending)
        self.pending = (end.index, end.metrics)


def run_steps(step_fn, state, start: int, total: int, stop_requested, hooks: list[Hook]) -> tuple[Any, int]:
    """Steps start..total-1 (or until a stop): `step_fn(state) -> (state, metrics)`. Returns
    (final state, optimizer steps done)."""
    done = start
    for index in range(start, total):
        for h in hooks:
            h.before_step(index, state)
        state, metrics = step_fn(state)
        end = StepEnd(index, state, metrics, total, stop_requested())
        for h in hooks:
            h.after_step(end)
        done = end.done
        if end.stop:
            break
    return state, done
