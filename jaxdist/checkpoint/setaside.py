"""Setting aside unreadable checkpoints: renamed (never deleted), so the resumed run can reuse their steps."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import jax

from jaxdist.checkpoint.agree import barrier
from jaxdist.checkpoint.storage import SUBDIR, open_manager


def set_aside_newer(run_dir: Path, step: int, log: Callable = print) -> list[Path]:
    """Steps newer than the one resumed from were unreadable (or failed their checksums): move each to
    `unreadable-<step>-<time>` beside them. Returns the new paths (process 0; empty elsewhere)."""
    directory = Path(run_dir) / SUBDIR
    moved = []
    if jax.process_index() == 0:
        manager = open_manager(directory, read_only=True)
        newer = [s for s in manager.all_steps() if s > step]
        manager.close()
        for s in newer:
            target = directory / f"unreadable-{s}-{time.strftime('%Y%m%d-%H%M%S')}"
            (directory / str(s)).rename(target)
            moved.append(target)
            log(f"moved unreadable checkpoint {directory / str(s)} to {target}")
    barrier("jaxdist:set_aside_newer")
    return moved
