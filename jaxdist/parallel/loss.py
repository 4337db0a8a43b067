"""Next-token cross-entropy over the output head: `naive` (full logits) or `blockwise` (never B·T·V).

naive: logits = x @ W (float32, B·T·V), one-hot labels, softmax cross-entropy — the simple reference.

blockwise (Levanter's blockwise cross-entropy, MaxText's vocabulary tiling, Rabe & Staats' online
log-sum-exp): the head W (D, V) is viewed as (D, S, nb, vb) — S vocab shards (the mesh axes of the
`vocab` rule, tp by default), nb blocks of vb rows per shard. A scan takes one block (D, S, vb) at a
time, i.e. vb rows from every shard, so each device only ever holds its vocab shard of a block. Per
token the scan keeps a running max and sum of exponentials and the target's logit (a masked
reduction: no gather over a sharded vocab). The head is cast to the compute dtype while still
fsdp-sharded and all-gathered a chunk of blocks at a time (`model.loss_gather_mib` per device, 256
MiB: the whole 8B head in 4 collectives per pass instead of one per block). A custom VJP saves the
log-sum-exp per token and, when they fit `model.loss_keep_mib` per device (512 MiB), the forward's
logits in the compute dtype (the bf16 matmul's own values under bf16). With them kept, the forward also
computes each token's input gradient (below) and the backward turns each kept block of logits into that
block's head gradient (sharded like W) without the head: the head is gathered once per step, and three
matmuls over the vocabulary run per step (forward logits, input gradient, weight gradient), the naive
loss's count. Logits that do not fit are recomputed block by block in the backward, which gathers the
head again (a fourth matmul; working set: a few (tokens, vb) blocks).

The input gradient in the forward (as fused linear cross-entropy kernels do): per token and vocab shard
the scan keeps sum_v exp(z_v - m) · W[:, v], rescaled by exp(m_old - m_new) as the running max m moves
(as the sum of exponentials is), and the target's row W[:, target] taken from its gathered block; after
the scan, softmax · W - W[:, target] is that sum times exp(m - lse), minus the row. The cotangent of each
token's loss is a per-token scale, applied in the backward. The head's gradient cannot be built this
way (it sums over tokens, each with its own rescaling factor), so it waits for the final log-sum-exp
and is made in the backward from the kept logits; Liger instead chunks the tokens and keeps the whole
head's unreduced gradient (D x V float32 per device, 2.1 GB for Llama 3 8B).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import optax

from jaxdist.distributed.sharding import constrain, current_rules, use_rules
from jaxdist.parallel import context, matmul
from jaxdist.parallel.loss_blocks import (
    Plan,
    batch_shards,
    block_logits,
    block_rows,
    dot,
    head_blocks,
    plan_for,
    scan_blocks,
    target_mask,
    token_rules,
    vocab_shards,
)

IMPLS = ("blockwise", "naive")


@dataclasses.dataclass(frozen=True)
class Head:
    """What the loss needs from the model instead of logits: final-normed hidden states (compute
    dtype), the head weight (D, V) (float32 master) and how to apply it."""

    x_BTD: jax.Array
    w_DV: jax.Array
    impl: str = "blockwise"
    block: int = 0  # vocab rows per block on each device (of its V/S shard); 0 = from the shapes
    gather_mib: int = 256  # blocks all-gathered together: at most this many MiB of head per device
    keep_mib: int = 512  # the forward's logits kept for the backward when they fit this per device


jax.tree_util.register_dataclass(
    Head, data_fields=["x_BTD", "w_DV"], meta_fields=["impl", "block", "gather_mib", "keep_mib"]
)


class ApplyFn(Protocol):
    """The model's training forward, as the gradient stages and objectives call it: `(params, tokens_BT)
    -> (Head, aux)`, aux the MoE layers' load-balance sums (an empty dict for a dense model). Made by
    `jaxdist.training.step.model_apply` (the model's `loss_head`) or, with pp > 1,
    `jaxdist.parallel.pipeline.pipelined_apply` (a `PipelinedApply`)."""

    def __call__(self, params: Any, tokens_BT: jax.Array, /) -> tuple[Head, dict]: ...


def logits(head: Head) -> jax.Array:
    """Full float32 logits (B, T, V) — for generation, evaluation and the naive loss."""
    x, w = head.x_BTD, head.w_DV
    if context.splits_sequence():  # (batch, seq/cp) does not flatten locally: keep both token dims
        out = jnp.einsum("btd,dv->btv", x, w.astype(x.dtype))
    else:
        out = (x.reshape(-1, x.shape[-1]) @ w.astype(x.dtype)).reshape(*x.shape[:-1], w.shape[-1])
    return constrain(out.astype(jnp.float32), ("batch", "seq", "vocab"))


def cross_entropy(head: Head, targets_BT) -> jax.Array:
    """Per-token cross-entropy (B, T), float32."""
    if head.impl == "naive":
        logits_BTV = logits(head)
        # One-hot labels, not a gather: the vocab dim stays tp-sharded (a reduction across shards).
        labels_BTV = jax.nn.one_hot(targets_BT, logits_BTV.shape[-1], dtype=logits_BTV.dtype)
        return optax.softmax_cross_entropy(logits_BTV, labels_BTV)
    B, T, D = head.x_BTD.shape
    rules = token_rules(current_rules())
    shards = vocab_shards(rules)
    tokens = B * T // batch_shards(rules)
    vb = block_rows(head.w_DV.shape[1], shards, tokens, D, head.block)
    nb = head.w_DV.shape[1] // (shards * vb)
    plan = plan_for(tokens, vb, nb, D, head.x_BTD.dtype, head.gather_mib, head.keep_mib)
    losses = _blockwise(
        head.x_BTD.reshape(B * T, D), head.w_DV, targets_BT.reshape(B * T).astype(jnp.int32), shards, vb, rules, plan
    )
    return losses.reshape(B, T)


def _forward(x_ND, w_DV, targets_N, shards, vb, plan: Plan, input_grad: bool = False):
    """Losses (N,), log-sum-exps (N,), the blocks' logits (nb, N, S, vb) in the compute dtype if
    `plan.keep_logits` (else None) and, if `input_grad`, each loss's gradient with respect to its
    token's hidden state (N, D) float32 (else None). Statistics are kept per vocab shard (N, S) and
    combined once after the scan: one small all-reduce over tp instead of one per block.

    The input gradient sum_v softmax_v · W[:, v] - W[:, target] is accumulated as the logits are: per
    token and shard, sum_v exp(z_v - m) · W[:, v] rescaled by exp(m_old - m_new) as the running max
    moves (as the sum of exponentials is), and each token's target row taken from its gathered block;
    so the backward needs no gathered head (the head is gathered once per step)."""
    w_blocks = head_blocks(w_DV, shards, vb)
    nb = w_blocks.shape[2]
    N, D = x_ND.shape

    def body(carry, j_w):
        (m, s, tgt, acc, _), (j, w, _) = carry, j_w
        z = block_logits(x_ND, w)
        m_new = jnp.maximum(m, z.max(axis=2))
        scale = jnp.exp(m - m_new)
        e = jnp.exp(z - m_new[:, :, None])
        s = s * scale + e.sum(axis=2)
        tgt = tgt + jnp.where(target_mask(targets_N, j, z.shape, nb), z, 0.0).sum(axis=2)
        rows = carry[4]
        if input_grad:
            acc = acc * scale[:, :, None] + dot("nsv,dsv->nsd", e.astype(x_ND.dtype), w)
            acc = constrain(acc, ("batch", "vocab", None))
            rows = rows + target_rows(j, w)
        # kept in the compute dtype: a bf16 matmul's logits are bf16 values, so nothing is lost (half the bytes)
        return (m_new, s, tgt, acc, rows), (_to_bits(z.astype(x_ND.dtype)) if plan.keep_logits else None)

    def target_rows(j, w):
        """The target rows W[:, target] (N, S, D) of the tokens whose target lies in block j, else 0 (a
        local gather from the block's gathered copy, on the token's vocab shard)."""
        s_y, r = targets_N // (nb * vb), targets_N % (nb * vb)
        rows = jnp.take(w, r % vb, axis=2)  # (D, S, N)
        rows = constrain(jnp.transpose(rows, (2, 1, 0)).astype(jnp.float32), ("batch", "vocab", None))
        s_iota = jax.lax.broadcasted_iota(jnp.int32, (N, shards), 1)
        hit = ((r // vb) == j)[:, None] & (s_iota == s_y[:, None])
        return jnp.where(hit[:, :, None], rows, 0.0)

    stat = lambda v: constrain(jnp.full((N, shards), v, jnp.float32), ("batch", "vocab"))
    vec = lambda: constrain(
        jnp.zeros((N, shards, D) if input_grad else (), jnp.float32), ("batch", "vocab", None) if input_grad else ()
    )
    init = (stat(-jnp.inf), stat(0.0), stat(0.0), vec(), vec())
    (m, s, tgt, acc, rows), zs = scan_blocks(w_blocks, x_ND.dtype, plan.chunk, body, init, None)
    top = m.max(axis=1)
    lse = top + jnp.log((s * jnp.exp(m - top[:, None])).sum(axis=1))
    dx = None
    if input_grad:  # softmax_v = exp(z_v - m_s) · exp(m_s - lse) on shard s: one tp all-reduce of (N, D)
        dx = ((acc * jnp.exp(m - lse[:, None])[:, :, None]) - rows).sum(axis=1)
    return lse - tgt.sum(axis=1), lse, zs, dx


def _to_bits(z):
    """16-bit logits kept as their bits (uint16): XLA:CPU runs a bf16 stack's slicing in float32 and
    converts the whole kept stack to float32 around the loops (two float32 copies of it in temp); the
    integer stack it slices as is. Any other dtype as is."""
    return jax.lax.bitcast_convert_type(z, jnp.uint16) if jnp.dtype(z.dtype).itemsize == 2 else z


def _from_bits(z, dtype):
    return jax.lax.bitcast_convert_type(z, dtype) if z.dtype == jnp.uint16 else z


def _blockwise(x_ND, w_DV, targets_N, shards, vb, rules, plan: Plan):
    """The blockwise loss under `rules` (the token rules): set inside the forward and the backward,
    which JAX traces later, outside the caller's `use_rules`. With the logits kept, the forward also
    computes the input gradient and the backward only the head's (from the kept logits: no head
    gathered); else the backward gathers the head again to recompute the logits."""
    keep = plan.keep_logits
    w_shape, w_dtype = w_DV.shape, w_DV.dtype

    @jax.custom_vjp
    def f(x, w, t):
        with use_rules(rules):
            return _forward(x, w, t, shards, vb, dataclasses.replace(plan, keep_logits=False))[0]

    def fwd(x, w, t):
        with use_rules(rules):
            losses, lse, zs, dx = _forward(x, w, t, shards, vb, plan, input_grad=keep)
        return losses, (x, None if keep else w, t, lse, zs, dx)

    def bwd(res, g_N):
        with use_rules(rules):
            if keep:
                return _head_grad(res, g_N, shards, vb, w_shape, w_dtype)
            return _backward(res[:5], g_N, shards, vb, plan.chunk)

    f.defvjp(fwd, bwd)
    return f(x_ND, w_DV, targets_N)


def _head_grad(res, g_N, shards, vb, w_shape, w_dtype):
    """The backward when the forward kept the logits and computed the input gradient: each block's
    softmax gradient from its kept logits and the saved log-sum-exps gives that block's head gradient;
    the input gradient is the forward's scaled by each token's cotangent. No head, no gather."""
    x, _, t, lse, zs, dx_ND = res
    dw_blocks = head_blocks(jnp.zeros(w_shape, w_dtype), shards, vb)
    nb = dw_blocks.shape[2]

    def body(dw_blocks, j_z):
        j, z = j_z
        z = _from_bits(z, x.dtype).astype(jnp.float32)
        p = jnp.exp(z - lse[:, None, None])
        dz = ((p - target_mask(t, j, z.shape, nb)) * g_N[:, None, None]).astype(x.dtype)
        dw = matmul.weight_grad(
            x,
            dz.reshape(dz.shape[0], -1),
            (((0,), (0,)), ((), ())),
            dw_blocks.shape[:2] + (vb,),
            ("embed", "vocab", None),
        )
        return jax.lax.dynamic_update_index_in_dim(dw_blocks, dw.astype(dw_blocks.dtype), j, axis=2), None

    dw_blocks, _ = jax.lax.scan(body, dw_blocks, (jnp.arange(nb), zs))
    return (g_N[:, None] * dx_ND).astype(x.dtype), dw_blocks.reshape(w_shape), None


def _backward(res, g_N, shards, vb, chunk: int):
    """Each block's softmax gradient from its logits (kept by the forward, else recomputed) and the
    saved log-sum-exps: gradients of x and of the weight."""
    x, w_DV, t, lse, zs = res
    w_blocks = head_blocks(w_DV, shards, vb)
    nb = w_blocks.shape[2]

    def body(carry, j_w_z):
        (dx, dw_blocks), (j, w, z) = carry, j_w_z
        z = block_logits(x, w) if z is None else z.astype(jnp.float32)
        p = jnp.exp(z - lse[:, None, None])
        dz = ((p - target_mask(t, j, z.shape, nb)) * g_N[:, None, None]).astype(x.dtype)
        # Per vocab shard (N, S, D), summed once after the scan: one tp all-reduce, not one per block.
        dx = dx + dot("nsv,dsv->nsd", dz, w)
        # The weight gradient leaves its matmul in float32 (or bf16 under reduce.dtype=bfloat16), the
        # dtype its reduction over the batch runs in.
        dw = matmul.weight_grad(
            x, dz.reshape(dz.shape[0], -1), (((0,), (0,)), ((), ())), w.shape, ("embed", "vocab", None)
        )
        # Written in place into the gradient (sharded like W): no stack of blocks to transpose.
        dw_blocks = jax.lax.dynamic_update_index_in_dim(dw_blocks, dw.astype(dw_blocks.dtype), j, axis=2)
        return (dx, dw_blocks), None

    dx0 = constrain(jnp.zeros((x.shape[0], shards, x.shape[1]), jnp.float32), ("batch", "vocab", None))
    (dx, dw_blocks), _ = scan_blocks(w_blocks, x.dtype, chunk, body, (dx0, jnp.zeros_like(w_blocks)), zs)
    return dx.sum(axis=1).astype(x.dtype), dw_blocks.reshape(w_DV.shape), None
