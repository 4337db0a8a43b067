"""FP8 for the experts' SwiGLU matmuls (`model.fp8` with `model.moe_experts`): the three dots of an
expert (forward x @ w, input gradient g @ w^T, weight gradient a^T @ g) on 2-D operands, as
`jaxdist.parallel.fp8` defines them: e4m3 forward operands, e5m2 gradients, current scaling, float32
accumulation. Used per expert: `dot` (its own VJP) by the capacity dispatch's vmapped SwiGLU, the
operand/dot helpers by the dropless chunk loop's hand-written VJP (`grouped_ffn.expert_chunks`).

Scales: `tensorwise`, one per expert weight and one per activation (or gradient) operand of a dot —
the expert's whole buffer in capacity mode, one chunk of its rows in dropless mode; `rowwise`, one
per row of what each dot keeps (tokens and output columns forward; tokens and input rows for the
input gradient; the weight's rows and columns for its gradient). mode "off" is the compute dtype's
plain matmul, unchanged.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxdist.parallel import fp8

FWD, DX, DW = (((1,), (0,)), ((), ())), (((1,), (1,)), ((), ())), (((0,), (0,)), ((), ()))


def weight(w, mode: str, for_dx: bool = False):
    """An expert weight (I, O) as a dot operand: itself ("off"), else (e4m3 codes, scale), scaled per
    tensor or, rowwise, per output column (forward) / per input row (`for_dx`: the input gradient)."""
    if mode == "off":
        return w
    return fp8.quantize(w, fp8.E4M3, (1 if for_dx else 0) if mode == "rowwise" else None)


def forward(x, w_op, mode: str):
    """x (T, I) @ w (I, O) in x's dtype; `w_op` from `weight(w, mode)`."""
    if mode == "off":
        return x @ w_op
    xq, sx = fp8.quantize(x, fp8.E4M3, 1 if mode == "rowwise" else None)
    wq, sw = w_op
    return fp8.scaled_dot(xq, sx, wq, sw, FWD).astype(x.dtype)


def input_grad(g, w_op, mode: str):
    """g (T, O) @ w (I, O)^T in g's dtype, g in e5m2; `w_op` from `weight(w, mode, for_dx=True)`."""
    if mode == "off":
        return g @ w_op.T
    gq, sg = fp8.quantize(g, fp8.E5M2, 1 if mode == "rowwise" else None)
    wq, sw = w_op
    return fp8.scaled_dot(gq, sg, wq, sw, DX).astype(g.dtype)


def weight_grad(a, g, mode: str):
    """a (T, I)^T @ g (T, O): in a's dtype ("off"), else a in e4m3 and g in e5m2, float32."""
    if mode == "off":
        return a.T @ g
    per = 0 if mode == "rowwise" else None
    aq, sa = fp8.quantize(a, fp8.E4M3, per)
    gq, sg = fp8.quantize(g, fp8.E5M2, per)
    return fp8.scaled_dot(aq, sa, gq, sg, DW)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def dot(x, w, mode: str):
    """x (T, I) @ w (I, O) with FP8 operands (`mode` tensorwise or rowwise), in x's dtype; the backward
    quantises the gradient to e5m2 and returns the weight gradient in w's dtype."""
    return forward(x, weight(w, mode), mode)


def _dot_fwd(x, w, mode):
    return dot(x, w, mode), (x, w)


def _dot_bwd(mode, res, g):
    x, w = res
    return input_grad(g, weight(w, mode, for_dx=True), mode).astype(x.dtype), weight_grad(x, g, mode).astype(w.dtype)


dot.defvjp(_dot_fwd, _dot_bwd)


def accumulator(w, mode: str):
    """Zeros to sum an expert weight's gradient over chunks in: w's dtype ("off"), float32 in FP8."""
    return jnp.zeros(w.shape, w.dtype if mode == "off" else jnp.float32)
