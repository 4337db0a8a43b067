"""Host offload (the `offload` config section): what lives in pinned host memory between steps, how a
traced function brings it to the device, the one-line refusals, and the bytes each kind moves per step.

- offload.optimizer=host: the AdamW state is host-resident; the step streams it in for the update.
- offload.params=host: the float32 parameters are host-resident. The layer scan fetches each layer's
  slice inside its body (`fetch`); under a remat policy only the layer being computed is on the device
  (its backward fetches it again), without one JAX saves the fetched weights for the backward. The
  other parameters (embedding, final norm, head) are fetched before the model runs. Gradients are taken
  with respect to device zeros added to the fetched copies (`differentiable`), so they stay on the
  device (the transpose of a fetch would send them to host memory); the update streams parameters in
  and out like the optimizer state.
- offload.activations=host: the remat policy of the layer scan saves the block's residuals to host
  memory (`activation_policy`) instead of keeping them on the device or recomputing them.

`moves` lists the host<->device moves of a traced step (`host_transfers` sizes them per
device: bench's `host_transfers`, the start-up line, the planner's check).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.extend import core

from jaxdist.errors import JaxdistError

HOST_KIND = "pinned_host"
FETCHED = "offload_fetched"  # checkpoint name of a fetched (device) copy
# The layer scan's remat policy when parameters are offloaded and model.remat=none: every residual but
# the fetched copies themselves. Values computed from them are still saved, so the backward does not
# refetch (measure.host_transfers counts no second fetch) and every layer's device copy lives until the
# backward; a remat policy (model.remat=full / dots_saveable) holds one layer at a time.
REFETCH_POLICY = jax.checkpoint_policies.save_anything_except_these_names(FETCHED)


def on_host(x) -> bool:
    """Whether a traced (or concrete) array lives in host memory."""
    return getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host


@jax.tree_util.register_pytree_node_class
class Offloaded:
    """A host-resident parameter with a device-resident zero `delta` beside it: `fetch` gives its device
    copy plus the delta, and the gradient stage differentiates with respect to the delta
    (`differentiable`), so gradients stay in device memory (the transpose of a fetch would send them to
    host memory, and the accumulation fetch them back, 2 x the parameters per micro-batch). Scans slice
    both (a layer's slice is an Offloaded too)."""

    def __init__(self, host, delta):
        self.host, self.delta = host, delta

    def tree_flatten(self):
        return (self.host, self.delta), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(*children)


def is_offloaded(x) -> bool:
    return isinstance(x, Offloaded)


def differentiable(params, deltas):
    """`params` as the model takes them when gradients are wanted for `deltas` (a params-shaped tree of
    zeros in device memory): host-resident leaves become Offloaded(leaf, delta), the others leaf + delta
    (gradients flow through the deltas only; adding zeros changes no value)."""
    stop = jax.lax.stop_gradient
    return jax.tree.map(lambda p, d: Offloaded(stop(p), d) if on_host(p) else stop(p) + d, params, deltas)


def fetch(tree):
    """Every host-resident array of `tree` copied to device memory (same sharding), an Offloaded one plus
    its delta; the rest as is. Traced inside jit: XLA moves the bytes where the copy is used (per layer
    inside the scan)."""

    def copy(x):
        return checkpoint_name(jax.device_put(x, jax.memory.Space.Device), FETCHED)

    def one(x):
        if is_offloaded(x):
            return copy(x.host) + x.delta
        return copy(x) if on_host(x) else x

    return jax.tree.map(one, tree, is_leaf=is_offloaded)


def activation_policy():
    """The remat policy of offload.activations=host: the layer's matmul outputs (those without batch
    dimensions in their contraction, what model.remat=dots_saveable keeps on the device) are saved to
    pinned host memory and brought back for the backward pass; the rest is recomputed."""
    return jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", HOST_KIND)


def check(cfg, mesh) -> None:
    """One-line errors for what offload does not compose with (yet)."""
    if cfg.offload.activations == "host" and cfg.model.remat not in ("none", "offload_dots"):
        raise JaxdistError(
            f"offload.activations=host picks the layer's remat policy itself; it conflicts with "
            f"model.remat={cfg.model.remat}: set model.remat=none (or offload.activations=none)"
        )
    if cfg.offload.params != "host":
        return
    pp = dict(mesh.shape).get("pp", 1)
    if pp > 1:
        raise JaxdistError("offload.params=host is not supported with pipeline parallelism (pp > 1); use pp=1")
    if cfg.lora.rank:
        raise JaxdistError(
            "offload.params=host is not supported with LoRA (lora.rank > 0) yet; use offload.params=none"
        )


@dataclasses.dataclass(frozen=True)
class Move:
    """One memory-space move of a traced program (a `device_put` between host and device memory: what
    JAX lowers to an `annotate_device_placement` and XLA:GPU's host offloader turns into a copy)."""

    to_host: bool
    shape: tuple[int, ...]  # global shape (one device's inside a shard_map: `manual`)
    dtype: str
    count: int  # executions per program run: the lengths of the scans around it multiplied
    manual: bool = False
    trips_known: bool = True  # False: inside a while loop (count is a floor)

    @property
    def global_bytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def _subjaxprs(eqn):
    """(jaxpr, trips, manual, trips_known) of every jaxpr an equation runs; a cond's branches as a list."""
    name, params = eqn.primitive.name, eqn.params
    out = []
    for key, value in params.items():
        values = value if isinstance(value, (tuple, list)) else (value,)
        found = [v.jaxpr if isinstance(v, core.ClosedJaxpr) else v for v in values]
        found = [j for j in found if isinstance(j, core.Jaxpr)]
        if not found:
            continue
        if name == "cond" and key == "branches":
            out.append(found)  # one branch runs: the caller keeps the largest
            continue
        for j in found:
            out.append((j, params["length"] if name == "scan" else 1, name == "shard_map", name != "while"))
    return out


def moves(jaxpr, count: int = 1, manual: bool = False, known: bool = True) -> list[Move]:
    """Every host<->device move of a jaxpr (jax.make_jaxpr / `jit(f).trace(...).jaxpr.jaxpr`) with its
    executions per run: a move inside a scan body counts once per iteration (nested scans multiply), one
    in a while loop once (flagged), of a cond's branches only the one moving the most bytes."""
    host, device = jax.memory.Space.Host, jax.memory.Space.Device
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "device_put":
            for a, b in zip(eqn.invars, eqn.outvars, strict=True):
                src, dst = getattr(a.aval, "memory_space", None), getattr(b.aval, "memory_space", None)
                if {src, dst} == {host, device}:
                    found.append(Move(dst == host, tuple(b.aval.shape), str(b.aval.dtype), count, manual, known))
        for sub in _subjaxprs(eqn):
            if isinstance(sub, list):  # cond branches
                branches = [moves(j, count, manual, known) for j in sub]
                found += max(branches, key=lambda ms: sum(m.count * m.global_bytes for m in ms))
            else:
                j, trips, shard_map, trips_known = sub
                found += moves(j, count * trips, manual or shard_map, known and trips_known)
    return found


def host_transfers(prog) -> dict:
    """Host<->device bytes per device one train step moves, counted from the traced step's memory-space
    moves (`offload.moves`: scan trip counts multiplied in) and its outputs kept in host memory:
    {"host_to_device_bytes", "device_to_host_bytes", "moves", "assumed_bytes", "trips_known"} (False: a
    move sits in a while loop, counted once: the bytes are a floor).

    Why not the compiled program's copies: XLA:CPU strips the placements before partitioning (its pass
    strip-memory-placement-annotations), so the program it compiles has none; each move here is one
    placement of the program lowered for a GPU, which XLA:GPU's host offloader turns into a copy
    (tests/test_offload.py pairs the two). A move's per-device bytes are those of the state leaf (or
    stacked layer slice) of its shape and dtype under the state's shardings; a shape that is no state
    leaf's (activation residuals) is taken as split over the batch axes only, one that several leaves
    sharded differently share as the largest of them (`assumed_bytes`: those moves' share; a residual
    also split over tp is overcounted by tp)."""
    tokens = jax.ShapeDtypeStruct(
        (prog.cfg.train.global_batch, prog.cfg.model.seq_len + 1), jnp.int32, sharding=prog.batch_sharding
    )
    with prog.activate():
        traced = prog.train_step.fn.trace(prog.abstract_state, tokens)
    sizes: dict[tuple, set[int]] = {}  # (shape, dtype) -> per-device bytes of the state leaves of that shape
    for part in ("params", "opt_state"):
        leaves = jax.tree_util.tree_flatten_with_path(getattr(prog.abstract_state, part))[0]
        for (path, a), s in zip(leaves, jax.tree.leaves(getattr(prog.state_shardings, part)), strict=True):
            shard = s.shard_shape(a.shape)
            sizes.setdefault((tuple(a.shape), str(a.dtype)), set()).add(math.prod(shard) * a.dtype.itemsize)
            if any(getattr(k, "key", None) == "blocks" for k in path):  # the scan moves one layer's slice
                key = (tuple(a.shape[1:]), str(a.dtype))
                sizes.setdefault(key, set()).add(math.prod(shard[1:]) * a.dtype.itemsize)
    out = {"host_to_device_bytes": 0, "device_to_host_bytes": 0, "moves": 0, "assumed_bytes": 0, "trips_known": True}
    for m in moves(traced.jaxpr.jaxpr):
        out["trips_known"] &= m.trips_known
        known = sizes.get((m.shape, m.dtype), set())
        if m.manual:
            per_device = m.global_bytes
        elif len(known) == 1:
            per_device = next(iter(known))
        else:  # no state leaf of this shape (a residual), or several sharded differently: the largest
            per_device = max(known, default=m.global_bytes // prog.batch_shards())
            out["assumed_bytes"] += m.count * per_device
        out["device_to_host_bytes" if m.to_host else "host_to_device_bytes"] += m.count * per_device
        out["moves"] += m.count
    # The step's results kept in host memory (out_shardings) leave the device once, at its end.
    for a, s in zip(jax.tree.leaves(prog.abstract_state), jax.tree.leaves(prog.state_shardings), strict=True):
        if s.memory_kind == HOST_KIND:
            out["device_to_host_bytes"] += math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize
            out["moves"] += 1
    return out
