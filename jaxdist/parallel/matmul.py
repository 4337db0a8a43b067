"""The model's matmuls: tokens flattened, weights cast on their shard, weight gradients in float32.

A weight gradient is a matmul that contracts the batch; under sharding, XLA reduces its partial sums
(all-reduce / reduce-scatter over the batch axes) in the matmul's output dtype, so a bf16 matmul
followed by `.astype(float32)` reduces in bf16 (checked in the partitioned HLO). Asking the matmul
itself for a float32 result keeps the reduction in float32 while the operands stay bf16. The dot
names its algorithm (bf16 operands, float32 accumulation: `DotAlgorithmPreset.BF16_BF16_F32`), which
XLA:CPU runs for these 2-D weight-gradient dots; it rejects some others ("Unsupported element type for
DotThunk::Execute: BF16 x BF16 = F32", seen with a 3-D einsum result), so callers flatten to 2-D.
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import jax
import jax.numpy as jnp

from jaxdist.distributed.sharding import constrain, current_rules, drop_axes, logical_to_spec
from jaxdist.parallel import context, fp8

BF16_F32 = jax.lax.DotAlgorithmPreset.BF16_BF16_F32


def dot_general_f32(a, b, dimension_numbers):
    """`jax.lax.dot_general` with a float32 result, accumulated in float32."""
    precision = BF16_F32 if a.dtype == b.dtype == jnp.bfloat16 else None
    return jax.lax.dot_general(a, b, dimension_numbers, precision=precision, preferred_element_type=jnp.float32)


# The dtype the implicit stage reduces weight gradients in (reduce.dtype): set while the gradients are traced.
_REDUCE_DTYPE = contextvars.ContextVar("reduce_dtype", default=jnp.float32)


@contextlib.contextmanager
def reduce_in(dtype):
    """Trace gradients whose batch reductions run in `dtype` (float32 or bfloat16): a bf16 weight
    gradient's matmul then returns bf16, so XLA reduces its partial sums (reduce-scatter / all-reduce
    over the batch axes) in bf16, half the bytes, before the float32 master gradient is formed."""
    token = _REDUCE_DTYPE.set(jnp.dtype(dtype))
    try:
        yield
    finally:
        _REDUCE_DTYPE.reset(token)


def weight_grad(a, b, dimension_numbers, shape, names):
    """A weight gradient (a matmul contracting the tokens), reshaped to `shape` and constrained to the
    weight's sharding `names`, as float32. Its partial sums over the batch axes are reduced in float32
    (`dot_general_f32`), or in bf16 under `reduce_in(bfloat16)` when the operands are bf16."""
    if a.dtype == b.dtype == jnp.bfloat16 and _REDUCE_DTYPE.get() == jnp.bfloat16:
        dw = jax.lax.dot_general(a, b, dimension_numbers, preferred_element_type=jnp.bfloat16)
        return constrain(dw.reshape(shape), names).astype(jnp.float32)
    return constrain(dot_general_f32(a, b, dimension_numbers).reshape(shape), names)


def token_matmul(x, w):
    """x[..., I] @ w[I, ...] with the leading (token) dims flattened into one: a plain 2-D matmul. Its
    weight gradient contracts one token dim, which XLA's CPU backend computes without the transposing
    copies of activations it makes for a (batch, seq) contraction (2.5x faster MLP step on CPU).
    Not when cp splits the sequence: (batch, seq/cp) does not flatten into one sharded dim, and XLA
    would all-gather the activations over cp to do it."""
    if context.splits_sequence():
        return jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())))
    out = x.reshape(-1, x.shape[-1]) @ w.reshape(x.shape[-1], -1)
    return out.reshape(*x.shape[:-1], *w.shape[1:])


def cast_sharded(w, names, dtype):
    """`w` in `dtype`, converted on its shard before any all-gather (half the bytes for bf16). The
    gradient goes back to float32 on the same sharding, so its reduction runs in float32."""

    @jax.custom_vjp
    def cast(w):
        return constrain(w.astype(dtype), names)

    def bwd(_, g):
        return (constrain(g.astype(jnp.float32), names),)

    cast.defvjp(lambda w: (cast(w), None), bwd)
    return cast(w)


# The layer matrices used only through weight_matmul (Attention, MLP): the scan does not pre-cast them.
WEIGHT_MATMUL = frozenset({"wq_DNH", "wk_DKH", "wv_DKH", "wo_NHD", "w_gate_DF", "w_up_DF", "w_down_FD"})


WEIGHT_GATHER = "weight_gather"  # the jax scope of gathered()'s all-gathers (tests count them in the HLO)
# Whether weight_matmul's residual is the gathered weight (set while a rematerialised layer is traced).
_KEEP_GATHERED = contextvars.ContextVar("keep_gathered", default=False)


@contextlib.contextmanager
def recomputed_layers():
    """Trace layers whose residuals the backward recomputes (jax.checkpoint): weight_matmul then keeps
    the gathered weight as its residual, so the backward's recompute gathers each weight once and the
    input gradient's matmul reuses that copy. Without remat that residual would hold every layer's
    gathered weights through the whole forward, so it is kept sharded there."""
    token = _KEEP_GATHERED.set(True)
    try:
        yield
    finally:
        _KEEP_GATHERED.reset(token)


# model.fp8 of the layers being traced (set around the layer scan: models/llama.py).
_FP8 = contextvars.ContextVar("fp8", default="off")


@contextlib.contextmanager
def fp8_matmuls(mode: str):
    """Trace the layers' weight matmuls in FP8 (`mode`: tensorwise or rowwise; "off": as before)."""
    token = _FP8.set(mode)
    try:
        yield
    finally:
        _FP8.reset(token)


