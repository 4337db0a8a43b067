"""Multi-host agreement: decisions that change what every process does next are taken together."""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils


def all_agree(ok: bool) -> bool:
    """True when `ok` holds on every process (one tiny all-gather; free for a single process)."""
    if jax.process_count() == 1:
        return ok
    return bool(multihost_utils.process_allgather(np.int32(ok)).min())


def barrier(name: str) -> None:
    """Every process reaches this point before any goes on (no-op for one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)
