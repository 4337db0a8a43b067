"""Gradient compressors for the data-parallel sum: top-k, PowerSGD, block-wise int8.

Each `Codec` sums one tensor over the replicas of a manual mesh axis (inside `shard_map`):
`reduce(x, state, batch_dims, axis) -> (total, sent, state)`, where `total` is what every replica
receives and `sent` is this replica's own share of it, decompressed — error feedback keeps
`x - sent` for the next step. `bytes_sent(shape, batch_dims, n)` is the cost per device of the
collectives the codec issues, by `hlo.ring_bytes` (the one ring model); the reducer uses it to send a
tensor dense when compressing it would not save bytes, and the byte tests hold the compiled program
to it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxdist.distributed import hlo


class Codec(NamedTuple):
    name: str
    init: Callable  # (shape, batch_dims) -> per-tensor state (() when stateless)
    reduce: Callable  # (x, state, batch_dims, axis) -> (total, sent, state)
    bytes_sent: Callable  # (shape, batch_dims, n) -> bytes each replica sends per step


def dense_bytes(shape, n: int) -> float:
    """A float32 all-reduce of the tensor (ring model)."""
    return hlo.ring_bytes("all-reduce", n, 4 * math.prod(shape))


def cheaper(codec: Codec, shape, batch_dims: int, n: int) -> bool:
    """Whether the codec sends fewer bytes for this tensor than a dense float32 all-reduce: where
    not, reducers send it dense."""
    return codec.bytes_sent(shape, batch_dims, n) < dense_bytes(shape, n)


def bytes_or_dense(codec: Codec, shape, batch_dims: int, n: int) -> float:
    """What one tensor costs per replica: the codec's bytes, or dense float32 where that is not more."""
    return codec.bytes_sent(shape, batch_dims, n) if cheaper(codec, shape, batch_dims, n) else dense_bytes(shape, n)


# ---------------------------------------------------------------------------------------------------
# top-k: exchange values + indices (Lin et al. 2018, Deep Gradient Compression), chunked and packed

MAX_CHUNK = 1 << 16  # in-chunk positions fit 16 bits


