"""Saving: asynchronous orbax saves, reported only once orbax has published the step with its checksums.

A save that fails (full disk, lost mount, ...) stops the run with one line; the steps already
published stay, because orbax deletes old steps only after a new one is complete.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp

from jaxdist.checkpoint import integrity
from jaxdist.checkpoint.storage import SUBDIR, TMP_SUFFIX, open_manager
from jaxdist.config import Config
from jaxdist.data import corpus
from jaxdist.errors import JaxdistError

TrainState = Any  # jaxdist.training.step.TrainState (checkpoint/ sits below training/: taken as given)


def train_part(state: TrainState) -> dict:
    return {
        "step": state.step,
        "opt_state": state.opt_state,
        "reducer_state": state.reducer_state,
        "skipped": state.skipped,
    }


def _reason(e: BaseException) -> str:
    """One line for what went wrong, looking through chained exceptions for the OS error."""
    seen = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.strerror:
            return seen.strerror.lower()
        if "No space left on device" in str(seen):
            return "no space left on device"
        seen = seen.__cause__ or seen.__context__
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


class Saver:
    """Writes the run's checkpoints: asynchronous (training continues while bytes are written)."""

    def __init__(self, run_dir: Path, cfg: Config, log: Callable = print):
        self.cfg, self.log = cfg, log
        self.directory = Path(run_dir) / SUBDIR
        self.manager = open_manager(self.directory, cfg.checkpoint.keep, before_commit=self._before_commit)
        self.pending: tuple[int, float, float] | None = None  # (step, start time, blocking seconds)
        self.timings: list[dict] = []  # per completed save: step, blocking_s, total_s, checksum_s, bytes
        self.last_saved: int | None = None  # the newest step published by this saver
        self._checksum: tuple[float, int] = (0.0, 0)
        self._corpus: dict | None = None
        self.carry: Callable[[], dict] | None = None  # host-side state saved in meta (the smoothed loss)

    @property
    def corpus(self) -> dict | None:
        """The corpus fingerprint the checkpoints record (computed once: a stat per file)."""
        if self._corpus is None:
            try:
                self._corpus = corpus.fingerprint(self.cfg)
            except (OSError, JaxdistError):
                self._corpus = {}
        return self._corpus or None

    def due(self, step: int, final: bool = False) -> bool:
        """Every `checkpoint.every` steps and at the end of the run (0 disables both)."""
        return self.cfg.checkpoint.every > 0 and (final or step % self.cfg.checkpoint.every == 0)

    def _before_commit(self) -> None:
        """Process 0, orbax's background thread: every process has written; checksum the tmp folder
        before orbax renames it to <step>."""
        if self.pending is None:
            raise RuntimeError("orbax committed a checkpoint that jaxdist did not start")
        step = self.pending[0]
        folder = self.directory.resolve() / f"{step}{TMP_SUFFIX}"
        if not folder.is_dir():
            raise RuntimeError(f"orbax's temporary folder {folder} is not where jaxdist expects it")
        start = time.perf_counter()
        nbytes = integrity.write(folder)
        self._checksum = (time.perf_counter() - start, nbytes)

    def _intact(self, step: int) -> list[int]:
        """The other steps on disk with their checksum file: what the disk holds, not orbax's list (with
        checkpoint.keep=1 a failed save had already dropped the intact older step from it)."""
        on_disk = set()
        with contextlib.suppress(OSError):
            on_disk = {int(p.name) for p in self.directory.iterdir() if p.name.isdigit() and integrity.has_checksums(p)}
        with contextlib.suppress(Exception):
            on_disk |= {s for s in self.manager.all_steps() if integrity.has_checksums(self.directory / str(s))}
        return sorted(on_disk - {step})

    def _fail(self, step: int, e: BaseException) -> JaxdistError:
        kept = self._intact(step)
        older = f"checkpoints {', '.join(map(str, sorted(kept)))} are intact" if kept else "no older checkpoint exists"
        return JaxdistError(
            f"checkpoint step {step} could not be written to {self.directory} ({_reason(e)}); "
            f"stopping: {older}; free space or fix the folder, then run the same command to resume"
        )

    def _unpublished_reason(self) -> str:
        """Why orbax finished without publishing a step when it reported no error (its background
        thread can lose an ENOSPC): a disk with less room than the last checkpoint took is named."""
        free = shutil.disk_usage(self.directory).free
        need = self.timings[-1]["bytes"] if self.timings else 0
        if free < need:
            return f"no space left on device: {free:,} bytes free, the last checkpoint took {need:,}"
        return "orbax did not publish it"

    def _guard(self, step: int, fn: Callable) -> None:
        try:
            fn()
        except JaxdistError:
            raise
        except Exception as e:  # any failure to write is reported as one line
            self.pending = None
            raise self._fail(step, e) from None

    def save(self, state: TrainState, step: int, loader) -> bool:
        """Save `state` (after `step` optimizer steps) with the data iterator positioned at `step`.
        A state whose last step was skipped as non-finite is not saved: the last good one stays."""
        if int(jax.device_get(state.skipped)):
            self.log(f"checkpoint step {step}: not saved (the step was non-finite); keeping the last good one")
            return False
        if step in self.manager.all_steps():  # e.g. the final save right after resuming from that step
            return False
        if self.pending is not None:  # one save in flight at a time (orbax would wait inside save)
            self._guard(self.pending[0], self.manager.wait_until_finished)
        self.poll()
        start = time.perf_counter()
        meta = {
            "step": step,
            "seed": self.cfg.train.seed,
            "data_state": loader.get_state(),
            "config": self.cfg.to_dict(),
            integrity.META_FLAG: True,
            "corpus": self.corpus,
            **({"progress": self.carry()} if self.carry else {}),
        }
        self.pending = (step, start, 0.0)
        self._guard(
            step,
            lambda: self.manager.save(
                step,
                args=ocp.args.Composite(
                    params=ocp.args.StandardSave(state.params),
                    train=ocp.args.StandardSave(train_part(state)),
                    data=grain.checkpoint.CheckpointSave(loader.iterator),
                    meta=ocp.args.JsonSave(meta),
                ),
            ),
        )
        blocking = time.perf_counter() - start
        self.pending = (step, start, blocking)
        if self.cfg.checkpoint.async_save:
            self.log(f"checkpoint step {step}: writing in background ({blocking:.2f}s blocking)")
        else:
            self._guard(step, self.manager.wait_until_finished)
            self.poll()
        return True

    def poll(self) -> None:
        """Report a background save that has completed (cheap: reads a flag); raise if it failed."""
        if self.pending is None or self.manager.is_saving_in_progress():
            return
        step, start, blocking = self.pending
        self._guard(step, self.manager.check_for_errors)
        final = self.directory / str(step)
        if jax.process_index() == 0 and not integrity.has_checksums(final):
            self.pending = None
            raise self._fail(step, RuntimeError(self._unpublished_reason()))
        total = time.perf_counter() - start
        checksum_s, nbytes = self._checksum
        self.timings.append(
            {"step": step, "blocking_s": blocking, "total_s": total, "checksum_s": checksum_s, "bytes": nbytes}
        )
        self.log(f"checkpoint step {step} saved to {final} ({blocking:.2f}s blocking, {total:.2f}s total)")
        self.pending, self.last_saved = None, step

    def wait(self) -> None:
        """Wait for the save in flight and report it (raising if it failed)."""
        if self.pending is not None:
            self._guard(self.pending[0], self.manager.wait_until_finished)
        self.poll()

    def close(self) -> None:
        """Wait for the save in flight (raising if it failed), then release orbax's threads."""
        try:
            self.wait()
        finally:
            with contextlib.suppress(Exception):  # the save's own failure, if any, is already being raised
                self.manager.close()
