"""Context parallelism over the `cp` mesh axis: one sequence's activations split over devices.

Layout (load-balanced causal sharding, as in Llama 3 and zigzag ring attention): the T positions are
cut into 2·cp chunks of c = T / (2 cp) and device i holds chunks i and 2cp-1-i, so under the causal
mask every device has the same number of unmasked (query, key) pairs. The step applies the reorder
(`order`) to the token ids — inputs and targets alike, so the token-weighted loss sum is unchanged —
before the embedding; the ids are replicated over cp, so the reorder is a local gather with no
communication, and the activations are then sharded `seq -> cp` contiguously. The model receives the
reordered positions for RoPE. Nothing is ever put back in order: the loss does not care.

Attention runs in a `shard_map` manual over the axes of batch, seq and heads (dp/fsdp, cp, tp):
- allgather: all-gather K and V over cp; local queries attend to the whole sequence (Llama 3).
  Per layer each device sends 2·(cp-1)/cp·B·T·K·H elements forward.
- ring: K/V blocks travel around the ring by `ppermute` while an online softmax merges each block into
  the local queries' output (flash-attention style). The next block's transfer is issued before this
  block's compute, so the two can overlap. A custom VJP runs the ring again backward, with dK/dV
  travelling beside their blocks: no device holds all of K/V, not even in saved residuals. With the
  load-balanced layout, after the local step the visiting block is either entirely before both local
  chunks (all queries x its first half) or the second local chunk sees all of it: each device
  computes half a block per step, the same on every device.
- ulysses (DeepSpeed Ulysses): all-to-all from sequence-sharded to head-sharded, full-sequence
  attention on N/cp heads, all-to-all back. Needs kv heads (per tp shard) divisible by cp.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist.distributed import sharding
from jaxdist.errors import JaxdistError

AXIS = "cp"
IMPLS = ("allgather", "ring", "ulysses")
NEG = -1e30  # masked score: finite, so a fully masked block row never makes NaN


# ---- layout ----------------------------------------------------------------------------------------


def order(seq_len: int, cp: int) -> np.ndarray:
    """Positions in the load-balanced layout: device i's shard (contiguous after the reorder) holds
    chunks i and 2cp-1-i. order(8, 2) = [0 1 6 7 2 3 4 5]."""
    c = seq_len // (2 * cp)
    chunks = [k for i in range(cp) for k in (i, 2 * cp - 1 - i)]
    return np.concatenate([np.arange(k * c, (k + 1) * c) for k in chunks])


def inverse(perm: np.ndarray) -> np.ndarray:
    """x[..., perm][..., inverse(perm)] == x."""
    return np.argsort(perm)


def reorder(x, perm, axis: int = 1):
    """Take positions `perm` along `axis` (a static gather)."""
    return jnp.take(x, jnp.asarray(perm), axis=axis)


def size(mesh) -> int:
    return dict(mesh.shape).get(AXIS, 1)


def check(cfg, mesh, rules) -> None:
    """One-line errors for what context parallelism cannot do on this (config, mesh)."""
    cp, m = size(mesh), cfg.model
    if cp == 1:
        return
    if tuple(rules["seq"]) != (AXIS,):
        raise JaxdistError(f"cp={cp} needs mesh.rules.seq=[cp] (got {list(rules['seq'])}); remove the seq override")
    for name in ("batch", "heads", "kv_heads", "mlp", "vocab"):
        if AXIS in rules[name]:
            raise JaxdistError(
                f"mesh.rules.{name} uses 'cp', which shards the sequence of activations; "
                "only parameter axes (e.g. mesh.rules.embed=[fsdp, cp]) may add cp"
            )
    if m.sliding_window:
        raise JaxdistError(
            f"model.sliding_window={m.sliding_window} with cp={cp} is not supported (the ring/all-gather "
            "attention has no banded mask); use cp=1 (dp/fsdp/tp/pp/ep all work with a window)"
        )
    if cfg.data.document_mask:
        raise JaxdistError(
            f"data.document_mask=true with cp={cp} is not supported (segment masks are not split "
            "over sequence shards); use cp=1 or data.document_mask=false"
        )
    pp = dict(mesh.shape).get("pp", 1)
    if pp > 1:  # checked here: Shardy rejects the cp shard_map nested in the pipeline's (jax 0.10.2)
        raise JaxdistError(
            f"cp={cp} with pp={pp} is not supported (XLA rejects the attention's cp shard_map "
            "inside a pipeline stage); use cp with dp/fsdp/tp, or pp without cp"
        )
    if m.seq_len % (2 * cp):
        raise JaxdistError(
            f"model.seq_len={m.seq_len} must be divisible by 2*cp={2 * cp} (two chunks per "
            f"device for the load-balanced causal layout); choose a seq_len multiple of {2 * cp}"
        )
    if m.context_impl == "ulysses":
        tp = dict(mesh.shape).get("tp", 1)
        if (m.num_kv_heads // tp) % cp or (m.num_heads // tp) % cp:
            raise JaxdistError(
                f"model.context_impl=ulysses splits heads over cp={cp}, but model.num_kv_heads="
                f"{m.num_kv_heads} / tp={tp} is not divisible by it; use context_impl=ring or allgather"
            )


def sequence_order(cfg, mesh) -> np.ndarray | None:
    """The positions the step feeds the model (load-balanced order), or None when cp = 1."""
    return order(cfg.model.seq_len, size(mesh)) if size(mesh) > 1 else None


def splits_sequence() -> bool:
    """Inside a mesh with cp > 1 (`check` has made sure the sequence is what cp splits)."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and size(mesh) > 1