def chunking(size: int) -> tuple[int, int]:
    """(chunks, chunk): near-equal chunks of at most MAX_CHUNK entries (padding < chunks entries)."""
    chunks = -(-size // MAX_CHUNK)
    return chunks, -(-size // chunks)


def sparse_sum(x_CE, k: int, axis):
    """Sum over `axis` of each replica's `k` largest-magnitude entries per row (chunk) of `x_CE`
    (rows of <= 65,536 entries). Each kept entry travels as one uint32 —
    its bfloat16 value's bits over its 16-bit position in the row — in one all-gather; replicas
    scatter-add what they gather. Returns (total_CE, sent_CE, kept_CE): the sum, this replica's own
    bfloat16-rounded share of it, and where its kept entries are (a kept value may round to 0)."""
    chunks, chunk = x_CE.shape
    _, idx = jax.lax.top_k(jnp.abs(x_CE), k)  # (chunks, k) positions in each chunk
    vals = jnp.take_along_axis(x_CE, idx, axis=1).astype(jnp.bfloat16)
    bits = jax.lax.bitcast_convert_type(vals, jnp.uint16).astype(jnp.uint32)
    every = jax.lax.all_gather((bits << 16) | idx.astype(jnp.uint32), axis)  # (n, chunks, k)
    got_vals = jax.lax.bitcast_convert_type((every >> 16).astype(jnp.uint16), jnp.bfloat16)
    got_idx = (every & 0xFFFF).astype(jnp.int32) + chunk * jnp.arange(chunks, dtype=jnp.int32)[:, None]
    total = jnp.zeros(chunks * chunk, jnp.float32).at[got_idx.reshape(-1)].add(got_vals.astype(jnp.float32).reshape(-1))
    rows = jnp.arange(chunks)[:, None]
    sent = jnp.zeros_like(x_CE).at[rows, idx].set(vals.astype(jnp.float32))
    kept = jnp.zeros(x_CE.shape, bool).at[rows, idx].set(True)
    return total.reshape(chunks, chunk), sent, kept


def sparse_bytes(chunks: int, k: int, n: int) -> float:
    """Bytes per device of `sparse_sum`: the all-gather of every replica's chunks·k packed entries."""
    return hlo.ring_bytes("all-gather", n, n * 4 * chunks * k)


def topk_k(size: int, ratio: float) -> tuple[int, int, int]:
    """(chunks, chunk, k): the chunking of a tensor of `size` entries and the entries kept per chunk."""
    chunks, chunk = chunking(size)
    return chunks, chunk, max(1, math.ceil(ratio * chunk))


def topk_sum(x, ratio: float, axis):
    """`sparse_sum` of a whole tensor: flattened into chunks of <= 65,536 entries, the `ratio`
    largest-magnitude entries of each kept. Returns (total, sent, kept) shaped like x."""
    chunks, chunk, k = topk_k(x.size, ratio)
    flat = jnp.pad(x.reshape(-1).astype(jnp.float32), (0, chunks * chunk - x.size)).reshape(chunks, chunk)
    total, sent, kept = sparse_sum(flat, k, axis)
    unpad = lambda a: a.reshape(-1)[: x.size].reshape(x.shape)
    return unpad(total).astype(x.dtype), unpad(sent).astype(x.dtype), unpad(kept)


def topk(ratio: float) -> Codec:
    """Keep the `ratio` largest-magnitude entries of each chunk of <= 65,536 entries; every kept
    entry travels as one uint32: its bfloat16 value's bits over its 16-bit position in the chunk —
    4 bytes per kept entry, one all-gather (packing also keeps XLA:CPU from widening bfloat16 to
    float32). Replicas scatter-add what they gather. Against a dense float32 all-reduce
    (2(N-1)/N·4 bytes per entry) the bytes shrink by ~ 2/(N·ratio): the gather of N sparse sets
    limits it. `sent` is the bfloat16-rounded values, so error feedback keeps the rounding too."""

    def reduce(x, state, batch_dims, axis):
        total, sent, _ = topk_sum(x, ratio, axis)
        return total, sent, state

    def bytes_sent(shape, batch_dims, n):
        chunks, _, k = topk_k(math.prod(shape), ratio)
        return sparse_bytes(chunks, k, n)

    return Codec("topk", lambda shape, batch_dims: (), reduce, bytes_sent)


# ---------------------------------------------------------------------------------------------------
# int8: quantise blocks, all-to-all, sum in float32, requantise, all-gather (ZeRO++ qgZ)


def quantize(x_NB):
    """Rows of `block` entries -> int8 codes and one float32 scale per row (max-abs / 127)."""
    amax = jnp.max(jnp.abs(x_NB), axis=-1)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    return jnp.round(x_NB / scale[..., None]).astype(jnp.int8), scale


def dequantize(q, scale):
    return q.astype(jnp.float32) * scale[..., None]


def int8(block: int, replicas: int | None = None) -> Codec:
    """Each replica quantises its tensor in blocks of `block` entries; all-to-all hands replica j the
    j-th chunk from everyone; it sums them in float32, requantises, and the sums are all-gathered.
    Bytes: 2(N-1)/N · (size + 4·size/block), ~4x less than float32 dense. With `replicas` (the axis
    size) the requantisation gets error feedback too (1-bit Adam's server-side compensation): replica j
    keeps what rounding its chunk's sum lost and adds it to the next step's sum, so no rounding of
    either stage is dropped (the senders' error feedback covers only the first)."""

    def padded_size(shape, n):
        return -(-math.prod(shape) // (n * block)) * n * block

    def init(shape, batch_dims):  # this replica's chunk of the requantised sum's error, or stateless
        return () if replicas is None else jnp.zeros(padded_size(shape, replicas) // replicas, jnp.float32)

    def reduce(x, state, batch_dims, axis):
        n = jax.lax.axis_size(axis)
        flat = x.reshape(-1).astype(jnp.float32)
        flat = jnp.pad(flat, (0, padded_size(x.shape, n) - flat.size))
        q, scale = quantize(flat.reshape(n, -1, block))  # chunk j goes to replica j
        sent = dequantize(q, scale).reshape(-1)[: x.size]
        q_in = jax.lax.all_to_all(q, axis, 0, 0)  # (n senders, blocks per chunk, block)
        scale_in = jax.lax.all_to_all(scale, axis, 0, 0)
        chunk_sum = dequantize(q_in, scale_in).sum(0)
        if replicas is not None:
            chunk_sum = chunk_sum + state.reshape(chunk_sum.shape)
        q_sum, scale_sum = quantize(chunk_sum)
        if replicas is not None:
            state = (chunk_sum - dequantize(q_sum, scale_sum)).reshape(-1)
        total = dequantize(jax.lax.all_gather(q_sum, axis), jax.lax.all_gather(scale_sum, axis))
        return total.reshape(-1)[: x.size].reshape(x.shape).astype(x.dtype), sent.reshape(x.shape), state

    def bytes_sent(shape, batch_dims, n):
        size = padded_size(shape, n)
        codes_and_scales = size + 4 * size // block  # all-to-all them, then all-gather the requantised sums
        return hlo.ring_bytes("all-to-all", n, codes_and_scales) + hlo.ring_bytes("all-gather", n, codes_and_scales)

    return Codec("int8", init, reduce, bytes_sent)


# ---------------------------------------------------------------------------------------------------
# PowerSGD (Vogels et al. 2019): rank-r power iteration with a warm-started Q


def matrix_view(shape, batch_dims: int) -> tuple[int, int, int]:
    """(batch, rows, cols): leading stacked-layer dims are a batch of matrices; the rest is split
    where rows + cols (the bytes sent per rank) is smallest."""
    batch, rest = math.prod(shape[:batch_dims]), shape[batch_dims:]
    if len(rest) < 2:
        return batch, math.prod(rest), 1
    rows, cols = min(
        ((math.prod(rest[:i]), math.prod(rest[i:])) for i in range(1, len(rest))), key=lambda rc: rc[0] + rc[1]
    )
    return batch, rows, cols


def powersgd(rank: int, seed: int = 0) -> Codec:
    """Per matrix M (each replica's gradient + residual): P = Σ M·Q, orthonormalise P, Q = Σ Mᵀ·P;
    the sum is P·Qᵀ, this replica's share P·(Mᵀ·P)ᵀ. Q carries over to warm-start the next step's
    single power iteration. Bytes: 2(N-1)/N · 4·r·(rows + cols) per matrix; a tensor where that is
    not smaller than dense (1-D tensors, thin matrices) is sent dense."""

    def init(shape, batch_dims):
        batch, rows, cols = matrix_view(shape, batch_dims)
        # The same seed on every replica: Q starts (and stays, being summed) identical everywhere.
        key = jax.random.fold_in(jax.random.key(seed), hash((tuple(shape), batch_dims)) % (2**31))
        return jax.random.normal(key, (batch, cols, rank), jnp.float32)

    def reduce(x, q_BCR, batch_dims, axis):
        batch, rows, cols = matrix_view(x.shape, batch_dims)
        m_BRC = x.reshape(batch, rows, cols).astype(jnp.float32)
        p_BRr = jax.lax.psum(jnp.einsum("brc,bck->brk", m_BRC, q_BCR), axis)
        p_BRr = jnp.linalg.qr(p_BRr)[0]  # orthonormal columns; all replicas compute the same
        q_mine = jnp.einsum("brc,brk->bck", m_BRC, p_BRr)
        q_BCR = jax.lax.psum(q_mine, axis)
        total = jnp.einsum("brk,bck->brc", p_BRr, q_BCR).reshape(x.shape).astype(x.dtype)
        sent = jnp.einsum("brk,bck->brc", p_BRr, q_mine).reshape(x.shape).astype(x.dtype)
        return total, sent, q_BCR

    def bytes_sent(shape, batch_dims, n):
        batch, rows, cols = matrix_view(shape, batch_dims)  # psum of P, then of Q
        return hlo.ring_bytes("all-reduce", n, 4 * batch * rank * (rows + cols))

    return Codec("powersgd", init, reduce, bytes_sent)
