"""Preemption signals: SIGTERM / SIGINT stop the run cleanly after the current step, with a checkpoint."""

from __future__ import annotations

import signal
import sys
import threading


class StopSignal:
    """SIGTERM / SIGINT: finish the current step, save, exit 0. A second SIGINT aborts at once.

    Installed when the command starts, so a signal during start-up or compilation (`training` False)
    stops the run before its first step, with exit 0 and nothing to save.

    `requested()` is what the loop checks after each step; with several processes it is agreed on
    (one tiny all-gather), so every process saves at the same step.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: str | None = None
        self.training = False  # set by the loop: from then on a stop saves the current step
        self._previous: dict = {}

    def __enter__(self):
        self.install()
        return self

    def install(self) -> None:
        """Take SIGTERM / SIGINT; called again after `jax.distributed.initialize`, which installs XLA's
        preemption notifier, a C++ SIGTERM handler that only logs 'SIGTERM caught': under SLURM a
        requeued 2-process job trained on until the scheduler's SIGKILL and lost those steps."""
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous.setdefault(s, signal.signal(s, self._handle))

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _handle(self, signum, frame) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # second Ctrl-C: abort without saving
        if self.received == signal.Signals(signum).name:
            return  # the same SIGTERM twice (a scheduler signals every process, the supervisor passes it on)
        self.received = signal.Signals(signum).name
        doing = (
            "finishing the current step and saving a checkpoint" if self.training else "stopping before the first step"
        )
        print(f"{self.received} received: {doing} (Ctrl-C again aborts)", file=sys.stderr, flush=True)

    def requested(self) -> bool:
        # deferred: JAX must not load before the platform set-up (XLA flags, CPU device count) has run
        import jax  # late: the handlers are installed before JAX loads

        from jaxdist.checkpoint.agree import all_agree

        flag = self.received is not None
        if jax.process_count() > 1:
            flag = not all_agree(not flag)
        return flag
