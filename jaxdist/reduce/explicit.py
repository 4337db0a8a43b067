"""Explicit data-parallel gradient reduction: per-replica gradients, accumulated locally, reduced once.

Why explicit: under plain `jit` XLA all-reduces the gradients inside every micro-batch iteration, and
a compressor never sees per-replica gradients. Here the loss/gradient runs inside `jax.shard_map`
that is manual over the reduce axis only (`reduce.axis`, default dp; fsdp/tp/pp stay automatic), so
each replica accumulates its own gradient sum over `train.grad_accum_steps` and the replicas then reduce
**once** per optimizer step — dense, or compressed (`compress.py`: top-k, PowerSGD, int8).

Reducers are optax-style transformations of the per-replica gradient tree, run inside that shard_map:
`init(params) -> state`, `update(grads, state, step) -> (grads summed over replicas, state)`, and
`state_specs(param_specs)` (error-feedback residuals are sharded like the parameters). The stage keeps
each replica's state under a leading replica axis (`P('dp', *param_spec)`), so it is part of the
train state and is checkpointed like any other array.

Its bytes across the reduce axis are read from the compiled program: `jaxdist.analysis.measure`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxdist.config import Config
from jaxdist.errors import JaxdistError
from jaxdist.models.moe import metrics_from_sums
from jaxdist.models.resolve import ResolvedModel
from jaxdist.parallel import context
from jaxdist.parallel.loss import ApplyFn
from jaxdist.reduce import compress
from jaxdist.reduce.gradients import GradientStage, accumulate_with_stats, aux_scale

# The dense warm-up branch (topk / powersgd's first `registry.warmup_steps(cfg)` steps) runs under this name
# scope; `measure.dp_bytes_per_step` leaves its collectives out to report the steady state.
WARMUP_SCOPE = "reduce_warmup"
COMPRESSED_SCOPE = "reduce_compressed"  # the branch that replaces it after the warm-up
SYNC_SCOPE = "reduce_sync"  # collectives that run once per sync period (DiLoCo's outer step)


class Reducer(NamedTuple):
    """Sums per-replica gradients over the reduce axis; `update` runs inside the manual shard_map."""

    init: Callable  # params -> per-replica state
    update: Callable  # (grads, state, step) -> (grads summed over replicas, state)
    state_specs: Callable  # param PartitionSpecs -> PartitionSpecs of the per-replica state


def dense(axis: str, dtype=jnp.float32) -> Reducer:
    """`psum` in `dtype` (bfloat16 halves the bytes; the sum is then rounded to bfloat16)."""
    if jnp.dtype(dtype) != jnp.float32 and jax.default_backend() == "cpu":
        raise JaxdistError(
            f"reduce.dtype={jnp.dtype(dtype).name} with reduce.method=dense crashes XLA's CPU compiler "
            "(a bf16 psum inside a shard_map manual over some mesh axes only: 'Invalid binary instruction "
            "opcode copy', jax 0.10.2); use reduce.dtype=float32 on CPU, or reduce.method=implicit, whose "
            "bf16 reduction compiles"
        )

    def update(grads, state, step=None):
        return jax.tree.map(lambda g: jax.lax.psum(g.astype(dtype), axis).astype(g.dtype), grads), state

    return Reducer(init=lambda params: (), update=update, state_specs=lambda specs: ())


class CompressedState(NamedTuple):
    residual: Any  # error feedback: what this replica has not sent yet (a tree like params); () if off
    codec: tuple  # per-tensor codec state in tree-flatten order; () for stateless or dense tensors


def compressed(
    codec: compress.Codec, axis: str, replicas: int, abstract_params, batch_dims, error_feedback: bool = True
) -> Reducer:
    """A lossy sum with error feedback (Stich et al. 2018; Karimireddy et al. 2019): each replica
    compresses gradient + residual and keeps, as its new residual, exactly what it did not send.
    Tensors the codec would not shrink (by the ring model) are sent dense. `batch_dims`: a tree like
    the params, the number of leading stacked-layer dims of each tensor."""
    shapes = [p.shape for p in jax.tree.leaves(abstract_params)]
    bdims = jax.tree.leaves(batch_dims)
    use = [compress.cheaper(codec, s, b, replicas) for s, b in zip(shapes, bdims)]

    def init(params):
        codec_state = tuple(codec.init(s, b) if u else () for s, b, u in zip(shapes, bdims, use))
        return CompressedState(jax.tree.map(jnp.zeros_like, params) if error_feedback else (), codec_state)

    def state_specs(param_specs):
        codec_state = jax.eval_shape(lambda: init(abstract_params).codec)
        return CompressedState(param_specs if error_feedback else (), jax.tree.map(lambda _: P(), codec_state))

    def update(grads, state, step=None):
        x = jax.tree.map(jnp.add, grads, state.residual) if error_feedback else grads
        leaves, treedef = jax.tree.flatten(x)
        totals, sents, codec_state = [], [], []
        for x_leaf, b, u, s in zip(leaves, bdims, use, state.codec):
            total, sent, s = codec.reduce(x_leaf, s, b, axis) if u else (jax.lax.psum(x_leaf, axis), x_leaf, s)
            totals.append(total)
            sents.append(sent)
            codec_state.append(s)
        residual = jax.tree.map(jnp.subtract, x, treedef.unflatten(sents)) if error_feedback else ()
        return treedef.unflatten(totals), CompressedState(residual, tuple(codec_state))

    return Reducer(init=init, update=update, state_specs=state_specs)


def with_warmup(warmup: Reducer, main: Reducer, start_step: int) -> Reducer:
    """`warmup` (stateless, e.g. dense) for steps < start_step, then `main`; main's state waits."""
    if start_step <= 0:
        return main

    def update(grads, state, step):
        def warm(grads, state):
            with jax.named_scope(WARMUP_SCOPE):
                return warmup.update(grads, (), step)[0], state

        def compressed(grads, state):
            with jax.named_scope(COMPRESSED_SCOPE):
                return main.update(grads, state, step)

        return jax.lax.cond(step < start_step, warm, compressed, grads, state)

    return main._replace(update=update)


