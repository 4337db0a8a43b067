"""FP8 arithmetic for the layers' matmuls (`model.fp8`): current-scaling quantisation and the scaled dot.

An operand is quantised as q = x / s in an FP8 type, with s = amax / (the type's largest value) taken
over the whole tensor (`tensorwise`) or over the contracted dim, one scale per row of what is kept
(`rowwise`), as torchtitan's float8 recipes of those names do. A dot of two FP8 operands accumulates
in float32 and is rescaled by the outer product of the two scales — exact algebra, since a scale that
is constant along the contracted dim factors out of the sum. That dot-of-converts-then-scale is the
pattern XLA:GPU rewrites into a cuBLASLt FP8 GEMM; XLA:CPU upcasts the operands (same numbers, no
speed). Forward operands are e4m3 (largest 448), gradients e5m2 (largest 57344).

JAX's own dot on FP8 operands, not qwix: qwix intercepts `dot_general` inside modules, after
`parallel/matmul.py` has already gathered the weight and chosen its residuals, so it could neither
gather the weight in FP8 nor put e5m2 gradients into the custom backward that keeps weight gradients
in float32. `mxfp8` (block-32 power-of-two scales) is `jax.nn.scaled_dot_general`'s, on hardware that
has it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxdist.errors import JaxdistError

E4M3 = jnp.float8_e4m3fn  # forward operands: weights and activations
E5M2 = jnp.float8_e5m2  # gradients: wider range, fewer mantissa bits
MODES = ("off", "tensorwise", "rowwise", "mxfp8")


def quantize(x, dtype, axis: int | None):
    """(q, scale): q = x / scale in `dtype`, scale = amax(|x|) / dtype's max in float32, over the whole
    tensor (`axis` None) or along `axis` (kept with size 1, so it broadcasts back); 1 where amax is 0.
    The scale carries no gradient: the callers' custom backwards pass gradients straight through."""
    x32 = jax.lax.stop_gradient(x).astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=axis, keepdims=True)
    top = float(jnp.finfo(dtype).max)
    scale = jnp.where(amax > 0, amax / top, 1.0)
    return jnp.clip(x32 / scale, -top, top).astype(dtype), scale


def scaled_dot(a, a_scale, b, b_scale, dimension_numbers):
    """dot_general of two FP8 operands in float32, times their scales. Each scale must be constant along
    the contracted dims (a size-1 dim there), so it factors out of the sum; `a_scale`'s kept dims come
    first in the result, then `b_scale`'s (dot_general's order; no batch dims)."""
    (ca, cb), _ = dimension_numbers
    out = jax.lax.dot_general(a, b, dimension_numbers, preferred_element_type=jnp.float32)
    sa = jnp.squeeze(a_scale, axis=tuple(ca))
    sb = jnp.squeeze(b_scale, axis=tuple(cb))
    return out * sa.reshape(sa.shape + (1,) * sb.ndim) * sb


def mx_matmul(x, w):
    """x[..., I] @ w[I, ...] with MXFP8 operands (block-32 e8m0 scales along I, JAX's own recipe and
    backward: `jax.nn.scaled_dot_general`), float32 accumulation, in x's dtype. XLA:CPU cannot lower it."""
    configs = [jax.nn.get_scaled_dot_general_config("mxfp8")] * 3
    x2, w2 = x.reshape(-1, x.shape[-1]), w.reshape(x.shape[-1], -1)
    out = jax.nn.scaled_dot_general(x2, w2, (((1,), (0,)), ((), ())), configs=configs)
    return out.astype(x.dtype).reshape(*x.shape[:-1], *w.shape[1:])


def check(cfg, mesh) -> None:
    """`model.fp8` against the rest of the config and the hardware, as one-line errors."""
    m = cfg.model
    if m.fp8 == "off":
        return
    if m.moe_experts and m.family == "gpt_oss":
        raise JaxdistError(
            f"model.fp8={m.fp8} with model.family=gpt_oss: its biased clamped-SwiGLU experts have no FP8 path; "
            "use model.fp8=off"
        )
    if m.moe_experts and m.fp8 == "mxfp8":
        raise JaxdistError(
            "model.fp8=mxfp8 with model.moe_experts > 0: the experts' matmuls are FP8 with tensorwise or rowwise "
            "scales only; use model.fp8=tensorwise or rowwise"
        )
    if mesh.shape.get("cp", 1) > 1:
        raise JaxdistError(
            f"model.fp8={m.fp8} with cp > 1: FP8 matmuls flatten (batch, seq), which context parallelism splits; "
            "use model.fp8=off, or dp/fsdp/tp/pp"
        )
    if cfg.lora.rank and m.fp8 == "mxfp8":
        raise JaxdistError(
            "model.fp8=mxfp8 with lora.rank > 0: the frozen base's matmuls are FP8 with tensorwise or rowwise "
            "scales only; use model.fp8=tensorwise or rowwise"
        )
    if m.fp8 == "mxfp8" and any(d % 32 for d in (m.d_model, m.num_heads * m.head_dim, m.mlp_dim)):
        raise JaxdistError(
            "model.fp8=mxfp8 scales blocks of 32 along each matmul's inner dim: model.d_model, num_heads x head_dim "
            "and mlp_dim must be multiples of 32; use model.fp8=tensorwise or rowwise"
        )
    if m.fp8 == "mxfp8" and isinstance(mesh, jax.sharding.Mesh):  # the devices it runs on (not the planner's)
        d = mesh.devices.flat[0]
        cc = str(getattr(d, "compute_capability", "") or "")
        if d.platform != "gpu" or not cc.split(".")[0].isdigit() or int(cc.split(".")[0]) < 10:
            raise JaxdistError(
                f"model.fp8=mxfp8 needs block-scaled FP8 matmuls in hardware (NVIDIA Blackwell, compute "
                f"capability 10.0 or later); this machine's devices are {d.platform} {d.device_kind}"
                f"{f' (compute capability {cc})' if cc else ''}; use model.fp8=tensorwise or rowwise"
            )