def active() -> bool:
    """Inside a mesh whose cp axis shards the sequence under the current logical rules."""
    mesh, rules = jax.sharding.get_abstract_mesh(), sharding.current_rules()
    return rules is not None and not mesh.empty and size(mesh) > 1 and tuple(rules.get("seq", ())) == (AXIS,)


# ---- attention -------------------------------------------------------------------------------------


def attention(q_BTNH, k_BTKH, v_BTKH, impl: str):
    """Causal grouped-query attention of sequence-sharded q, k, v (global arrays, seq in `order`).
    Manual over every axis that shards them (batch, cp, heads): left automatic, XLA replicates the
    batch and head dims inside the shard_map (seen with fsdp and tp > 1)."""
    mesh, rules = jax.sharding.get_abstract_mesh(), sharding.current_rules()
    if rules is None:
        raise RuntimeError("context-parallel attention is traced under sharding rules (sharding.activate)")
    manual = set(mesh.manual_axes)  # e.g. dp, inside the explicit data-parallel reduction
    q_spec = sharding.drop_axes(sharding.logical_to_spec(("batch", "seq", "heads", None), rules), manual)
    kv_spec = sharding.drop_axes(sharding.logical_to_spec(("batch", "seq", "kv_heads", None), rules), manual)
    axes = {a for spec in (q_spec, kv_spec) for e in spec for a in ((e,) if isinstance(e, str) else e or ())}
    local = {"allgather": _allgather, "ring": _ring, "ulysses": _ulysses}[impl]
    return jax.shard_map(
        functools.partial(local, cp=size(mesh)), in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec, axis_names=axes
    )(q_BTNH, k_BTKH, v_BTKH)


def local_positions(chunk: int, cp: int):
    """Positions of this device's 2 chunks (inside the shard_map)."""
    i = jax.lax.axis_index(AXIS)
    ar = jnp.arange(chunk)
    return jnp.concatenate([i * chunk + ar, (2 * cp - 1 - i) * chunk + ar])


