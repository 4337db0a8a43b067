"""Next-token cross-entropy over the output head: `naive` (full logits) or `blockwise` (never B·T·V).

naive: logits = x @ W (float32, B·T·V), one-hot labels, softmax cross-entropy — the simple reference.

blockwise (Levanter's blockwise cross-entropy, MaxText's vocabulary tiling, Rabe & Staats' online
log-sum-exp): the head W (D, V) is viewed as (D, S, nb, vb) — S vocab shards (the mesh axes of the
`vocab` rule, tp by default), nb blocks of vb rows per shard. A scan takes one block (D, S, vb) at a
time, i.e. vb rows from every shard, so each device only ever holds its vocab shard of a block; the
block is cast to the compute dtype while still fsdp-sharded, so FSDP gathers one (bf16) block at a
time. Per token the scan keeps a running max and sum of exponentials and the target's logit (a masked
reduction: no gather over a sharded vocab). A custom VJP saves only the log-sum-exp per token; its
backward scans the blocks again, recomputes each block's logits and emits that block's head gradient
(sharded like W) and its share of the input gradient. Working set: a few (tokens, vb) blocks.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax

from jaxdist.errors import JaxdistError
from jaxdist.sharding import Rules, constrain

IMPLS = ("blockwise", "naive")
BLOCK_BYTES = 32 * 2**20  # auto block: float32 logits of one block per device stay under this


@dataclasses.dataclass(frozen=True)
class Head:
    """What the loss needs from the model instead of logits: final-normed hidden states (compute
    dtype), the head weight (D, V) (float32 master) and how to apply it."""
    x_BTD: jax.Array
    w_DV: jax.Array
    impl: str = "blockwise"
    block: int = 0  # vocab rows per block on each device (of its V/S shard); 0 = from the shapes
    rules: tuple | None = None


jax.tree_util.register_dataclass(Head, data_fields=["x_BTD", "w_DV"], meta_fields=["impl", "block", "rules"])


def logits(head: Head) -> jax.Array:
    """Full float32 logits (B, T, V) — for generation, evaluation and the naive loss."""
    x, w = head.x_BTD, head.w_DV
    out = (x.reshape(-1, x.shape[-1]) @ w.astype(x.dtype)).reshape(*x.shape[:-1], w.shape[-1])
    return constrain(out.astype(jnp.float32), ("batch", "seq", "vocab"), head.rules)


def cross_entropy(head: Head, targets_BT) -> jax.Array:
    """Per-token cross-entropy (B, T), float32."""
    if head.impl == "naive":
        logits_BTV = logits(head)
        # One-hot labels, not a gather: the vocab dim stays tp-sharded (a reduction across shards).
        labels_BTV = jax.nn.one_hot(targets_BT, logits_BTV.shape[-1], dtype=logits_BTV.dtype)
        return optax.softmax_cross_entropy(logits_BTV, labels_BTV)
    B, T, D = head.x_BTD.shape
    shards = vocab_shards(head.rules)
    vb = block_rows(head.w_DV.shape[1], shards, B * T // batch_shards(head.rules), head.block)
    losses = _blockwise(head.x_BTD.reshape(B * T, D), head.w_DV, targets_BT.reshape(B * T).astype(jnp.int32),
                        shards, vb, head.rules)
    return losses.reshape(B, T)


def _mesh_size(rules, name: str) -> int:
    """Devices the logical axis `name` is split over here (manual axes of an enclosing shard_map excluded)."""
    mesh = jax.sharding.get_abstract_mesh()
    if rules is None or mesh.empty:
        return 1
    return math.prod(mesh.shape[a] for a in dict(rules)[name] if a not in mesh.manual_axes)


def vocab_shards(rules) -> int:
    return _mesh_size(rules, "vocab")


def batch_shards(rules) -> int:
    return _mesh_size(rules, "batch")


def block_rows(vocab: int, shards: int, tokens: int, block: int = 0) -> int:
    """Vocab rows per block on each device: `block` if given (it must divide V / shards), else the
    largest divisor of V / shards whose float32 logits for `tokens` tokens stay under BLOCK_BYTES."""
    local = vocab // shards
    if block:
        if local % block:
            raise JaxdistError(f"model.loss_block={block} must divide the vocab rows per device, "
                               f"model.vocab_size={vocab} / {shards} vocab shards = {local}; "
                               f"use a divisor of {local} or 0 (automatic)")
        return block
    limit = max(1, BLOCK_BYTES // (4 * max(tokens, 1)))
    return max(d for d in range(1, min(local, limit) + 1) if local % d == 0)


def _blocks(w_DV, shards: int, vb: int, rules):
    """(D, V) -> (nb, D, S, vb): block j holds rows s·V/S + j·vb + k of every shard s."""
    D, V = w_DV.shape
    w = w_DV.reshape(D, shards, V // (shards * vb), vb).transpose(2, 0, 1, 3)
    return constrain(w, (None, "embed", "vocab", None), rules)


def _unblock(w_nDSv):
    nb, D, S, vb = w_nDSv.shape
    return w_nDSv.transpose(1, 2, 0, 3).reshape(D, S * nb * vb)


def _block_logits(x_ND, w_DSv, rules):
    """One block's float32 logits (N, S, vb); its weight is cast while still sharded (bf16 gather)."""
    w = constrain(w_DSv.astype(x_ND.dtype), ("embed", "vocab", None), rules)
    out = jnp.einsum("nd,dsv->nsv", x_ND, w, preferred_element_type=jnp.float32)
    return constrain(out, ("batch", "vocab", None), rules)


