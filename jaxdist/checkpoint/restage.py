"""Moving a checkpoint's staged layer stack to another pipeline placement at the same pp.

With pp > 1 the layer stack is stored by stage, (P, V G, ...) (`parallel/pipeline.to_stages`). Schedules
with other chunk placements (gpipe and 1f1b: one chunk per stage; circular and interleaved_1f1b: V chunks
round the ring; zb_v: chunks s and 2P-1-s) store the same shapes with other layers on each stage, so a
restore that kept the rows where they were would silently mix layers up. Here every staged leaf of the
train state (parameters and every optimizer or reducer leaf stored under the stack's key) is permuted
from the saved placement to this run's, on device with its shardings unchanged.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np

from jaxdist.config import Config
from jaxdist.errors import JaxdistError
from jaxdist.parallel import pipeline, schedule_registry


def saved_plan(saved_config: dict, now: pipeline.Plan) -> pipeline.Plan:
    """The plan the checkpoint's stack was staged with: this run's pp and layer count, the saved
    schedule and its chunks per stage (read from the saved config's two keys alone, so a config an
    older jaxdist wrote is read too; absent keys are their defaults)."""
    section, default = saved_config.get("pipeline") or {}, Config().pipeline
    entry = schedule_registry.get(section.get("schedule", default.schedule))
    repeats = entry.repeats(int(section.get("repeats", default.repeats)))
    units = now.stages * now.repeats * now.layers_per_group
    return dataclasses.replace(
        now, schedule=entry.name, repeats=repeats, layers_per_group=units // (now.stages * repeats)
    )


def permutation(old: pipeline.Plan, new: pipeline.Plan) -> np.ndarray | None:
    """Rows of the flattened (P V G) stack: new_rows = old_rows[perm]; None when the layouts agree."""
    units = old.stages * old.repeats * old.layers_per_group
    rows = {pipeline.STACK: np.arange(units)}
    staged_old = pipeline.to_stages(rows, old)[pipeline.STACK].ravel()  # layer held at each old row
    staged_new = pipeline.to_stages(rows, new)[pipeline.STACK].ravel()
    perm = np.argsort(staged_old)[staged_new]
    return None if np.array_equal(perm, np.arange(units)) else perm


def _on_stack(path) -> bool:
    return any(getattr(k, "key", None) == pipeline.STACK for k in path)


def restage(tree, old: pipeline.Plan, new: pipeline.Plan, where: Path):
    """`tree` (restored arrays) with every leaf under the stack's key moved from `old`'s placement to `new`'s."""
    perm = permutation(old, new)
    if perm is None:
        return tree
    lead = (new.stages, new.repeats * new.layers_per_group)
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    odd = [jax.tree_util.keystr(p) for p, a in flat if _on_stack(p) and tuple(a.shape[:2]) != lead]
    if odd:
        raise JaxdistError(
            f"checkpoint {where} was saved under pipeline.schedule={old.schedule} and {odd[0]} is not stored by "
            f"stage, so it cannot be moved to {new.schedule}'s placement; resume with pipeline.schedule={old.schedule}"
        )

    staged = [i for i, (p, _) in enumerate(flat) if _on_stack(p)]
    arrays = [flat[i][1] for i in staged]
    move = lambda xs: [a.reshape(-1, *a.shape[2:])[perm].reshape(a.shape) for a in xs]
    moved = dict(zip(staged, jax.jit(move, out_shardings=[a.sharding for a in arrays])(arrays)))
    leaves = [moved.get(i, a) for i, (_, a) in enumerate(flat)]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(tree), leaves)