def _allgather(q, k, v, cp):
    k_all = jax.lax.all_gather(k, AXIS, axis=1, tiled=True)  # (B, T, K, H), in `order`
    v_all = jax.lax.all_gather(v, AXIS, axis=1, tiled=True)
    pq = local_positions(q.shape[1] // 2, cp)
    pk = jnp.asarray(order(k_all.shape[1], cp))
    return jax.nn.dot_product_attention(q, k_all, v_all, mask=(pq[:, None] >= pk[None, :])[None, None])


def _ulysses(q, k, v, cp):
    # seq-sharded, all heads -> full sequence, heads/cp; grouped heads stay together (N = K G).
    to_heads = lambda x: jax.lax.all_to_all(x, AXIS, split_axis=2, concat_axis=1, tiled=True)
    qh, kh, vh = to_heads(q), to_heads(k), to_heads(v)
    pos = jnp.asarray(order(qh.shape[1], cp))
    o = jax.nn.dot_product_attention(qh, kh, vh, mask=(pos[:, None] >= pos[None, :])[None, None])
    return jax.lax.all_to_all(o, AXIS, split_axis=1, concat_axis=2, tiled=True)


# ---- ring attention: blocks in (B, K, G, T, H) layout, statistics in float32 ------------------------


def _groups(q, kv_heads):
    B, T, N, H = q.shape
    return q.reshape(B, T, kv_heads, N // kv_heads, H).transpose(0, 2, 3, 1, 4)  # (B, K, G, T, H)


def _scores(q, k, mask):
    s = jnp.einsum("bkgqh,bskh->bkgqs", q, k, preferred_element_type=jnp.float32) / np.sqrt(q.shape[-1])
    return s if mask is None else jnp.where(mask, s, NEG)


def _merge(acc, q, k, v, mask):
    """Online softmax: fold one key block into (o, m, l) of queries q."""
    o, m, l = acc
    s = _scores(q, k, mask)
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.exp(s - m_new[..., None])
    corr = jnp.exp(m - m_new)
    o = o * corr[..., None] + jnp.einsum("bkgqs,bskh->bkgqh", p, v.astype(jnp.float32))
    return o, m_new, l * corr + p.sum(-1)


def _block_grads(q, k, v, do, lse, delta, mask):
    """dq, dk, dv of one (query block, key block) pair, given the softmax statistics."""
    s = _scores(q, k, mask)
    p = jnp.exp(s - lse[..., None])
    dv = jnp.einsum("bkgqs,bkgqh->bskh", p, do)
    dp = jnp.einsum("bkgqh,bskh->bkgqs", do, v.astype(jnp.float32))
    ds = p * (dp - delta[..., None]) / np.sqrt(q.shape[-1])
    dq = jnp.einsum("bkgqs,bskh->bkgqh", ds, k.astype(jnp.float32))
    dk = jnp.einsum("bkgqs,bkgqh->bskh", ds, q.astype(jnp.float32))
    return dq, dk, dv


def _send(x, cp):
    return jax.lax.ppermute(x, AXIS, [(d, (d + 1) % cp) for d in range(cp)])


def _visitor_is_earlier(step, cp):
    """At ring step s device i holds the block of device j = (i - s) mod cp; True when j < i."""
    i = jax.lax.axis_index(AXIS)
    return (i - step) % cp < i


def _ring_forward(q, k, v, cp):
    """Returns (out (B, K, G, T, H) float32, logsumexp (B, K, G, T))."""
    c = q.shape[3] // 2
    pq = local_positions(c, cp)
    B, K, G, T, H = q.shape
    acc = (
        jnp.zeros((B, K, G, T, H), jnp.float32),
        jnp.full((B, K, G, T), NEG, jnp.float32),
        jnp.zeros((B, K, G, T), jnp.float32),
    )
    nxt = _send((k, v), cp)  # in flight while the local block is computed
    acc = _merge(acc, q, k, v, pq[:, None] >= pq[None, :])
    for s in range(1, cp):
        k, v = nxt
        if s < cp - 1:
            nxt = _send((k, v), cp)

        def earlier(acc, k=k, v=v):  # all local queries see the first half of the visiting block
            return _merge(acc, q, k[:, :c], v[:, :c], None)

        def later(acc, k=k, v=v):  # only the second local chunk sees it, all of it
            hi = _merge(tuple(a[:, :, :, c:] for a in acc), q[:, :, :, c:], k, v, None)
            return tuple(jnp.concatenate([a[:, :, :, :c], h], axis=3) for a, h in zip(acc, hi))

        acc = jax.lax.cond(_visitor_is_earlier(s, cp), earlier, later, acc)
    o, m, l = acc
    return o / l[..., None], m + jnp.log(l)


def _ring_backward(q, k, v, o, lse, do, cp):
    c = q.shape[3] // 2
    pq = local_positions(c, cp)
    delta = jnp.sum(do * o, axis=-1)
    dq, dk, dv = _block_grads(q, k, v, do, lse, delta, pq[:, None] >= pq[None, :])
    nxt = _send((k, v), cp) if cp > 1 else (k, v)  # cp 1: no other block arrives
    for s in range(1, cp):
        dk, dv = _send((dk, dv), cp)  # travels with its block, which arrives in `nxt`
        k, v = nxt
        if s < cp - 1:
            nxt = _send((k, v), cp)

        def earlier(k=k, v=v):
            gq, gk, gv = _block_grads(q, k[:, :c], v[:, :c], do, lse, delta, None)
            pad = jnp.zeros_like(gk)
            return gq, jnp.concatenate([gk, pad], 1), jnp.concatenate([gv, pad], 1)

        def later(k=k, v=v):
            gq, gk, gv = _block_grads(q[:, :, :, c:], k, v, do[:, :, :, c:], lse[..., c:], delta[..., c:], None)
            return jnp.concatenate([jnp.zeros_like(gq), gq], axis=3), gk, gv

        gq, gk, gv = jax.lax.cond(_visitor_is_earlier(s, cp), earlier, later)
        dq, dk, dv = dq + gq, dk + gk, dv + gv
    if cp > 1:
        dk, dv = _send((dk, dv), cp)  # home: after cp sends each block's gradient is back on its device
    return dq, dk, dv


def _varying(x) -> frozenset:
    return jax.typeof(x).manual_axis_type.varying


def _ring(q_BTNH, k_BTKH, v_BTKH, cp):
    K = k_BTKH.shape[2]
    primal = {}  # dtypes and varying manual axes of the inputs (inside a pipeline stage: pp too)

    @jax.custom_vjp
    def ring(q, k, v):
        return _ring_forward(q, k, v, cp)[0]

    def fwd(q, k, v):
        primal["types"] = [(x.dtype, _varying(x)) for x in (q, k, v)]
        o, lse = _ring_forward(q, k, v, cp)
        return o, (q, k, v, o, lse)

    def bwd(res, do):
        q, k, v, o, lse = res
        out = []
        for g, (dtype, varying) in zip(_ring_backward(q, k, v, o, lse, do, cp), primal["types"]):
            missing = tuple(varying - _varying(g))
            out.append(jax.lax.pcast(g.astype(dtype), missing, to="varying") if missing else g.astype(dtype))
        return tuple(out)

    ring.defvjp(fwd, bwd)
    o = ring(_groups(q_BTNH, K), k_BTKH, v_BTKH)  # (B, K, G, T, H)
    B, _, G, T, H = o.shape
    return o.transpose(0, 3, 1, 2, 4).reshape(B, T, K * G, H).astype(q_BTNH.dtype)