def warmup_span(cfg: Config) -> int:
    """max(reduce.start_step, warmup_fraction·steps): the warm-up of a method that has one
    (`registry.warmup_steps` says which do)."""
    r = cfg.reduce
    return max(r.start_step, math.ceil(r.warmup_fraction * cfg.train.steps))


def warn_one_replica(cfg: Config) -> None:
    warnings.warn(
        f"reduce.method={cfg.reduce.method} does nothing with {cfg.reduce.axis}=1 (one replica, "
        "nothing to compress); reducing dense",
        stacklevel=3,
    )


def check_replicated(cfg: Config, mesh: Mesh, model: ResolvedModel) -> None:
    """An error for parameters sharded over the reduce axis (a mesh axis: checked in config/axes.py)."""
    axis = cfg.reduce.axis
    for spec in jax.tree.leaves(model.specs, is_leaf=lambda x: isinstance(x, P)):
        if axis in {a for entry in spec for a in ((entry,) if isinstance(entry, str) else entry or ())}:
            raise JaxdistError(
                f"reduce.method={cfg.reduce.method} needs parameters replicated over {axis}, but "
                f"mesh.rules shard one over it ({spec}); remove {axis} from mesh.rules or use "
                f"reduce.method=implicit"
            )


def per_replica_apply(per_replica: Callable, mesh: Mesh, axis: str) -> Callable:
    """`apply(params, tokens, state, step)` running `per_replica` once per `axis` replica (manual over
    `axis` only): params and step replicated, tokens and per-replica state split over `axis`; returns
    (gradient-like update, loss, state, metrics), the update and loss replicated."""

    def apply(params, tokens, state, step):
        fn = jax.shard_map(
            per_replica,
            mesh=mesh,
            in_specs=(P(), P(axis), P(axis), P()),
            out_specs=(P(), P(), P(axis), P()),
            axis_names={axis},
            check_vma=False,
        )
        return fn(params, tokens, state, step)

    return apply


def explicit_gradients(apply_fn: ApplyFn, cfg: Config, mesh: Mesh, model: ResolvedModel, reducer: Reducer):
    """Per-replica loss/gradients in a shard_map manual over `reduce.axis`, accumulated over
    `train.grad_accum_steps` (token-weighted), then reduced once by `reducer` (`registry.reducer`).
    Activation constraints drop the manual axis (sharding.constrain), so `apply_fn` runs unchanged inside."""
    axis = cfg.reduce.axis
    order_T = context.sequence_order(cfg, mesh)  # cp > 1: the load-balanced sequence order
    replicas, microbatches = mesh.shape[axis], cfg.train.grad_accum_steps

    def per_replica(params, tokens, state, step):
        # the aux objective's weight over the global batch (kept targets / positions, all replicas)
        scale = lambda: jax.lax.psum(aux_scale(tokens), axis) / replicas  # called by MoE models only
        grads, loss, count, stats = accumulate_with_stats(apply_fn, params, tokens, microbatches, order_T, scale)
        loss, count = jax.lax.psum(jnp.stack([loss, count]), axis)  # token-weighted over all replicas
        mine = jax.tree.map(lambda g: g / count, grads)  # replica shares sum to the full-batch mean
        summed, state = reducer.update(mine, jax.tree.map(lambda s: s[0], state), step)
        extra = metrics_from_sums(jax.lax.psum(stats, axis), count)  # model statistics (MoE), all replicas
        return summed, loss / count, jax.tree.map(lambda s: s[None], state), extra

    apply = per_replica_apply(per_replica, mesh, axis)

    def init(params):  # every replica starts from the same state
        return jax.tree.map(lambda s: jnp.broadcast_to(s, (replicas,) + s.shape), reducer.init(params))

    def state_specs(param_specs):
        return jax.tree.map(lambda s: P(axis, *s), reducer.state_specs(param_specs), is_leaf=lambda x: isinstance(x, P))

    return GradientStage(init=init, apply=apply, state_specs=state_specs, name=f"explicit-{cfg.reduce.method}")


def check_replica_count(saved_metadata, abstract_state, cfg: Config, where) -> None:
    """Per-replica reducer state (error-feedback residuals, DiLoCo's replicas) is saved with a leading
    replica axis; restoring it onto another replica count is refused with the fix, before orbax fails
    deep inside. `saved_metadata`: the checkpoint's item metadata (shapes of what was saved)."""
    wanted = [tuple(a.shape) for a in jax.tree.leaves(abstract_state) if len(a.shape)]
    try:
        saved_state = saved_metadata["train"]["reducer_state"]
    except (KeyError, TypeError, IndexError):  # nothing per replica was saved
        return
    saved = [tuple(m.shape) for m in jax.tree.leaves(saved_state) if hasattr(m, "shape") and len(m.shape)]
    if saved and wanted and saved[0][0] != wanted[0][0]:
        axis = cfg.reduce.axis
        raise JaxdistError(
            f"checkpoint {where} holds per-replica reduce.method={cfg.reduce.method} state for "
            f"{axis}={saved[0][0]}, but this mesh has {axis}={wanted[0][0]}; resume on {axis}="
            f"{saved[0][0]}, or restart the optimizer from its weights with checkpoint.params_only=true"
        )