def fp8_mode() -> str:
    """model.fp8 of the layers being traced ("off" outside `fp8_matmuls`)."""
    return _FP8.get()


def gathered(w, names):
    """`w` all-gathered over the batch axes (FSDP), still split over the others (tp): the copy a matmul
    uses. Explicit, so the forward and the backward can share one copy (XLA never merges two
    all-gathers of the same array: each has its own channel)."""
    mesh, rules = jax.sharding.get_abstract_mesh(), current_rules()
    if rules is None or mesh.empty:
        return w
    spec = drop_axes(logical_to_spec(names, rules, "activation"), set(rules["batch"]) | set(mesh.manual_axes))
    with jax.named_scope(WEIGHT_GATHER):
        return jax.lax.with_sharding_constraint(w, spec)


def weight_matmul(x, w, names, in_dims: int = 1):
    """x[..., I] @ w[I..., O...] (w's first `in_dims` dims flatten to I) for a float32 master weight `w`
    carrying logical `names`. In a lower compute dtype, `w` is cast on its shard before any all-gather
    (FSDP gathers bf16), and the weight gradient comes out of its matmul in float32, so the reduction of
    the partial sums over the batch axes (all-reduce / reduce-scatter) runs in float32 — a plain
    `w.astype(bf16)` makes XLA reduce the bf16 matmul output, then convert (checked in the HLO)."""
    out_dims = w.shape[in_dims:]
    flat = lambda v: v.reshape(x.shape[-1], *out_dims)
    if _FP8.get() == "mxfp8":  # block-32 scales: JAX's scaled dot (cuDNN on Blackwell GPUs; fp8.check refuses others)
        return fp8.mx_matmul(x, flat(gathered(cast_sharded(w, names, x.dtype), names)))
    if _FP8.get() != "off":
        return fp8_weight_matmul(x, w, names, in_dims, _FP8.get() == "rowwise")
    if x.dtype == w.dtype:  # as the scan's other matrices: constrained, gradient reduced to the sharding
        return token_matmul(x, flat(cast_sharded(w, names, x.dtype)))

    def run(x, w16):
        return token_matmul(x, flat(w16))

    @jax.custom_vjp
    def mm(x, w):
        return run(x, constrain(w.astype(x.dtype), names))

    def fwd(x, w):
        w16 = constrain(w.astype(x.dtype), names)
        full = gathered(w16, names)
        return run(x, full), (x, full if _KEEP_GATHERED.get() else w16)

    def bwd(res, g):
        x, w16 = res
        lead = x.ndim - 1
        tokens = tuple(range(lead))
        if context.splits_sequence():  # no (batch, seq) flattening under cp (see token_matmul)
            g2 = g.reshape(*g.shape[:lead], math.prod(out_dims))  # a 2-D result (see jaxdist.parallel.matmul)
            dw = weight_grad(x, g2, ((tokens, tokens), ((), ())), w16.shape, names)
        else:
            x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, math.prod(out_dims))
            dw = weight_grad(x2, g2, (((0,), (0,)), ((), ())), w16.shape, names)
        w2 = flat(w16)
        out_axes = tuple(range(1, w2.ndim))
        dx = jax.lax.dot_general(g, w2, ((tuple(range(lead, g.ndim)), out_axes), ((), ())))
        return dx.astype(x.dtype), dw

    mm.defvjp(fwd, bwd)
    return mm(x, w)


