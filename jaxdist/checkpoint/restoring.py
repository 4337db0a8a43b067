"""Restoring: the newest checkpoint that reads and passes its checksums, onto the current mesh.

Arrays come back on the *current* mesh: orbax is given abstract arrays carrying the target shardings,
so a run saved on fsdp=8 resumes on dp=2,fsdp=4 or on 4 devices. A checkpoint that fails to read or
to verify is reported and the previous one tried; a different model or config is an error.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp

from jaxdist.checkpoint import compat, integrity, restage
from jaxdist.checkpoint.agree import all_agree
from jaxdist.checkpoint.saving import train_part
from jaxdist.checkpoint.storage import checkpoint_dir, open_manager
from jaxdist.config import Config
from jaxdist.data import corpus
from jaxdist.errors import JaxdistError
from jaxdist.reduce import explicit

# The train state and program are jaxdist.training.step's TrainState and Program, taken as given (checkpoint/
# sits below training/ in the layering, docs/architecture.md): a restored state is the program's own
# abstract state with its values replaced.
TrainState = Any
Program = Any


@dataclasses.dataclass
class Restored:
    state: TrainState
    step: int  # optimizer steps already taken (0 for params_only)
    path: Path  # the step folder it came from
    seconds: float
    changes: dict = dataclasses.field(default_factory=dict)  # config key -> (checkpoint's, now)
    verify_s: float = 0.0  # of `seconds`, checking the files against their checksums
    progress: dict | None = None  # the smoothed loss's state at this step (None: an older checkpoint)


class Corrupted(Exception):
    """A checkpoint whose files do not match their checksums: treated like an unreadable one."""


def _abstract(tree, shardings):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


def _restore_step(
    manager,
    directory: Path,
    step: int,
    prog: Program,
    loader,
    cfg: Config,
    params_only: bool,
    allowed: frozenset,
    drift: bool,
) -> tuple[TrainState, dict, dict | None]:
    where = directory / str(step)
    metadata = manager.item_metadata(step)
    meta = _meta(manager, step)
    compat.check_model(metadata["params"], prog.abstract_state.params, where, meta.get("config", {}), cfg)
    if not params_only and metadata.get("train") is None:
        raise JaxdistError(
            f"checkpoint {where} holds parameters only (e.g. imported from Hugging Face); start "
            f"from it with --restore {where} checkpoint.params_only=true and a new --run-dir"
        )
    changes = {}
    if not params_only:
        compat.check_resume(meta, cfg, where)
        if drift:
            corpus.check_unchanged(meta, cfg, where, allowed)
        explicit.check_replica_count(metadata, prog.abstract_state.reducer_state, cfg, where)
        changes = (
            compat.check_config_drift(meta, cfg, where, allowed)
            if drift
            else compat.changed_keys(meta.get("config", {}), cfg)
        )
        compat.check_train_state(metadata["train"], train_part(prog.abstract_state), meta.get("config", {}), cfg, where)
    abstract = _abstract(prog.abstract_state, prog.state_shardings)
    items = {"params": ocp.args.StandardRestore(abstract.params)}
    if not params_only:
        items["train"] = ocp.args.StandardRestore(train_part(abstract))
    restored = manager.restore(step, args=ocp.args.Composite(**items))
    if prog.pipeline is not None and meta.get("config"):  # saved under another chunk placement: move the rows
        plans = restage.saved_plan(meta["config"], prog.pipeline), prog.pipeline
        restored = restage.restage({k: restored[k] for k in items}, *plans, where)  # (orbax's result: not a pytree)
    if params_only:
        fresh = prog.init_state(cfg.train.seed)  # new optimizer, step 0: fine-tuning starts here
        return dataclasses.replace(fresh, params=restored["params"]), changes, None
    if getattr(loader, "mixture", None) is not None:  # data.sources: each source from its saved position
        loader.set_state(meta["data_state"])
    else:
        try:  # this process's iterator file; absent when the process count changed
            manager.restore(step, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(loader.iterator)))
        except ValueError:
            loader.set_state(meta["data_state"])  # batches are step-indexed: the same for every process
    return dataclasses.replace(abstract, params=restored["params"], **restored["train"]), changes, meta.get("progress")


def _meta(manager, step: int) -> dict:
    return manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]


def _verify(manager, where: Path, log: Callable) -> float:
    """Check this process's share of the files; raise Corrupted on a mismatch. Returns seconds taken.
    A checkpoint without a checksum file is accepted only if its meta does not say one was written."""
    start = time.perf_counter()
    if not integrity.has_checksums(where):
        if _meta(manager, int(where.name)).get(integrity.META_FLAG):
            raise Corrupted(f"its checksum file {integrity.CHECKSUMS} is missing although it was written with one")
        log(f"warning: checkpoint {where} has no checksums (written by an older jaxdist); not verified")
        return 0.0
    problem = integrity.verify(where, (jax.process_index(), jax.process_count()))
    if problem:
        raise Corrupted(problem)
    return time.perf_counter() - start


@dataclasses.dataclass
class Read:
    value: Any  # what `read` returned
    step: int
    path: Path  # the step folder it came from
    seconds: float
    verify_s: float


def read_checkpoint(path: Path, read: Callable[[Any, Path, int], Any], log: Callable = print) -> Read:
    """The one way every command reads a checkpoint (train --restore and resume, convert to-hf,
    generate --run-dir): the newest step under `path` that passes its checksums and `read(manager,
    checkpoints dir, step)`, older ones tried after a warning; a JaxdistError from `read` (a different
    model, config drift) stops at once. All processes agree on the step taken."""
    directory, only_step = checkpoint_dir(path)
    if not directory.is_dir():
        raise JaxdistError(f"checkpoint path {path} does not exist; pass a run dir or its checkpoints/<step>")
    manager = open_manager(directory, read_only=True)
    try:
        steps = [only_step] if only_step is not None else sorted(manager.all_steps(), reverse=True)
        if not steps:
            raise JaxdistError(
                f"{path} holds no checkpoint; pass a run dir (or checkpoints/<step>) written by jaxdist.train"
            )
        failures = []
        for step in steps:
            start = time.perf_counter()
            value, verify_s = None, 0.0
            try:
                verify_s = _verify(manager, directory / str(step), log)
                value, error = read(manager, directory, step), None
            except JaxdistError:
                raise
            except Exception as e:  # any read failure means "try the previous checkpoint"
                error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
                if isinstance(e, Corrupted):
                    error = f"{e}"
            if all_agree(error is None):
                return Read(value, step, directory / str(step), time.perf_counter() - start, verify_s)
            error = error or "failed on another process"
            failures.append(f"step {step}: {error}")
            if step != steps[-1]:
                log(
                    f"warning: checkpoint {directory / str(step)} could not be restored ({error}); "
                    "trying the previous one"
                )
        raise JaxdistError(
            f"no checkpoint under {directory} could be restored ({failures[0]}); "
            "pass a checkpoint written by jaxdist.train, or move the unreadable ones away"
        )
    finally:
        manager.close()


def restore(
    path: Path,
    prog: Program,
    loader,
    cfg: Config,
    params_only: bool = False,
    log: Callable = print,
    allowed: frozenset = frozenset(),
    drift: bool = True,
) -> Restored:
    """Restore the newest readable, intact checkpoint under `path` onto `prog`'s mesh (and `loader`'s position).

    `drift`: refuse config changes outside `compat.FREE_KEYS` and `allowed` (a run resuming itself);
    without it the changes are only returned (a checkpoint of another run, taken on purpose).
    """

    def read(manager, directory, step):
        return _restore_step(manager, directory, step, prog, loader, cfg, params_only, allowed, drift)

    got = read_checkpoint(path, read, log)
    state, changes, carried = got.value
    return Restored(state, 0 if params_only else got.step, got.path, got.seconds, changes, got.verify_s, carried)
