"""Block quantisation of frozen weights (QLoRA's storage): int8 (absmax / 127) and NF4 (Dettmers et al.
2023's 16 normal-float levels, two codes per byte), one float32 scale per `block` consecutive entries
along one axis. De-quantised on the fly, layer by layer, inside the model's matmuls.

The block axis is one the weight already shards along by its logical names; the scale array has the
same names, so `n / block` entries per shard need `(n / block) % shards == 0`: then no block (and no
NF4 byte) straddles two shards and de-quantising is local.
"""

from __future__ import annotations

import jax.numpy as jnp

# NF4: the quantiles of N(0, 1) rescaled to [-1, 1] with an exact zero (bitsandbytes' table).
NF4_LEVELS = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
KINDS = ("int8", "nf4")
CODE_DTYPE = {"int8": jnp.int8, "nf4": jnp.uint8}


def _blocks(w, axis: int, block: int):
    """w with `axis` split into (n / block, block): the block's entries on axis + 1."""
    axis = axis % w.ndim
    return w.reshape(*w.shape[:axis], w.shape[axis] // block, block, *w.shape[axis + 1 :]), axis


def quantize(w, kind: str, axis: int, block: int):
    """float w -> (codes, scale). int8 codes keep w's shape; NF4 codes are packed two per uint8 (the
    axis halves). scale: w's shape with `axis` divided by `block`, float32."""
    wb, axis = _blocks(w.astype(jnp.float32), axis, block)
    absmax = jnp.max(jnp.abs(wb), axis=axis + 1, keepdims=True)
    safe = jnp.where(absmax == 0, 1.0, absmax)
    if kind == "int8":
        codes = jnp.clip(jnp.round(wb / safe * 127), -127, 127).astype(jnp.int8).reshape(w.shape)
        return codes, jnp.squeeze(absmax / 127, axis + 1)
    levels = jnp.asarray(NF4_LEVELS, jnp.float32)
    idx = jnp.argmin(jnp.abs((wb / safe)[..., None] - levels), axis=-1).astype(jnp.uint8)
    pairs = idx.reshape(*idx.shape[: axis + 1], block // 2, 2, *idx.shape[axis + 2 :])
    lo, hi = jnp.take(pairs, 0, axis=axis + 2), jnp.take(pairs, 1, axis=axis + 2)
    packed = (lo | (hi << 4)).astype(jnp.uint8)
    shape = list(w.shape)
    shape[axis] //= 2
    return packed.reshape(shape), jnp.squeeze(absmax, axis + 1)


def dequantize(codes, scale, axis: int, dtype):
    """(codes, scale) -> the weight in `dtype`; the kind is read from the codes' dtype (int8: int8,
    uint8: packed NF4)."""
    axis = axis % codes.ndim
    cb, _ = _blocks(codes, axis, codes.shape[axis] // scale.shape[axis])  # NF4: (.., nb, block/2, ..)
    if codes.dtype == jnp.int8:
        w = cb.astype(jnp.float32) * jnp.expand_dims(scale, axis + 1)
        return w.reshape(codes.shape).astype(dtype)
    lo, hi = cb & 0xF, cb >> 4
    idx = jnp.stack([lo, hi], axis=axis + 2)  # (.., nb, block/2, 2, ..)
    idx = idx.reshape(*idx.shape[: axis + 1], -1, *idx.shape[axis + 3 :])
    w = jnp.asarray(NF4_LEVELS, jnp.float32)[idx.astype(jnp.int32)] * jnp.expand_dims(scale, axis + 1)
    shape = list(codes.shape)
    shape[axis] *= 2
    return w.reshape(shape).astype(dtype)


def stored_bytes_per_entry(kind: str, block: int) -> float:
    """Bytes a quantised weight keeps per entry: codes plus its share of a float32 scale."""
    return {"int8": 1.0, "nf4": 0.5}[kind] + 4 / block
