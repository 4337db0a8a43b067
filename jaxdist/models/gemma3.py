"""Gemma 3 (text) in Flax NNX: the decoder skeleton of `models/llama.py` (embedding, scanned layers,
final norm, tied head) with Gemma's parts: (1 + w) RMSNorm, norms before and after attention and MLP
("sandwich"), GeGLU with tanh GELU, embeddings scaled by sqrt(d_model), q/k norms, scores scaled by
`query_pre_attn_scalar`^-1/2, and a per-layer pattern of sliding-window and full attention with a rotary
base per kind (`rope_local_theta` for the windowed layers; `rope_scaling=linear` slows the full ones).

The layer pattern is data scanned beside the weights (`layer_consts`: each layer's window, 0 = full, and
rotary frequencies), so one compiled layer serves every kind. Shapes: B batch, T sequence, D d_model,
N/K query/kv heads, H head_dim, F mlp, L layers.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdist.adapters import lora as lora_mod
from jaxdist.config import ModelConfig
from jaxdist.distributed.sharding import constrain
from jaxdist.models import decoder_layers, llama
from jaxdist.models.attention import any_window_mask, banded_attention, rope_frequencies, rotary_by

param = decoder_layers.param


class Norm(nnx.Module):
    """RMSNorm with scale 1 + w (w initialised to 0), in float32 whatever the compute dtype."""

    def __init__(self, dim: int, eps: float, rngs: nnx.Rngs, names: tuple[str | None, ...] = ("norm",)):
        self.scale = param(rngs, nnx.initializers.zeros, (dim,), names)
        self.eps = eps

    def __call__(self, x):
        y = x.astype(jnp.float32)
        y = y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + self.eps)
        return (y * (1.0 + self.scale[...])).astype(x.dtype)


def layer_windows(m: ModelConfig) -> np.ndarray:
    """(L,) each layer's window (0 = full attention): every `sliding_window_pattern`-th layer is full."""
    full = [m.sliding_window == 0 or (m.sliding_window_pattern > 0 and (i + 1) % m.sliding_window_pattern == 0)
            for i in range(m.num_layers)]  # fmt: skip
    return np.array([0 if f else m.sliding_window for f in full], np.int32)


def layer_frequencies(m: ModelConfig) -> np.ndarray:
    """(L, H/2) rotary frequencies: the windowed layers' base `rope_local_theta`, the full layers'
    `rope_theta`, divided by `rope_factor` under rope_scaling=linear (transformers' `linear`)."""
    half = m.head_dim // 2
    freq = lambda theta: float(theta) ** (-np.arange(half, dtype=np.float64) / half)  # numpy: static, traced or not
    local = freq(m.rope_local_theta or m.rope_theta)
    full = freq(m.rope_theta) / (m.rope_factor if m.rope_scaling == "linear" else 1.0)
    return np.stack([local if w else full for w in layer_windows(m)]).astype(np.float32)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        init = nnx.initializers.normal(cfg.init_std)
        out_init = nnx.initializers.normal(cfg.init_std / (2 * cfg.num_layers) ** 0.5)
        D, N, K, H = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.wq_DNH = param(rngs, init, (D, N, H), ("embed", "heads", "head_dim"))
        self.wk_DKH = param(rngs, init, (D, K, H), ("embed", "kv_heads", "head_dim"))
        self.wv_DKH = param(rngs, init, (D, K, H), ("embed", "kv_heads", "head_dim"))
        self.wo_NHD = param(rngs, out_init, (N, H, D), ("heads", "head_dim", "embed"))
        self.q_norm = Norm(H, cfg.norm_eps, rngs, ("head_dim",))
        self.k_norm = Norm(H, cfg.norm_eps, rngs, ("head_dim",))
        self.scale = float(cfg.query_pre_attn_scalar or H) ** -0.5

    def qkv(self, x_BTD, positions_T, freq_H):
        q_BTNH = lora_mod.project(self, "wq_DNH", x_BTD, ("embed", "heads", "head_dim"))
        k_BTKH = lora_mod.project(self, "wk_DKH", x_BTD, ("embed", "kv_heads", "head_dim"))
        v_BTKH = lora_mod.project(self, "wv_DKH", x_BTD, ("embed", "kv_heads", "head_dim"))
        q_BTNH = rotary_by(self.q_norm(q_BTNH), positions_T, freq_H)
        k_BTKH = rotary_by(self.k_norm(k_BTKH), positions_T, freq_H)
        q_BTNH = constrain(q_BTNH, ("batch", "seq", "heads", None))
        k_BTKH = constrain(k_BTKH, ("batch", "seq", "kv_heads", None))
        return q_BTNH, k_BTKH, v_BTKH

    def out(self, o_BTNH):
        B, T, N, H = o_BTNH.shape
        return lora_mod.project(self, "wo_NHD", o_BTNH.reshape(B, T, N * H), ("heads", "head_dim", "embed"), in_dims=2)

    def __call__(self, x_BTD, positions_T, segment_ids_BT, window, freq_H):
        q_BTNH, k_BTKH, v_BTKH = self.qkv(x_BTD, positions_T, freq_H)
        return self.out(banded_attention(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, window, self.scale))

    def cached(self, x_BTD, positions_BT, k_BSKH, v_BSKH, index, mask_BTS, window, freq_H):
        """Decoding (as decoder_layers.Attention.cached): the full-length cache, masked to the layer's window."""
        q_BTNH, k_BTKH, v_BTKH = self.qkv(x_BTD, positions_BT, freq_H)
        k_BSKH = jax.lax.dynamic_update_slice_in_dim(k_BSKH, k_BTKH.astype(k_BSKH.dtype), index, axis=1)
        v_BSKH = jax.lax.dynamic_update_slice_in_dim(v_BSKH, v_BTKH.astype(v_BSKH.dtype), index, axis=1)
        T, S = x_BTD.shape[1], k_BSKH.shape[1]
        mask_BTS = mask_BTS & any_window_mask(index + jnp.arange(T), jnp.arange(S), window)[None]
        o_BTNH = jax.nn.dot_product_attention(
            q_BTNH, k_BSKH.astype(q_BTNH.dtype), v_BSKH.astype(q_BTNH.dtype), mask=mask_BTS[:, None], scale=self.scale
        )
        return self.out(o_BTNH), k_BSKH, v_BSKH


