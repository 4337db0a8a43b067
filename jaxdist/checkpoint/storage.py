"""Orbax storage: the manager, its four items, and where checkpoints live (`<run_dir>/checkpoints/<step>`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint._src.metadata import array_metadata_store

SUBDIR = "checkpoints"
TMP_SUFFIX = ".orbax-checkpoint-tmp"  # orbax writes <step><suffix> and renames it to <step> when complete
READ_ONLY_NOTICE = "Given directory is read only"
OVERRIDE_NOTICE = "overriding jax.Array"  # orbax's warning when whole_shards replaces its jax.Array handler


class _DropOwnNotices(logging.Filter):
    """orbax logs a warning for every read-only manager, and every reader (convert, generate, plot,
    restore) opens one; and another each time `whole_shards` registers its handler. Each notice is
    jaxdist's own intent echoed back, so it is dropped here, where it is produced, whatever the
    command's logging set-up."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return READ_ONLY_NOTICE not in message and OVERRIDE_NOTICE not in message


logging.getLogger("absl").addFilter(_DropOwnNotices())


def _handlers() -> dict:
    return {
        "params": ocp.StandardCheckpointHandler(),
        "train": ocp.StandardCheckpointHandler(),
        "data": grain.checkpoint.CheckpointHandler(),
        "meta": ocp.JsonCheckpointHandler(),
    }


def whole_shards() -> None:
    """One process saves each array's shards whole, one replica's each, as orbax already does on GPU.
    Orbax's default elsewhere (replica-parallel) splits every replicated shard across its replicas so that
    several hosts share the writing; with one process it only adds a sliced copy per replica and shard
    (XLA:CPU, conftest's SMALL model: 72 per fsdp=8 save, 288 per dp=2,fsdp=4; about half of what saving
    cost test_faults, test_verify and test_checkpoint). orbax reads either layout."""
    handler = ocp.type_handlers.ArrayHandler(
        use_replica_parallel=False, array_metadata_store=array_metadata_store.Store()
    )
    ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)


def open_manager(
    directory: Path, keep: int = 1, read_only: bool = False, before_commit: Callable[[], None] | None = None
) -> ocp.CheckpointManager:
    """A manager for `directory`. Writing managers are always asynchronous (a synchronous save waits
    for it): orbax runs `before_commit` on process 0 after every process has written and before the
    rename that makes the step visible, which is where the checksums are written."""
    if read_only:  # only reads: no deletion, no tmp cleanup, nothing created
        # save_root_metadata=False: even read-only, orbax would enter a cross-process barrier, and the
        # processes that open a manager here need not be all of them (a folder another process just made).
        options = ocp.CheckpointManagerOptions(
            read_only=True, create=False, save_interval_steps=0, save_root_metadata=False
        )
    else:
        if jax.process_count() == 1:
            whole_shards()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            enable_async_checkpointing=True,
            cleanup_tmp_directories=True,
            async_options=ocp.AsyncOptions(post_finalization_callback=before_commit),
        )
    return ocp.CheckpointManager(Path(directory).resolve(), item_handlers=_handlers(), options=options)


def checkpoint_dir(path: Path) -> tuple[Path, int | None]:
    """A run dir, its `checkpoints/` folder, or one step folder -> (checkpoints folder, step or None)."""
    path = Path(path)
    if (path / SUBDIR).is_dir():
        return path / SUBDIR, None
    if path.name.isdigit() and (path / "_CHECKPOINT_METADATA").exists():
        return path.parent, int(path.name)
    return path, None


def has_checkpoints(path: Path) -> bool:
    directory, step = checkpoint_dir(path)
    if step is not None:
        return True
    if not directory.is_dir():
        return False
    manager = open_manager(directory, read_only=True)
    try:
        return bool(manager.all_steps())
    finally:
        manager.close()  # an unclosed manager's event loop is what printed "Event loop is closed" at exit


def load_params(step_dir: Path) -> dict:
    """The parameters of one checkpoint (`<run>/checkpoints/<step>`) as host numpy arrays, any device count."""
    step_dir = Path(step_dir)
    manager = open_manager(step_dir.parent, read_only=True)
    step = int(step_dir.name)
    try:
        target = jax.tree.map(lambda m: np.zeros(m.shape, m.dtype), manager.item_metadata(step)["params"])
        return manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(target)))["params"]
    finally:
        manager.close()
