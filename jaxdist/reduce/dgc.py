"""Deep Gradient Compression (Lin et al., ICLR 2018): `reduce.method=topk`'s default (`reduce.topk.dgc`).

Plain top-k with error feedback hands Adam a bursty sum of stale residuals (+11.5% eval loss at 1% in
the study). DGC accumulates *momentum* on each replica instead and sends the top-k of that. Per
replica and step (inside the manual shard_map):

    g  = clip(this replica's share of the mean gradient, optim.clip_norm / √N)   local clipping
    p  = g / ŝ                    reduce.topk.dgc=update (default): Adam's scaling, per replica
         m ← b1·m + (1 − b1)·N·g,  v ← b2·v + (1 − b2)·(N·g)²   (this replica's own gradient N·g)
         ŝ = √((1 − 1/N)·m̂² + v̂/N) + eps   (the *mean* gradient's scale: `mean_gradient_scale`)
    p  = g                        reduce.topk.dgc=gradient
    u ← b1·u + (1 − b1)·p        momentum correction (optim.b1: Adam's momentum moves onto the replica)
    a ← a + u·c                  accumulation (error feedback); update: c = 1/(1 − b1^t), Adam's m̂
    send the top-k of |a| per chunk (compress.topk's packed uint32s); a ← a − sent; u ← 0 where kept
    (momentum factor masking)

DGC was built for momentum SGD, where the accumulation telescopes: over time the sum of what was sent
is the sum of every replica's momentum. `update` keeps that under Adam by compressing the optimizer's
update: the step applies the sum with the LR and decoupled decay alone (linear). Its scale ŝ
estimates, on each replica and without communication, the second moment of the *mean* gradient that
dense Adam divides by, E[ḡ²] = μ² + σ²/N, from the replica's own moments (m̂² ≈ μ², v̂ ≈ μ² + σ²):
a replica's own v̂ alone overstates a noisy coordinate by up to N (one sequence per replica at dp=8),
and the steps came out up to √N too small (the first version; measured in docs/compression.md). `gradient`
feeds the sum to the step's Adam with its first moment off (b1 = 0; the second moment is Adam's own,
of the bursty sparse sum: entries sent rarely get at most √(1/(1 − b2))·lr per send) — close on the
small study shape, 9% off dense on `tiny`. Tensors top-k would not shrink get the same momentum,
summed dense.

Sparsity warm-up: the density falls exponentially from `reduce.topk.warmup_density` to `reduce.ratio` in
`WARMUP_STAGES` equal stages over the warm-up (`reduce.warmup_fraction` of the steps; DGC: 4 epochs,
from 25%: at dp=8 top-k at 25% costs what dense does, so the default starts at 6.25%). Each stage is
a `lax.switch` branch under its own name scope, so its bytes are read from the compiled program
(`measure.dp_bytes_per_step(phase=i)`).

State per replica under a leading `dp` axis, sharded like the parameters, checkpointed with the train
state (restoring onto another dp size: `explicit.check_replica_count`'s one-line error).
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
from jaxdist.models.moe import metrics_from_sums
from jaxdist.models.resolve import ResolvedModel
from jaxdist.parallel import context
from jaxdist.parallel.loss import ApplyFn
from jaxdist.reduce import compress, explicit
from jaxdist.reduce.gradients import GradientStage, accumulate_with_stats, aux_scale

WARMUP_STAGES = 4  # DGC's four warm-up epochs


class DgcState(NamedTuple):
    momentum: Any  # u: this replica's momentum not yet sent (zeroed where kept)
    accum: Any  # a: this replica's accumulated momentum not yet sent (error feedback)
    variance: Any  # v: Adam's second moment of this replica's own gradient (reduce.topk.dgc=update); () else
    mean: Any = ()  # m: the EMA of this replica's own gradient (reduce.topk.dgc=update); () else


def stage_scope(i: int) -> str:
    """Name scope of warm-up stage i (contains explicit.WARMUP_SCOPE: the steady state leaves it out)."""
    return f"{explicit.WARMUP_SCOPE}_stage{i}"


MAX_WARMUP_SPAN = 25  # the warm-up starts at most 25x the target density (DGC: 25% -> 0.1% is 250x)


def start_density(cfg: Config) -> float:
    """`reduce.topk.warmup_density`, or 25x `reduce.ratio` where that is lower: a 0.1% target starts at
    2.5%, so the warm-up's 30 steps cost ~1.3 dense steps, not 2.8 (run average 128x, not 78x)."""
    return min(cfg.reduce.topk.warmup_density, MAX_WARMUP_SPAN * cfg.reduce.ratio)


