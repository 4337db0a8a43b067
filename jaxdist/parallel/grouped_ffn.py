"""Each local expert's SwiGLU over a variable number of rows, with static shapes: the dropless
dispatch's compute (jaxdist.parallel.moe).

An expert's rows arrive packed at the front of a fixed (R, D) buffer (R its worst case), `valid` of
them real. A loop of `chunk`-row steps whose trip count is ceil(valid / chunk) computes them, so the
work follows the real load, rounded up by under one chunk, instead of the buffer's size (XLA:CPU's
`ragged_dot` costs its padded size). The VJP is written out (`_chunks_bwd`): reverse-mode autodiff
of a loop with a dynamic trip count is not defined, and a fixed-length loop that skips chunks with
`lax.cond` saves the weights once per chunk as residuals (65 MiB instead of 7 MiB of temporaries for
one tiny-moe layer at ep=8, measured here) and ran 2.5x slower.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxdist.parallel import fp8_experts as mm


def chunk_rows(tokens: int, experts: int, topk: int) -> int:
    """Rows per dropless compute chunk: two sources' balanced shares 2·N·K/E, so an expert's compute is
    its real load rounded up by less than two of the ep shares a balanced expert receives. (tiny-moe's
    expert at ep=8, 300 rows of 1024, forward + backward on one device: 48.7 ms in chunks of one share,
    38.2 of two, 53.4 of four; 62.3 for the 512 padded rows of the 2x tier, measured together.)"""
    return max(1, 2 * math.ceil(tokens * topk / experts))


def _live_chunks(valid, chunk: int):
    return (valid + chunk - 1) // chunk


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def expert_chunks(rows_ERD, valid_E, w_gate, w_up, w_down, chunk: int, fp8: str = "off"):
    """SwiGLU of local expert e over its first valid_E[e] rows, `chunk` rows at a time: a loop whose
    trip count is the expert's live chunks, ceil(valid_E[e] / chunk), so compute follows the real load
    while every shape (and the all-to-all sizes) stays static. Rows past the live chunks are never read
    and come out 0. Weights arrive in the compute dtype. Differentiated by hand (`_chunks_bwd`): autodiff
    of a dynamic trip count is not defined, and of a masked loop would save the weights per chunk.
    `fp8` (model.fp8: off, tensorwise, rowwise): the matmuls' operands (`jaxdist.parallel.fp8_experts`:
    a scale per expert weight and per chunk, or per row), weight gradients summed over chunks in float32."""
    return _chunks_fwd(rows_ERD, valid_E, w_gate, w_up, w_down, chunk, fp8)[0]


def _chunks_fwd(rows_ERD, valid_E, w_gate, w_up, w_down, chunk, fp8="off"):
    El, R, D = rows_ERD.shape
    F = w_gate.shape[-1]
    if R % chunk:  # XLA clamps a slice that runs past the end: the last chunk would re-read rows and
        # add their weight gradients twice, silently
        raise ValueError(f"expert_chunks: the buffer's {R} rows are not a multiple of chunk={chunk}")

    def one_expert(_, xs):
        x, valid, wg, wu, wd = xs
        wg, wu, wd = (mm.weight(w, fp8) for w in (wg, wu, wd))  # quantised once per expert

        def body(c, bufs):
            x_c = jax.lax.dynamic_slice_in_dim(x, c * chunk, chunk)
            g_c, u_c = mm.forward(x_c, wg, fp8), mm.forward(x_c, wu, fp8)
            y_c = mm.forward(jax.nn.silu(g_c) * u_c, wd, fp8)
            return tuple(jax.lax.dynamic_update_slice_in_dim(b, v, c * chunk, 0) for b, v in zip(bufs, (y_c, g_c, u_c)))

        zeros = (jnp.zeros((R, D), x.dtype), jnp.zeros((R, F), x.dtype), jnp.zeros((R, F), x.dtype))
        return None, jax.lax.fori_loop(0, _live_chunks(valid, chunk), body, zeros)

    y, g, u = jax.lax.scan(one_expert, None, (rows_ERD, valid_E, w_gate, w_up, w_down))[1]
    return y, (rows_ERD, valid_E, w_gate, w_up, w_down, g, u)


def _chunks_bwd(chunk, fp8, res, dy_ERD):
    """SwiGLU's VJP over the live chunks: y = (silu(g) u) W_down with g = x W_gate, u = x W_up."""
    rows_ERD, valid_E, w_gate, w_up, w_down, g_ERF, u_ERF = res

    def one_expert(_, xs):
        x, valid, wg, wu, wd, g, u, dy = xs
        ops = tuple(mm.weight(w, fp8, for_dx=True) for w in (wg, wu, wd))  # quantised once per expert

        def body(c, acc):
            dx, dwg, dwu, dwd = acc
            x_c, g_c, u_c, dy_c = (jax.lax.dynamic_slice_in_dim(a, c * chunk, chunk) for a in (x, g, u, dy))
            sig = jax.nn.sigmoid(g_c)
            silu = g_c * sig
            dh = mm.input_grad(dy_c, ops[2], fp8)
            dg = dh * u_c * sig * (1 + g_c * (1 - sig))  # d silu(g) / dg = sig (1 + g (1 - sig))
            du = dh * silu
            dx_c = mm.input_grad(dg, ops[0], fp8) + mm.input_grad(du, ops[1], fp8)
            dx = jax.lax.dynamic_update_slice_in_dim(dx, dx_c, c * chunk, 0)
            dws = (mm.weight_grad(x_c, dg, fp8), mm.weight_grad(x_c, du, fp8), mm.weight_grad(silu * u_c, dy_c, fp8))
            return (dx, *(a + d for a, d in zip((dwg, dwu, dwd), dws)))

        zeros = (jnp.zeros_like(x), *(mm.accumulator(w, fp8) for w in (wg, wu, wd)))
        dx, dwg, dwu, dwd = jax.lax.fori_loop(0, _live_chunks(valid, chunk), body, zeros)
        return None, (dx, *(d.astype(w.dtype) for d, w in zip((dwg, dwu, dwd), (wg, wu, wd))))

    xs = (rows_ERD, valid_E, w_gate, w_up, w_down, g_ERF, u_ERF, dy_ERD)
    dx, dwg, dwu, dwd = jax.lax.scan(one_expert, None, xs)[1]
    return dx, None, dwg, dwu, dwd


expert_chunks.defvjp(_chunks_fwd, _chunks_bwd)
