"""DiLoCo (Douillard et al. 2023): replicas train locally for H steps, then take one outer step.

`reduce.method=diloco`. Each data-parallel replica keeps its own parameters and inner optimizer
(`optim.name`'s optimizer, AdamW by default, with its schedule and clipping) and trains on its own rows only; every
`reduce.diloco.sync_every` (H) steps, and at the run's last step (`syncs`), the replicas average the pseudo-gradient Δ = θ_outer − θ_replica — dense,
or through a codec (`reduce.diloco.outer_codec=int8|topk`, with error feedback) — and the outer optimizer,
Nesterov SGD (`reduce.diloco.outer_lr`, `reduce.diloco.outer_momentum`), moves θ_outer; every replica restarts from it.

It is a gradient stage with state, so the train step keeps its shape: `TrainState.params` is θ_outer,
the stage state holds, per replica under a leading `dp` axis (sharded like the parameters,
checkpointed with the train state), the replica's parameters, its inner optimizer state, the outer
momentum and the codec's state. The stage returns θ_outer − θ_outer_new as its "gradient" and the step
applies it with `outer_optimizer()` (SGD, lr 1): zero between syncs. Collectives of the sync run under
`explicit.SYNC_SCOPE`, so `measure.dp_bytes_per_step(..., sync_every=H)` reports their average per step.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxdist.config import Config
from jaxdist.models.resolve import ResolvedModel
from jaxdist.optim import registry as optimizers
from jaxdist.parallel.loss import ApplyFn
from jaxdist.reduce import explicit
from jaxdist.reduce.gradients import GradientStage, accumulate_gradients


class DilocoState(NamedTuple):
    params: Any  # this replica's parameters (θ_replica)
    inner: Any  # this replica's inner optimizer state
    momentum: Any  # outer momentum (the same on every replica)
    codec: Any  # the pseudo-gradient reducer's state (error feedback), () when dense


def syncs(cfg: Config) -> int:
    """Outer steps in a run of train.steps: every H steps, and at the last step when H does not divide
    the run (its local steps would otherwise be lost): ceil(steps / H)."""
    return -(-cfg.train.steps // cfg.reduce.diloco.sync_every)


def outer_optimizer() -> optax.GradientTransformation:
    """What the train step applies to the stage's output: params − (θ_outer − θ_outer_new)."""
    return optax.sgd(1.0)


def diloco_gradients(apply_fn: ApplyFn, cfg: Config, mesh: Mesh, model: ResolvedModel, exchange: explicit.Reducer):
    """`exchange`: sums the pseudo-gradient Δ over replicas (dense, or `reduce.diloco.outer_codec`)."""
    r, axis = cfg.reduce, cfg.reduce.axis
    replicas, H = mesh.shape[axis], r.diloco.sync_every
    inner_tx, _ = optimizers.make(cfg.optim, cfg.train.steps, cfg.train.global_batch // replicas, model.names)
    outer_lr, mu = r.diloco.outer_lr, r.diloco.outer_momentum

    def per_replica(outer, tokens, state: DilocoState, step):
        grads, loss, count = accumulate_gradients(apply_fn, state.params, tokens, cfg.train.grad_accum_steps)
        total = jax.lax.psum(jnp.stack([loss, count]), axis)  # the logged loss: every replica's tokens
        updates, inner = inner_tx.update(jax.tree.map(lambda g: g / count, grads), state.inner, state.params)
        local = optax.apply_updates(state.params, updates)

        def sync(local, momentum, codec):
            with jax.named_scope(explicit.SYNC_SCOPE):
                delta = jax.tree.map(jnp.subtract, outer, local)
                summed, codec = exchange.update(delta, codec, step)
            delta = jax.tree.map(lambda d: d / replicas, summed)
            momentum = jax.tree.map(lambda m, d: mu * m + d, momentum, delta)
            new_outer = jax.tree.map(lambda p, d, m: p - outer_lr * (d + mu * m), outer, delta, momentum)
            return new_outer, momentum, codec

        def wait(local, momentum, codec):
            return local, momentum, codec

        # Every H steps, and at the run's last step: its local steps since the last sync are not lost.
        synced = ((step + 1) % H == 0) | (step + 1 == cfg.train.steps)
        new_local, momentum, codec = jax.lax.cond(synced, sync, wait, local, state.momentum, state.codec)
        # Between syncs the outer parameters stay; at a sync every replica restarts from the new ones.
        step_out = jax.tree.map(lambda o, n: jnp.where(synced, o - n, jnp.zeros_like(o)), outer, new_local)
        new_state = DilocoState(params=new_local, inner=inner, momentum=momentum, codec=codec)
        return step_out, total[0] / total[1], jax.tree.map(lambda s: s[None], new_state)

    def apply(params, tokens, state, step):
        fn = jax.shard_map(
            lambda o, t, s, i: per_replica(o, t, jax.tree.map(lambda x: x[0], s), i),
            mesh=mesh,
            in_specs=(P(), P(axis), P(axis), P()),
            out_specs=(P(), P(), P(axis)),
            axis_names={axis},
            check_vma=False,
        )
        delta, loss, state = fn(params, tokens, state, step)
        return delta, loss, state, {}

    def init(params):  # every replica starts from the outer parameters
        zeros = jax.tree.map(jnp.zeros_like, params)
        local = DilocoState(params=params, inner=inner_tx.init(params), momentum=zeros, codec=exchange.init(params))
        return jax.tree.map(lambda s: jnp.broadcast_to(s, (replicas,) + s.shape), local)

    def state_specs(param_specs):
        is_spec = lambda x: isinstance(x, P)
        inner_abstract = jax.eval_shape(inner_tx.init, model.abstract)
        inner = optimizers.state_specs(cfg.optim, inner_tx, inner_abstract, param_specs)
        local = DilocoState(
            params=param_specs, inner=inner, momentum=param_specs, codec=exchange.state_specs(param_specs)
        )
        return jax.tree.map(lambda s: P(axis, *s), local, is_leaf=is_spec)

    return GradientStage(init=init, apply=apply, state_specs=state_specs, name="explicit-diloco")