def stages(cfg: Config) -> list[tuple[int, int, float]]:
    """(first step, end step, density) of each warm-up stage; after them, `reduce.ratio`. Empty when
    the target is at least the start density or there are no warm-up steps."""
    r, warm, start = cfg.reduce, explicit.warmup_span(cfg), start_density(cfg)
    if warm == 0 or r.ratio >= start:
        return []
    n = min(WARMUP_STAGES, warm)
    bounds = [i * warm // n for i in range(n + 1)]
    return [(bounds[i], bounds[i + 1], start * (r.ratio / start) ** (i / n)) for i in range(n)]


def compressible(shape, density: float, n: int) -> bool:
    """Whether top-k at `density` sends fewer bytes than a dense float32 all-reduce (ring model)."""
    return compress.cheaper(compress.topk(density), shape, 0, n)


def bytes_sent(shape, density: float, n: int) -> float:
    """What one tensor costs per replica at `density`: the top-k codec's own `bytes_sent`, or dense."""
    return compress.bytes_or_dense(compress.topk(density), shape, 0, n)


def exchange(accum, momentum, density: float, axis, n: int, bias: jax.Array | float = 1.0):
    """One tensor: (sum over replicas of what each sent, new accum, new momentum); `bias` scales the
    momentum as it is accumulated (Adam's 1 / (1 − b1^t) under reduce.topk.dgc=update)."""
    if not compressible(accum.shape, density, n):  # dense: the momentum itself, nothing held back
        return jax.lax.psum(momentum * bias, axis), accum, momentum
    accum = accum + momentum * bias
    total, sent, kept = compress.topk_sum(accum, density, axis)
    return total, accum - sent, jnp.where(kept, 0.0, momentum)  # momentum factor masking: kept positions


def mean_gradient_scale(mean, variance, step, o, n: int):
    """√v̂ + eps of the *mean* gradient (over n replicas), estimated on one replica from its own
    gradient's EMA m and second moment v: E[ḡ²] = μ² + σ²/n, with μ² ≈ m̂² and μ² + σ² ≈ v̂ (the
    replica's own v̂ alone overstates a noisy coordinate's scale by up to n, so its steps come out
    up to √n too small)."""
    t = (jnp.asarray(step) + 1).astype(jnp.float32)
    m_hat, v_hat = mean / (1 - o.b1**t), variance / (1 - o.b2**t)
    return jnp.sqrt((1 - 1 / n) * m_hat**2 + v_hat / n) + o.eps


def replica_update(cfg: Config, replicas: int):
    """`update(share, state, step) -> (sum over replicas of what was sent, state)`, per replica."""
    r, o = cfg.reduce, cfg.optim
    schedule = stages(cfg)
    densities = [d for _, _, d in schedule] + [r.ratio]

    def update(share, state: DgcState, step):
        if o.clip_norm > 0:  # local clipping, scaled for a sum of N shares (DGC)
            share = optax.clip_by_global_norm(o.clip_norm / math.sqrt(replicas)).update(share, optax.EmptyState())[0]
        variance, mean, bias = state.variance, state.mean, 1.0
        if r.topk.dgc == "update":  # Adam's scaling of this replica's own mean gradient (N x its share)
            variance = jax.tree.map(lambda v, g: o.b2 * v + (1 - o.b2) * (replicas * g) ** 2, variance, share)
            mean = jax.tree.map(lambda m, g: o.b1 * m + (1 - o.b1) * replicas * g, mean, share)
            scale = lambda m, v: mean_gradient_scale(m, v, step, o, replicas)
            share = jax.tree.map(lambda g, m, v: g / scale(m, v), share, mean, variance)
            # Adam's bias correction of its momentum: the step applies m̂ = m / (1 − b1^t), not m.
            bias = 1 / (1 - o.b1 ** (jnp.asarray(step) + 1).astype(jnp.float32))
        momentum = jax.tree.map(lambda u, g: o.b1 * u + (1 - o.b1) * g, state.momentum, share)
        leaves_a, treedef = jax.tree.flatten(state.accum)  # accumulated in `exchange`
        leaves_u = treedef.flatten_up_to(momentum)

        def branch(i):
            def run(leaves_a, leaves_u):
                with jax.named_scope(stage_scope(i) if i < len(schedule) else explicit.COMPRESSED_SCOPE):
                    return tuple(
                        zip(*[exchange(a, u, densities[i], r.axis, replicas, bias) for a, u in zip(leaves_a, leaves_u)])
                    )

            return run

        if schedule:  # branch i from the start of stage i; the last (the target) from the warm-up's end
            bounds = [start for start, _, _ in schedule[1:]] + [schedule[-1][1]]
            index = sum((jnp.asarray(step) >= b).astype(jnp.int32) for b in bounds)
            branches = [branch(i) for i in range(len(densities))]
            totals, leaves_a, leaves_u = jax.lax.switch(index, branches, leaves_a, leaves_u)
        else:
            totals, leaves_a, leaves_u = branch(0)(leaves_a, leaves_u)
        new = DgcState(treedef.unflatten(list(leaves_u)), treedef.unflatten(list(leaves_a)), variance, mean)
        return treedef.unflatten(list(totals)), new

    return update


def optimizer(cfg: Config, lr_schedule, decay_mask_tree) -> optax.GradientTransformation:
    """What the step applies to the summed update: no global clip (clipped locally). `gradient`: AdamW
    with b1 = 0; `update`: the LR and decoupled decay (Adam's scaling ran on the replicas)."""
    o = cfg.optim
    scale = optax.identity() if cfg.reduce.topk.dgc == "update" else optax.scale_by_adam(b1=0.0, b2=o.b2, eps=o.eps)
    return optax.chain(
        scale, optax.add_decayed_weights(o.weight_decay, decay_mask_tree), optax.scale_by_learning_rate(lr_schedule)
    )


def reducer(cfg: Config, replicas: int) -> explicit.Reducer:
    """DGC as a reducer of the explicit reduction (one replica's state; `measure.compile_reduction`)."""
    update = replica_update(cfg, replicas)
    moments = cfg.reduce.topk.dgc == "update"

    def init(params):
        zeros = lambda: jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        return DgcState(zeros(), zeros(), zeros() if moments else (), zeros() if moments else ())

    def state_specs(param_specs):
        extra = param_specs if moments else ()
        return DgcState(param_specs, param_specs, extra, extra)

    return explicit.Reducer(init=init, update=update, state_specs=state_specs)


def dgc_gradients(apply_fn: ApplyFn, cfg: Config, mesh: Mesh, model: ResolvedModel) -> GradientStage:
    axis = cfg.reduce.axis
    replicas, order_T = mesh.shape[axis], context.sequence_order(cfg, mesh)  # cp > 1: load-balanced order
    red = reducer(cfg, replicas)

    def per_replica(params, tokens, state, step):
        scale = lambda: jax.lax.psum(aux_scale(tokens), axis) / replicas  # the global aux weight (MoE only)
        grads, loss, count, stats = accumulate_with_stats(
            apply_fn, params, tokens, cfg.train.grad_accum_steps, order_T, scale
        )
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
        is_spec = lambda x: isinstance(x, P)
        return jax.tree.map(lambda s: P(axis, *s), red.state_specs(param_specs), is_leaf=is_spec)

    apply = explicit.per_replica_apply(per_replica, mesh, axis)
    return GradientStage(init=init, apply=apply, state_specs=state_specs, name="explicit-dgc")