def _target_mask(targets_N, j, shape, nb: int):
    """Where block j's logits (N, S, vb) hold each token's target (all False for a target elsewhere)."""
    _, S, vb = shape
    s_y, r = targets_N // (nb * vb), targets_N % (nb * vb)
    hit_N = (r // vb == j)
    s_iota = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    v_iota = jax.lax.broadcasted_iota(jnp.int32, shape, 2)
    return hit_N[:, None, None] & (s_iota == s_y[:, None, None]) & (v_iota == (r % vb)[:, None, None])


def _forward(x_ND, w_DV, targets_N, shards, vb, rules):
    w_blocks = _blocks(w_DV, shards, vb, rules)
    nb = w_blocks.shape[0]
    N = x_ND.shape[0]

    def body(carry, jw):
        m, s, tgt = carry
        j, w = jw
        z = _block_logits(x_ND, w, rules)
        m_new = jnp.maximum(m, z.max(axis=(1, 2)))
        s = s * jnp.exp(m - m_new) + jnp.exp(z - m_new[:, None, None]).sum(axis=(1, 2))
        tgt = tgt + jnp.where(_target_mask(targets_N, j, z.shape, nb), z, 0.0).sum(axis=(1, 2))
        return (m_new, s, tgt), None

    init = (jnp.full((N,), -jnp.inf, jnp.float32), jnp.zeros((N,), jnp.float32), jnp.zeros((N,), jnp.float32))
    (m, s, tgt), _ = jax.lax.scan(body, init, (jnp.arange(nb), w_blocks))
    lse = m + jnp.log(s)
    return lse - tgt, lse


def _blockwise(x_ND, w_DV, targets_N, shards, vb, rules):
    @jax.custom_vjp
    def f(x, w, t):
        return _forward(x, w, t, shards, vb, rules)[0]

    def fwd(x, w, t):
        losses, lse = _forward(x, w, t, shards, vb, rules)
        return losses, (x, w, t, lse)

    def bwd(res, g_N):
        x, w_DV, t, lse = res
        w_blocks = _blocks(w_DV, shards, vb, rules)
        nb = w_blocks.shape[0]

        def body(dx, jw):
            j, w = jw
            z = _block_logits(x, w, rules)
            p = jnp.exp(z - lse[:, None, None])
            dz = ((p - _target_mask(t, j, z.shape, nb)) * g_N[:, None, None]).astype(x.dtype)
            wc = constrain(w.astype(x.dtype), ("embed", "vocab", None), rules)
            dx = dx + jnp.einsum("nsv,dsv->nd", dz, wc, preferred_element_type=jnp.float32)
            dw = jnp.einsum("nd,nsv->dsv", x, dz, preferred_element_type=jnp.float32)
            return dx, constrain(dw, ("embed", "vocab", None), rules)

        dx, dw_blocks = jax.lax.scan(body, jnp.zeros(x.shape, jnp.float32), (jnp.arange(nb), w_blocks))
        return dx.astype(x.dtype), _unblock(dw_blocks).astype(w_DV.dtype), None

    f.defvjp(fwd, bwd)
    return f(x_ND, w_DV, targets_N)
