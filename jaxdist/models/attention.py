"""Attention's pieces without parameters: rotary position embeddings (with Llama 3.1's rescale),
causal grouped-query attention (a fixed window, or one given per layer as an array), and the segment
masks of packed documents.

Shapes are suffixed on names: B batch, T sequence, N query heads, K kv heads, H head_dim.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

from jaxdist.config import ModelConfig


def rope_frequencies(half: int, theta: float, scaling: tuple = ()):
    """Per-pair rotation frequencies; `scaling` = (factor, low_freq_factor, high_freq_factor,
    original_max_len) applies Llama 3.1's rescale: long wavelengths slowed by `factor`, short ones kept,
    a smooth blend between (as transformers' `_compute_llama3_parameters`)."""
    freq_H = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    if not scaling:
        return freq_H
    factor, low, high, original = scaling
    wavelen_H = 2 * jnp.pi / freq_H
    slowed_H = jnp.where(wavelen_H > original / low, freq_H / factor, freq_H)
    smooth_H = (original / wavelen_H - low) / (high - low)
    blended_H = (1 - smooth_H) * slowed_H / factor + smooth_H * slowed_H
    medium_H = (wavelen_H >= original / high) & (wavelen_H <= original / low)
    return jnp.where(medium_H, blended_H, slowed_H)


def rope_scaling(cfg: ModelConfig) -> tuple:
    """The static llama3 rescale parameters of `cfg` (() for none): hashable, so NNX keeps it static."""
    if cfg.rope_scaling == "none":
        return ()
    return (cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, float(cfg.rope_original_max_len))


def rotary(x_BTNH, positions_T, theta: float, scaling: tuple = ()):
    """Rotate pairs (first half, second half) of each head by position-dependent angles. Positions are
    (T,), shared by the batch, or (B, T) per row (packed documents restarting at 0; left-padded decoding)."""
    return rotary_by(x_BTNH, positions_T, rope_frequencies(x_BTNH.shape[-1] // 2, theta, scaling))


def rotary_by(x_BTNH, positions_T, freq_H):
    """`rotary` with the per-pair frequencies given (an array: per-layer bases scanned over layers)."""
    angle_BTH = jnp.asarray(positions_T)[..., None].astype(jnp.float32) * freq_H
    angle_BTH = angle_BTH if angle_BTH.ndim == 3 else angle_BTH[None]
    sin, cos = jnp.sin(angle_BTH)[:, :, None, :], jnp.cos(angle_BTH)[:, :, None, :]
    x1, x2 = jnp.split(x_BTNH.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_BTNH.dtype)


def causal_attention(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT=None, window: int = 0):
    """Grouped-query causal attention: cuDNN's fused flash attention on GPU in bf16/fp16 (JAX's
    default is XLA's, which materialises the T x T scores), else XLA's. With `segment_ids_BT`, a token
    attends only within its own segment (packed documents). `window` > 0: query i sees keys
    i-window+1..i (transformers' sliding window: i - j < window)."""
    mask = document_mask(segment_ids_BT)
    T = q_BTNH.shape[1]
    if jax.default_backend() == "gpu" and q_BTNH.dtype in (jnp.bfloat16, jnp.float16) and isinstance(T, int):
        try:
            return jax.nn.dot_product_attention(
                q_BTNH,
                k_BTKH,
                v_BTKH,
                mask=mask,
                is_causal=True,
                local_window_size=(window - 1, 0) if window else None,
                implementation="cudnn",
            )
        except (ValueError, NotImplementedError, RuntimeError) as e:  # shape or cuDNN version unsupported
            warnings.warn(f"cuDNN attention unavailable ({e}); using XLA's attention")
    if window:  # a band mask built from iotas (JAX's local_window_size needs a concrete T; the planner's isn't)
        band = window_mask(jax.lax.iota(jnp.int32, T), jax.lax.iota(jnp.int32, T), window)[None, None]
        mask = band if mask is None else mask & band
    return jax.nn.dot_product_attention(q_BTNH, k_BTKH, v_BTKH, mask=mask, is_causal=True)


def banded_attention(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, window, scale: float | None = None):
    """Causal attention whose `window` may be a traced scalar (one per layer, scanned): 0 = every earlier
    position, W > 0 = the last W (i - j < W). XLA's attention under an explicit mask (no fused kernel
    takes a traced window). `scale`: the score multiplier (None: 1/sqrt(head_dim))."""
    T = q_BTNH.shape[1]
    band = any_window_mask(jax.lax.iota(jnp.int32, T), jax.lax.iota(jnp.int32, T), window)[None, None]
    mask = document_mask(segment_ids_BT)
    mask = band if mask is None else mask & band
    return jax.nn.dot_product_attention(q_BTNH, k_BTKH, v_BTKH, mask=mask, is_causal=True, scale=scale)


def any_window_mask(q_slots_T, slots_S, window):
    """`window_mask` for a window that may be traced, 0 meaning none."""
    return window_mask(q_slots_T, slots_S, window) | (window == 0)


def window_mask(q_slots_T, slots_S, window: int):
    """(T, S) True where a cached key slot is within the query's window (slot distance = position
    distance, padding shifting both alike)."""
    return (q_slots_T[:, None] - slots_S[None, :]) < window


def document_segments(tokens_BT, eos_id: int):
    """Segment ids of packed documents (MaxText's decoder_segment_ids): a new document starts after
    each EOS; the EOS belongs to the document it ends."""
    is_eos = (tokens_BT == eos_id).astype(jnp.int32)
    return jnp.cumsum(is_eos, axis=1) - is_eos


def document_positions(segment_ids_BT):
    """Positions that restart at 0 where the segment id changes (RoPE sees each document alone)."""
    idx_BT = jnp.broadcast_to(jnp.arange(segment_ids_BT.shape[1]), segment_ids_BT.shape)
    starts_BT = jnp.concatenate(
        [jnp.ones_like(segment_ids_BT[:, :1], bool), segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]], axis=1
    )
    return idx_BT - jax.lax.cummax(jnp.where(starts_BT, idx_BT, 0), axis=1)


def document_mask(segment_ids_BT):
    """(B, 1, T, T) True where query and key are in the same segment; None without segments."""
    if segment_ids_BT is None:
        return None
    return (segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :])[:, None]