def fp8_weight_matmul(x, w, names, in_dims: int, rowwise: bool):
    """weight_matmul with FP8 operands (`jaxdist.parallel.fp8`): forward x and w in e4m3, the gradient in
    e5m2, three scaled dots accumulating in float32; the weight is quantised on its shard and gathered
    quantised (1 byte per entry where the backend has FP8 collectives; XLA:CPU widens them to f16,
    tests/test_fp8.py). tensorwise: one scale per tensor, and the backward reuses the
    forward's quantised x and w. rowwise: a scale per row of what each dot keeps (x per token, w per
    output column in the forward, per input row in the input gradient's dot, x and the gradient per
    column in the weight gradient's), so the backward quantises again (w gathered once more, in FP8)."""
    I, O = x.shape[-1], math.prod(w.shape[in_dims:])
    ins, outs = tuple(range(in_dims)), tuple(range(in_dims, w.ndim))
    lead, w_dtype = x.shape[:-1], w.dtype
    # (T, I) @ (I, O), (T, O) @ (I, O)^T, (T, I)^T @ (T, O)
    fwd_dims, dx_dims, dw_dims = (((1,), (0,)), ((), ())), (((1,), (1,)), ((), ())), (((0,), (0,)), ((), ()))

    def weight(w, per):  # quantised on its shard (the amax crosses shards), then gathered in FP8
        q, s = fp8.quantize(w, fp8.E4M3, per if rowwise else None)
        return constrain(q, names), s

    def forward(x, w):
        wq, sw = weight(w, ins)
        full = gathered(wq, names)
        xq, sx = fp8.quantize(x.reshape(-1, I), fp8.E4M3, 1 if rowwise else None)
        out = fp8.scaled_dot(xq, sx, full.reshape(I, O), sw.reshape(1, -1), fwd_dims)
        return out.astype(x.dtype).reshape(*lead, *w.shape[in_dims:]), (xq, sx, full, wq, sw)

    @jax.custom_vjp
    def mm(x, w):
        return forward(x, w)[0]

    def fwd(x, w):
        out, (xq, sx, full, wq, sw) = forward(x, w)
        if rowwise:  # the backward quantises x and w along other dims
            return out, (x, w)
        return out, (xq, sx, full if _KEEP_GATHERED.get() else wq, sw)

    def bwd(res, g):
        g2 = g.reshape(-1, O)
        if rowwise:
            x, w = res
            x2 = x.reshape(-1, I)
            gq, sg = fp8.quantize(g2, fp8.E5M2, 1)
            wq, sw = weight(w, outs)
            dx = fp8.scaled_dot(gq, sg, gathered(wq, names).reshape(I, O), sw.reshape(-1, 1), dx_dims)
            xq, sx = fp8.quantize(x2, fp8.E4M3, 0)
            gq, sg = fp8.quantize(g2, fp8.E5M2, 0)
            dw = fp8.scaled_dot(xq, sx, gq, sg, dw_dims)
            dtype = x.dtype
        else:
            xq, sx, wq, sw = res
            gq, sg = fp8.quantize(g2, fp8.E5M2, None)
            dx = fp8.scaled_dot(gq, sg, gathered(wq, names).reshape(I, O), sw.reshape(1, 1), dx_dims)
            dw = fp8.scaled_dot(xq, sx, gq, sg, dw_dims)
            dtype = g.dtype
        dw = constrain(dw.reshape(w.shape if rowwise else wq.shape), names)
        return dx.astype(dtype).reshape(*lead, I), dw.astype(w_dtype)  # float32 for a master weight

    mm.defvjp(fwd, bwd)
    return mm(x, w)


def fp8_frozen_matmul(x, w, names, in_dims: int, rowwise: bool):
    """x[..., I] @ w[I..., O...] for a frozen `w` (LoRA's base: no weight gradient), with
    fp8_weight_matmul's FP8 forward and input gradient: w quantised to e4m3 on its shard (per tensor, or
    per output column forward and per input row for the input gradient) and gathered quantised, x in
    e4m3, the gradient in e5m2. The backward quantises w again (it is not a residual)."""
    I, O = x.shape[-1], math.prod(w.shape[in_dims:])
    ins, outs = tuple(range(in_dims)), tuple(range(in_dims, w.ndim))
    lead = x.shape[:-1]

    def weight(w, per):
        q, s = fp8.quantize(w, fp8.E4M3, per if rowwise else None)
        return gathered(constrain(q, names), names).reshape(I, O), s

    @jax.custom_vjp
    def mm(x, w):
        full, sw = weight(w, ins)
        xq, sx = fp8.quantize(x.reshape(-1, I), fp8.E4M3, 1 if rowwise else None)
        out = fp8.scaled_dot(xq, sx, full, sw.reshape(1, -1), (((1,), (0,)), ((), ())))
        return out.astype(x.dtype).reshape(*lead, *w.shape[in_dims:])

    def bwd(w, g):
        full, sw = weight(w, outs)
        gq, sg = fp8.quantize(g.reshape(-1, O), fp8.E5M2, 1 if rowwise else None)
        dx = fp8.scaled_dot(gq, sg, full, sw.reshape(-1, 1) if rowwise else sw.reshape(1, 1), (((1,), (1,)), ((), ())))
        return dx.astype(g.dtype).reshape(*lead, I), None

    mm.defvjp(lambda x, w: (mm(x, w), w), bwd)
    return mm(x, jax.lax.stop_gradient(w))
