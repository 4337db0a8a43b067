"""DeMo (Peng, Quesnelle & Kingma 2024, "Decoupled Momentum Optimization"): `reduce.method=demo`.

Each data-parallel replica keeps its own momentum δ of its *local* gradient and never all-reduces
gradients. Per step: clip the local gradient (`optim.clip_norm`, per replica: DGC's local clipping),
δ ← β·δ + lr·g (β = `reduce.demo.momentum_decay`); split δ into chunks of at most `reduce.demo.chunk`² entries,
take each chunk's 2-D DCT (an orthonormal basis in which the momentum's slow, shared part is sparse),
keep the `reduce.ratio` largest coefficients per chunk (bfloat16 value + in-chunk position in one
uint32: `compress.sparse_sum`), all-gather them, and remove what was sent from δ (error feedback:
δ keeps exactly what it did not send). Every replica decodes the sum with the inverse DCT; the update
is its sign, applied with the LR schedule and decoupled weight decay (`optimizer`) — no Adam, and no
dense warm-up, so the run-average bytes equal the steady state.

State: δ per replica under a leading `dp` axis, sharded like the parameters (checkpointed with the
train state; restoring onto another dp size is refused by `explicit.check_replica_count`).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxdist.config import Config
from jaxdist.models.moe import metrics_from_sums
from jaxdist.models.resolve import ResolvedModel
from jaxdist.optim.adamw import schedule
from jaxdist.parallel import context
from jaxdist.parallel.loss import ApplyFn
from jaxdist.reduce import compress
from jaxdist.reduce.explicit import per_replica_apply
from jaxdist.reduce.gradients import GradientStage, accumulate_with_stats


class DemoState(NamedTuple):
    delta: Any  # this replica's momentum not yet sent (float32, shaped like the parameters)


def dct_matrix(n: int) -> np.ndarray:
    """Orthonormal DCT-II (rows = frequencies): D @ x is scipy.fft.dct(x, norm='ortho'); D.T inverts."""
    k, i = np.arange(n)[:, None], np.arange(n)[None, :]
    d = np.sqrt(2.0 / n) * np.cos(np.pi * (i + 0.5) * k / n)
    d[0] /= np.sqrt(2.0)
    return d.astype(np.float32)


def side(n: int, target: int) -> int:
    """The largest divisor of n that is at most target: chunk sides tile the tensor exactly."""
    return max(d for d in range(1, min(n, target) + 1) if n % d == 0)


def layout(shape, batch_dims: int, target: int) -> tuple[int, int, int, int, int]:
    """(batch, rows, cols, h, w): the tensor as a batch of matrices (compress.matrix_view), tiled
    by h x w chunks."""
    batch, rows, cols = compress.matrix_view(shape, batch_dims)
    return batch, rows, cols, side(rows, target), side(cols, target)


def encode(x, lay):
    """Tensor -> (chunks, h·w) DCT coefficients of its h x w tiles."""
    batch, rows, cols, h, w = lay
    tiles = x.reshape(batch, rows // h, h, cols // w, w).astype(jnp.float32)
    coeffs = jnp.einsum("brhcw,Hh,Ww->brcHW", tiles, dct_matrix(h), dct_matrix(w))
    return coeffs.reshape(-1, h * w)


def decode(c_CE, shape, lay):
    batch, rows, cols, h, w = lay
    coeffs = c_CE.reshape(batch, rows // h, cols // w, h, w)
    return jnp.einsum("brcHW,Hh,Ww->brhcw", coeffs, dct_matrix(h), dct_matrix(w)).reshape(shape)


def kept(lay, ratio: float) -> tuple[int, int]:
    """(chunks, k): coefficients kept per chunk."""
    batch, rows, cols, h, w = lay
    return batch * (rows // h) * (cols // w), max(1, math.ceil(ratio * h * w))


def sparse_dct_sum(x, batch_dims: int, ratio: float, target: int, axis):
    """(total, sent): the sum over `axis` of every replica's top coefficients, decoded, and this
    replica's own share (decoded, bfloat16-rounded coefficients): x − sent is what it keeps."""
    lay = layout(x.shape, batch_dims, target)
    total, sent, _ = compress.sparse_sum(encode(x, lay), kept(lay, ratio)[1], axis)
    return decode(total, x.shape, lay), decode(sent, x.shape, lay)


