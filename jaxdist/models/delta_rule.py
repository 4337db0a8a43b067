"""Qwen3-Next's gated delta rule (the linear attention of its DeltaNet layers) and the causal depthwise
convolution before it, as transformers computes them: the recurrent form over time (`gated_delta_rule`,
decoding and the reference), the chunked form sequences run (`chunked_delta_rule`, transformers'
`torch_chunk_gated_delta_rule`: the same sum, T / chunk states kept for the backward), and `causal_conv`.
The layer around them: models/qwen3next.py's `GatedDeltaNet`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

L2_EPS = 1e-6  # transformers' l2norm in the delta rule (FLA's)


def l2norm(x):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def gated_delta_rule(q_BTVK, k_BTVK, v_BTVD, g_BTV, beta_BTV, state_BVKD):
    """The gated delta rule over time (float32): -> (o_BTVD, final state). q and k are L2-normed here and q
    scaled by dk^-1/2, as transformers' kernels with use_qk_l2norm_in_kernel."""
    q = l2norm(q_BTVK.astype(jnp.float32)) * q_BTVK.shape[-1] ** -0.5
    k = l2norm(k_BTVK.astype(jnp.float32))
    v, g, beta = v_BTVD.astype(jnp.float32), g_BTV.astype(jnp.float32), beta_BTV.astype(jnp.float32)

    def step(s_BVKD, x):
        q_t, k_t, v_t, g_t, b_t = x
        s_BVKD = s_BVKD * jnp.exp(g_t)[..., None, None]
        kv_BVD = jnp.einsum("bvkd,bvk->bvd", s_BVKD, k_t)
        delta_BVD = (v_t - kv_BVD) * b_t[..., None]
        s_BVKD = s_BVKD + k_t[..., :, None] * delta_BVD[..., None, :]
        return s_BVKD, jnp.einsum("bvkd,bvk->bvd", s_BVKD, q_t)

    time_first = lambda x: jnp.moveaxis(x, 1, 0)
    state, o_TBVD = jax.lax.scan(step, state_BVKD.astype(jnp.float32), tuple(map(time_first, (q, k, v, g, beta))))
    return jnp.moveaxis(o_TBVD, 0, 1), state


CHUNK = 64  # transformers' chunk_size


def unit_lower_inverse(n_CC):
    """(I + N)^-1 for a strictly lower-triangular N (..., C, C), by matmuls alone: N is nilpotent
    (N^C = 0), so (I + N)^-1 = (I - N)(I + N^2)(I + N^4)... up to the power that reaches C. Not
    `lax.linalg.triangular_solve`: on XLA:CPU it is a batched LAPACK call whose threads, started from
    every simulated device at once, deadlocked the train step (Qwen3-Next's LoRA step hung at 0% CPU)."""
    eye = jnp.eye(n_CC.shape[-1], dtype=n_CC.dtype)
    inverse, power = eye - n_CC, n_CC @ n_CC
    for _ in range(max(n_CC.shape[-1] - 1, 1).bit_length() - 1):
        inverse = inverse @ (eye + power)
        power = power @ power
    return inverse


def chunked_delta_rule(q_BTVK, k_BTVK, v_BTVD, g_BTV, beta_BTV, state_BVKD, chunk: int = CHUNK):
    """`gated_delta_rule` by chunks (transformers' `torch_chunk_gated_delta_rule`, the same sum in another
    order): within a chunk the delta rule's updates are one unit-lower-triangular solve (the UT transform),
    across chunks a `lax.scan` carries the state, so the backward keeps T / chunk states, not T."""
    B, T, V, K = q_BTVK.shape
    C = chunk  # padded to whole chunks, as transformers
    pad = (-T) % C
    f32 = lambda x: x.astype(jnp.float32)
    q = l2norm(f32(q_BTVK)) * K**-0.5
    k = l2norm(f32(k_BTVK))
    v, g, beta = f32(v_BTVD), f32(g_BTV), f32(beta_BTV)
    padT = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    # -> (n chunks, B, V, C, ...): the scan runs over the leading axis
    chunks = lambda x: jnp.moveaxis(padT(x).reshape(B, -1, C, V, *x.shape[3:]), 3, 2).swapaxes(0, 1)
    q, k, v, g, beta = chunks(q), chunks(k), chunks(v), chunks(g), chunks(beta)
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    G = jnp.cumsum(g, axis=-1)  # (n, B, V, C) log decay from the chunk's start
    lower = jnp.tril(jnp.ones((C, C), bool))
    decay = jnp.exp(jnp.where(lower, G[..., :, None] - G[..., None, :], -jnp.inf))
    ut = jnp.where(lower & ~jnp.eye(C, dtype=bool), (k_beta @ k.swapaxes(-1, -2)) * decay, 0.0)
    inverse = unit_lower_inverse(ut)
    new_v, k_cum = inverse @ v_beta, inverse @ (k_beta * jnp.exp(G)[..., None])
    intra = (q @ k.swapaxes(-1, -2)) * decay
    q_dec = q * jnp.exp(G)[..., None]
    k_dec = k * jnp.exp(G[..., -1:] - G)[..., None]
    chunk_decay = jnp.exp(G[..., -1])[..., None, None]

    def step(s_BVKD, x):
        new_v, k_cum, q_dec, k_dec, intra, cd = x
        v_new = new_v - k_cum @ s_BVKD
        o = q_dec @ s_BVKD + intra @ v_new
        return s_BVKD * cd + k_dec.swapaxes(-1, -2) @ v_new, o

    state, o = jax.lax.scan(step, f32(state_BVKD), (new_v, k_cum, q_dec, k_dec, intra, chunk_decay))
    o_BTVD = jnp.moveaxis(o.swapaxes(0, 1), 3, 2).reshape(B, -1, V, v_BTVD.shape[-1])[:, :T]
    return o_BTVD, state


def causal_conv(x_BTC, tail_BWC, w_C1W):
    """Depthwise causal convolution of `x_BTC` continuing `tail_BWC` (the previous W-1 inputs, zeros at
    the start), then SiLU: -> (y_BTC, the new tail). As transformers' conv1d with padding W-1, cut to T."""
    W, T = w_C1W.shape[-1], x_BTC.shape[1]
    full = jnp.concatenate([tail_BWC.astype(x_BTC.dtype), x_BTC], axis=1)  # (B, W-1+T, C)
    w_WC = w_C1W[:, 0, :].T.astype(x_BTC.dtype)
    y_BTC = sum(full[:, j : j + T] * w_WC[j] for j in range(W))
    return jax.nn.silu(y_BTC), full[:, T:]
