"""The LoRA train state's parameter tree: adapters (trained) apart from the frozen base, the base
stored in its dtype (float32, bfloat16, or int8 / NF4 blocks), and the adapters merged back into
plain weights. Pure functions over the nested parameter dicts (stacked or pipeline-staged alike).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxdist.adapters import quant
from jaxdist.adapters.lora import GATE_UP, IN_DIMS, SCALE, A, B, block_axis, expert_scales
from jaxdist.adapters.lora import scaling as lora_scaling


def is_adapter(key: str) -> bool:
    return key.endswith(A) or key.endswith(B)


def _filter(tree: dict, keep) -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            sub = _filter(v, keep)
            if sub:
                out[k] = sub
        elif keep(k):
            out[k] = v
    return out


def trainable(tree: dict) -> dict:
    """The adapters alone (the same nesting): what gradients, the optimizer and its state cover."""
    return _filter(tree, is_adapter)


def frozen(tree: dict) -> dict:
    return _filter(tree, lambda k: not is_adapter(k))


def combine(a: dict, b: dict) -> dict:
    """Deep union of two nested dicts, `a`'s entry kept where both have one: adapters + base, or an
    imported base + fresh parameters filling what it lacks (new adapters, scales)."""
    out = dict(b)
    for k, v in a.items():
        out[k] = combine(v, b[k]) if isinstance(v, dict) and isinstance(b.get(k), dict) else v
    return out


def store_base(params: dict, lora) -> dict:
    """Float32 parameters (adapters included) -> as the LoRA train state keeps them: adapters float32;
    layer matrices with a scale slot quantised (codes, per-block scales); every other frozen tensor in
    `lora.base_dtype` (bfloat16 for int8 / NF4, as QLoRA keeps what it does not quantise)."""
    dense = jnp.bfloat16 if lora.base_dtype in quant.KINDS else jnp.dtype(lora.base_dtype)

    def walk(tree: dict) -> dict:
        out = {}
        for k, v in tree.items():
            if isinstance(v, dict):
                out[k] = walk(v)
            elif is_adapter(k):
                out[k] = v
            elif k.endswith(SCALE):
                continue  # written with its weight
            elif k + SCALE in tree:
                out[k], out[k + SCALE] = quant.quantize(v, lora.base_dtype, block_axis(k), lora.block_size)
            else:
                out[k] = v.astype(dense)
        return out

    return walk(params)


def merge(params: dict, lora) -> dict:
    """The stored LoRA parameters -> plain float32 parameters of the same model without LoRA: every
    base tensor de-quantised / cast up, each adapted matrix W + (alpha / r) A B (rsLoRA: alpha / sqrt(r))."""
    scaling = lora_scaling(lora)

    def walk(tree: dict) -> dict:
        out = {}
        for k, v in tree.items():
            if isinstance(v, dict):
                out[k] = walk(v)
            elif is_adapter(k) or k.endswith(SCALE):
                continue
            else:
                w = v
                if k + SCALE in tree:
                    w = quant.dequantize(v, tree[k + SCALE], block_axis(k), jnp.float32)
                w = w.astype(jnp.float32)
                if k in ("w_gate_EDF", "w_up_EDF") and GATE_UP + A in tree:  # DeepSeek-V3's fused gate/up experts
                    a, b = tree[GATE_UP + A].astype(jnp.float32), tree[GATE_UP + B].astype(jnp.float32)
                    d = jnp.einsum("...dr,...rhf->...hdf", a, b, precision=jax.lax.Precision.HIGHEST)
                    w = w + expert_scales(lora)[0] * d[..., 0 if k == "w_gate_EDF" else 1, :, :]
                elif k + A in tree:
                    s = expert_scales(lora)[1] if k == "w_down_EFD" else scaling
                    w = w + s * delta(tree[k + A], tree[k + B], IN_DIMS.get(k, 1)).reshape(w.shape)
                out[k] = w
        return out

    return walk(params)


def delta(a, b, in_dims: int):
    """A B for stacked adapters: a (*lead, *in, r), b (*lead, r, *out) -> (*lead, prod(in), prod(out))."""
    r = a.shape[-1]
    lead = a.shape[: a.ndim - in_dims - 1]
    a2 = a.reshape(*lead, -1, r).astype(jnp.float32)
    b2 = b.reshape(*lead, r, -1).astype(jnp.float32)
    return jnp.einsum("...ir,...ro->...io", a2, b2, precision=jax.lax.Precision.HIGHEST)