def bytes_sent(shape, batch_dims: int, ratio: float, target: int, n: int) -> float:
    return compress.sparse_bytes(*kept(layout(shape, batch_dims, target), ratio), n)


def optimizer(cfg: Config, lr_schedule, decay_mask_tree) -> optax.GradientTransformation:
    """What the train step applies to the stage's sign update: decoupled weight decay and the LR."""
    return optax.chain(
        optax.add_decayed_weights(cfg.optim.weight_decay, decay_mask_tree), optax.scale_by_learning_rate(lr_schedule)
    )


def replica_update(cfg: Config, batch_dims_tree, lr_schedule):
    """`update(local_mean_grads, δ, step) -> (sign of the sum over replicas, new δ)`, run by every
    replica inside the manual shard_map."""
    r, clip = cfg.reduce, cfg.optim.clip_norm
    bdims = jax.tree.leaves(batch_dims_tree)

    def update(grads, delta, step):
        if clip > 0:  # local clipping: one replica's outlier batch cannot dominate its momentum
            grads = optax.clip_by_global_norm(clip).update(grads, optax.EmptyState())[0]
        x = jax.tree.map(lambda d, g: r.demo.momentum_decay * d + lr_schedule(step) * g, delta, grads)
        leaves, treedef = jax.tree.flatten(x)
        pairs = [sparse_dct_sum(v, b, r.ratio, r.demo.chunk, r.axis) for v, b in zip(leaves, bdims)]
        total = treedef.unflatten([jnp.sign(t) for t, _ in pairs])
        return total, jax.tree.map(jnp.subtract, x, treedef.unflatten([s for _, s in pairs]))

    return update


def demo_gradients(apply_fn: ApplyFn, cfg: Config, mesh: Mesh, model: ResolvedModel) -> GradientStage:
    axis = cfg.reduce.axis
    replicas, order_T = mesh.shape[axis], context.sequence_order(cfg, mesh)  # cp > 1: load-balanced order
    lr = schedule(cfg.optim, cfg.optim.schedule_steps or cfg.train.steps, cfg.train.global_batch)
    update = replica_update(cfg, model.stacked_dims, lr)

    def per_replica(params, tokens, state, step):
        grads, loss, count, stats = accumulate_with_stats(apply_fn, params, tokens, cfg.train.grad_accum_steps, order_T)
        local = jax.tree.map(lambda g: g / count, grads)  # this replica's mean gradient
        # the logged loss (every replica's tokens) and the replicas' own gradient norms, in one psum
        total = jax.lax.psum(jnp.stack([loss, count, optax.tree.norm(local, squared=True)]), axis)
        direction, delta = update(local, jax.tree.map(lambda d: d[0], state.delta), step)
        extra = metrics_from_sums(jax.lax.psum(stats, axis), total[1])
        # grad_norm: the RMS of the replicas' own (unclipped) gradient norms, not the sign update's
        # norm; the mean gradient's own norm would need the dense all-reduce DeMo avoids.
        extra["grad_norm"] = jnp.sqrt(total[2] / replicas)
        return direction, total[0] / total[1], DemoState(jax.tree.map(lambda d: d[None], delta)), extra

    apply = per_replica_apply(per_replica, mesh, axis)

    def init(params):
        return DemoState(jax.tree.map(lambda p: jnp.zeros((replicas,) + p.shape, jnp.float32), params))

    def state_specs(param_specs):
        return DemoState(jax.tree.map(lambda s: P(axis, *s), param_specs, is_leaf=lambda x: isinstance(x, P)))

    return GradientStage(init=init, apply=apply, state_specs=state_specs, name="explicit-demo")
