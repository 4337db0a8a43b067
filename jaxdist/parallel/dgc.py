"""Deep Gradient Compression (Lin et al., ICLR 2018): `reduce.method=topk`'s default (`reduce.dgc`).

Plain top-k with error feedback hands Adam a bursty sum of stale residuals (+11.5% eval loss at 1% in
the study). DGC accumulates *momentum* on each replica instead and sends the top-k of that. Per
replica and step (inside the manual shard_map):

    g  = clip(this replica's share of the mean gradient, optim.clip_norm / √N)   local clipping
    p  = g                                                     reduce.dgc=gradient (default)
    p  = g / (√v̂ + eps),  v ← b2·v + (1 − b2)·(N·g)²           reduce.dgc=update
    u ← b1·u + (1 − b1)·p        momentum correction (optim.b1: Adam's momentum moves onto the replica)
    a ← a + u                    accumulation (error feedback)
    send the top-k of |a| per chunk (compress.topk's packed uint32s); a ← a − sent; u ← 0 where sent
    (momentum factor masking)

DGC was built for momentum SGD; with Adam, `gradient` feeds the sum to the step's Adam with its first
moment off (b1 = 0: DGC's momentum replaces it; the second moment is Adam's own, of the sum).
`update` compresses the optimizer's update instead: each replica scales by its own second moment of
its own gradient (no communication) and the step applies the sum with the LR and decoupled decay
alone — linear, so the accumulation telescopes, but with one sequence per replica that local second
moment is mostly noise and the steps come out small; measured worse (README). Tensors top-k would not
shrink get the same momentum, summed dense.

Sparsity warm-up: the density falls exponentially from `reduce.warmup_density` to `reduce.ratio` in
`WARMUP_STAGES` equal stages over the warm-up (`reduce.warmup_fraction` of the steps; DGC: 4 epochs,
from 25%: at dp=8 top-k at 25% costs what dense does, so the default starts at 6.25%). Each stage is
a `lax.switch` branch under its own name scope, so its bytes are read from the compiled program
(`measure.dp_bytes_per_step(phase=i)`).

State per replica under a leading `dp` axis, sharded like the parameters, checkpointed with the train
state (restoring onto another dp size: `reduce.check_replica_count`'s one-line error).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxdist.config import Config
from jaxdist.gradients import GradientStage, accumulate_with_stats
from jaxdist.models.moe import metrics_from_sums
from jaxdist.parallel import compress, context, reduce
from jaxdist.resolve import ResolvedModel

WARMUP_STAGES = 4  # DGC's four warm-up epochs


class DgcState(NamedTuple):
    momentum: Any  # u: this replica's momentum not yet sent (masked where sent)
    accum: Any  # a: this replica's accumulated momentum not yet sent (error feedback)
    variance: Any  # v: Adam's second moment of this replica's own gradient (reduce.dgc=update); () else


def enabled(cfg: Config) -> bool:
    return cfg.reduce.method == "topk" and cfg.reduce.dgc != "off"


def stage_scope(i: int) -> str:
    """Name scope of warm-up stage i (contains reduce.WARMUP_SCOPE: the steady state leaves it out)."""
    return f"{reduce.WARMUP_SCOPE}_stage{i}"


def stages(cfg: Config) -> list[tuple[int, int, float]]:
    """(first step, end step, density) of each warm-up stage; after them, `reduce.ratio`. Empty when
    the target is at least the start density or there are no warm-up steps."""
    r, warm = cfg.reduce, reduce.warmup_steps(cfg)
    if warm == 0 or r.ratio >= r.warmup_density:
        return []
    n = min(WARMUP_STAGES, warm)
    bounds = [i * warm // n for i in range(n + 1)]
    return [(bounds[i], bounds[i + 1], r.warmup_density * (r.ratio / r.warmup_density) ** (i / n)) for i in range(n)]


def compressible(shape, density: float, n: int) -> bool:
    """Whether top-k at `density` sends fewer bytes than a dense float32 all-reduce (ring model)."""
    return compress.topk(density).bytes_sent(shape, 0, n) < compress.dense_bytes(shape, n)


def bytes_sent(shape, density: float, n: int) -> float:
    """What one tensor costs per replica at `density`: top-k, or dense where that is not smaller."""
    if compressible(shape, density, n):
        return compress.topk(density).bytes_sent(shape, 0, n)
    return compress.dense_bytes(shape, n)


def exchange(accum, momentum, density: float, axis, n: int):
    """One tensor: (sum over replicas of what each sent, new accum, new momentum)."""
    if not compressible(accum.shape, density, n):  # dense: the momentum itself, nothing held back
        return jax.lax.psum(momentum, axis), accum, momentum
    accum = accum + momentum
    total, sent, _ = compress.topk(density).reduce(accum, (), 0, axis)
    # bfloat16 keeps float32's exponent range: a kept entry is nonzero unless it was exactly zero.
    return total, accum - sent, jnp.where(sent != 0, 0.0, momentum)


def replica_update(cfg: Config, replicas: int):
    """`update(share, state, step) -> (sum over replicas of what was sent, state)`, per replica."""
    r, o = cfg.reduce, cfg.optim
    schedule = stages(cfg)
    densities = [d for _, _, d in schedule] + [r.ratio]

    def update(share, state: DgcState, step):
        if o.clip_norm > 0:  # local clipping, scaled for a sum of N shares (DGC)
            share = optax.clip_by_global_norm(o.clip_norm / math.sqrt(replicas)).update(share, optax.EmptyState())[0]
        variance = state.variance
        if r.dgc == "update":  # this replica's own Adam scaling of its own mean gradient (N x its share)
            variance = jax.tree.map(lambda v, g: o.b2 * v + (1 - o.b2) * (replicas * g) ** 2, variance, share)
            correction = 1 - o.b2 ** (jnp.asarray(step) + 1).astype(jnp.float32)
            share = jax.tree.map(lambda g, v: g / (jnp.sqrt(v / correction) + o.eps), share, variance)
        momentum = jax.tree.map(lambda u, g: o.b1 * u + (1 - o.b1) * g, state.momentum, share)
        leaves_a, treedef = jax.tree.flatten(state.accum)  # accumulated in `exchange`
        leaves_u = treedef.flatten_up_to(momentum)

        def branch(i):
            def run(leaves_a, leaves_u):
                with jax.named_scope(stage_scope(i) if i < len(schedule) else reduce.COMPRESSED_SCOPE):
                    return tuple(
                        zip(*[exchange(a, u, densities[i], r.axis, replicas) for a, u in zip(leaves_a, leaves_u)])
                    )

            return run

        if schedule:  # branch i from the start of stage i; the last (the target) from the warm-up's end
            bounds = [start for start, _, _ in schedule[1:]] + [schedule[-1][1]]
            index = sum((jnp.asarray(step) >= b).astype(jnp.int32) for b in bounds)
            branches = [branch(i) for i in range(len(densities))]
            totals, leaves_a, leaves_u = jax.lax.switch(index, branches, leaves_a, leaves_u)
        else:
            totals, leaves_a, leaves_u = branch(0)(leaves_a, leaves_u)
        new = DgcState(treedef.unflatten(list(leaves_u)), treedef.unflatten(list(leaves_a)), variance)
        return treedef.unflatten(list(totals)), new

    return update


def optimizer(cfg: Config, lr_schedule, decay_mask_tree) -> optax.GradientTransformation:
    """What the step applies to the summed update: no global clip (clipped locally). `gradient`: AdamW
    with b1 = 0; `update`: the LR and decoupled decay (Adam's scaling ran on the replicas)."""
    o = cfg.optim
    if cfg.reduce.dgc == "update":
        scale = optax.identity()
    else:
        scale = optax.scale_by_adam(b1=0.0, b2=o.b2, eps=o.eps)
    return optax.chain(
        scale, optax.add_decayed_weights(o.weight_decay, decay_mask_tree), optax.scale_by_learning_rate(lr_schedule)
    )


def reducer(cfg: Config, replicas: int) -> reduce.Reducer:
    """DGC as a reducer of the explicit reduction (one replica's state; `measure.compile_reduction`)."""
    update = replica_update(cfg, replicas)
    keeps_variance = cfg.reduce.dgc == "update"

    def init(params):
        zeros = lambda: jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)  # noqa: E731
        return DgcState(zeros(), zeros(), zeros() if keeps_variance else ())

    def state_specs(param_specs):
        return DgcState(param_specs, param_specs, param_specs if keeps_variance else ())

    return reduce.Reducer(init=init, update=update, state_specs=state_specs)