class MLP(decoder_layers.MLP):
    """GeGLU: gelu_tanh(x W_gate) * (x W_up), then W_down (LoRA targets gate, up, down as the decoder's)."""

    def __call__(self, x_BTD):
        gate_BTF = lora_mod.project(self, "w_gate_DF", x_BTD, ("embed", "mlp"))
        up_BTF = lora_mod.project(self, "w_up_DF", x_BTD, ("embed", "mlp"))
        h_BTF = constrain(jax.nn.gelu(gate_BTF, approximate=True) * up_BTF, ("batch", "seq", "mlp"))
        return lora_mod.project(self, "w_down_FD", h_BTF, ("mlp", "embed"))


class Block(nnx.Module):
    """x + post(attn(pre(x))), then the same around the MLP. `consts` = (window, freq_H) of this layer;
    without them (the planner's traced layer) a full-attention layer."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        D, eps = cfg.d_model, cfg.norm_eps
        self.attn_norm, self.attn, self.attn_post_norm = Norm(D, eps, rngs), Attention(cfg, rngs), Norm(D, eps, rngs)
        self.mlp_norm, self.mlp, self.mlp_post_norm = Norm(D, eps, rngs), MLP(cfg, rngs), Norm(D, eps, rngs)
        self.sparse = False
        self.half, self.theta = cfg.head_dim // 2, cfg.rope_theta  # static: the layer without consts

    def _consts(self, consts):
        return consts if consts is not None else (jnp.int32(0), rope_frequencies(self.half, self.theta))

    def __call__(self, x_BTD, positions_T, segment_ids_BT=None, consts=None):
        window, freq_H = self._consts(consts)
        x_BTD = x_BTD + self.attn_post_norm(
            self.attn(self.attn_norm(x_BTD), positions_T, segment_ids_BT, window, freq_H)
        )
        x_BTD = x_BTD + self.mlp_post_norm(self.mlp(self.mlp_norm(x_BTD)))
        return constrain(x_BTD, ("batch", "seq", None))

    def cached(self, x_BTD, positions_BT, k_BSKH, v_BSKH, index, mask_BTS, consts=None):
        window, freq_H = self._consts(consts)
        a_BTD, k_BSKH, v_BSKH = self.attn.cached(
            self.attn_norm(x_BTD), positions_BT, k_BSKH, v_BSKH, index, mask_BTS, window, freq_H
        )
        x_BTD = x_BTD + self.attn_post_norm(a_BTD)
        x_BTD = x_BTD + self.mlp_post_norm(self.mlp(self.mlp_norm(x_BTD)))
        return constrain(x_BTD, ("batch", "seq", None)), k_BSKH, v_BSKH


class Gemma3(llama.Llama):
    """`model(tokens_BT) -> logits_BTV`, as `llama.Llama`, with Gemma 3's parts."""

    Norm = Norm

    def unit(self, cfg: ModelConfig):
        return Block, cfg.num_layers

    def embed_factor(self) -> float:
        return self.cfg.d_model**0.5  # transformers: the scale in the embedding's dtype (float32 here)

    def layer_consts(self):
        return jnp.asarray(layer_windows(self.cfg)), jnp.asarray(layer_frequencies(self.cfg))


Model = Gemma3


def count_params(cfg: ModelConfig) -> dict[str, int]:
    """Exact parameter counts by group: the decoder's with q/k norms, plus two more norms per layer."""
    # The decoder's shape with Gemma's fixed parts (q/k norms, no biases, dense).
    counts = llama.count_params(dataclasses.replace(cfg, qk_norm=True, qkv_bias=False, moe_experts=0))
    extra = cfg.num_layers * 2 * cfg.d_model
    return {**counts, "layers": counts["layers"] + extra, "total": counts["total"] + extra,
            "active": counts["active"] + extra}  # fmt: skip