def dgc_gradients(apply_fn, cfg: Config, mesh: Mesh, model: ResolvedModel) -> GradientStage:
    axis = cfg.reduce.axis
    replicas, order_T = mesh.shape[axis], context.sequence_order(cfg, mesh)  # cp > 1: load-balanced order
    red = reducer(cfg, replicas)

    def per_replica(params, tokens, state, step):
        grads, loss, count, stats = accumulate_with_stats(apply_fn, params, tokens, cfg.train.grad_accum_steps, order_T)
        local_sq = optax.tree.norm(grads, squared=True) / count**2  # this replica's own mean gradient, squared
        loss, count, sq = jax.lax.psum(jnp.stack([loss, count, local_sq]), axis)
        share = jax.tree.map(lambda g: g / count, grads)  # replica shares sum to the full-batch mean
        total, new = red.update(share, jax.tree.map(lambda s: s[0], state), step)
        extra = metrics_from_sums(jax.lax.psum(stats, axis), count)
        # The mean gradient's norm would need the dense all-reduce DGC avoids: log the RMS of the
        # replicas' own mean-gradient norms instead (not the norm of the sparse sum).
        extra["grad_norm"] = jnp.sqrt(sq / replicas)
        return total, loss / count, jax.tree.map(lambda s: s[None], new), extra

    def init(params):  # every replica starts from zeros
        return jax.tree.map(lambda s: jnp.broadcast_to(s, (replicas,) + s.shape), red.init(params))

    def state_specs(param_specs):
        is_spec = lambda x: isinstance(x, P)  # noqa: E731
        return jax.tree.map(lambda s: P(axis, *s), red.state_specs(param_specs), is_leaf=is_spec)

    apply = reduce.per_replica_apply(per_replica, mesh, axis)
    return GradientStage(init=init, apply=apply, state_specs=state_specs, name="explicit-dgc")
