"""gpt-oss in Flax NNX: the decoder skeleton of `models/llama.py` (embedding, scanned layers, final norm,
untied head) with gpt-oss's parts: biased q/k/v/o projections, a learned logit per head in the softmax
denominator ("attention sink": probabilities over the keys sum to less than 1), alternating sliding-window
(even layers) and full attention (the window scanned beside the weights, 0 = full, as Gemma 3's), YaRN
rotary (`gpt_oss_hf.yarn_frequencies`: blended frequencies, cos/sin x the attention factor), and an MoE
feed-forward whose router has a bias and whose experts have biases and the clamped SwiGLU
`(clip(up, -l, l) + 1) · g·sigmoid(alpha·g)`, g = min(gate, l), gate and up interleaved in one matrix.

The experts are computed densely: every token through every expert, the unchosen ones weighted 0
(exact, E/K times the routed FLOPs); their weights carry the logical `expert` axis, so an ep mesh holds
each device's experts and XLA reduces the weighted sum over ep. jaxdist's token dispatch
(`parallel/moe.py`) has no biased or clamped expert yet. Shapes: B batch, T sequence, S key slots,
D d_model, N/K query/kv heads, G = N/K, H head_dim, E experts, F expert inner dim.
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
from jaxdist.models import decoder_layers, gpt_oss_hf, llama, moe
from jaxdist.models.attention import any_window_mask, document_mask, rotary_by

param = decoder_layers.param


def sink_attention(q_BTNH, k_BSKH, v_BSKH, mask_BTS, sinks_N, scale: float):
    """Grouped-query attention whose softmax denominator also holds exp(sink) per head (transformers'
    eager gpt-oss attention); `mask_BTS` (B or 1, T, S) True where a query sees a key."""
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    q_BTKGH = q_BTNH.reshape(B, T, K, N // K, H)
    s_BKGTS = jnp.einsum("btkgh,bskh->bkgts", q_BTKGH, k_BSKH, preferred_element_type=jnp.float32) * scale
    s_BKGTS = jnp.where(mask_BTS[:, None, None], s_BKGTS, jnp.finfo(jnp.float32).min)
    sink_BKGT1 = jnp.broadcast_to(sinks_N.astype(jnp.float32).reshape(1, K, N // K, 1, 1), (*s_BKGTS.shape[:-1], 1))
    p_BKGTS = jax.nn.softmax(jnp.concatenate([s_BKGTS, sink_BKGT1], axis=-1), axis=-1)[..., :-1]
    o_BTKGH = jnp.einsum("bkgts,bskh->btkgh", p_BKGTS.astype(v_BSKH.dtype), v_BSKH)
    return o_BTKGH.reshape(B, T, N, H)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        init, zeros = nnx.initializers.normal(cfg.init_std), nnx.initializers.zeros
        out_init = nnx.initializers.normal(cfg.init_std / (2 * cfg.num_layers) ** 0.5)
        D, N, K, H = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.wq_DNH = param(rngs, init, (D, N, H), ("embed", "heads", "head_dim"))
        self.bq_NH = param(rngs, zeros, (N, H), ("heads", "head_dim"))
        self.wk_DKH = param(rngs, init, (D, K, H), ("embed", "kv_heads", "head_dim"))
        self.bk_KH = param(rngs, zeros, (K, H), ("kv_heads", "head_dim"))
        self.wv_DKH = param(rngs, init, (D, K, H), ("embed", "kv_heads", "head_dim"))
        self.bv_KH = param(rngs, zeros, (K, H), ("kv_heads", "head_dim"))
        self.wo_NHD = param(rngs, out_init, (N, H, D), ("heads", "head_dim", "embed"))
        self.bo_D = param(rngs, zeros, (D,), ("embed",))
        self.sinks_N = param(rngs, zeros, (N,), ("heads",))
        freqs, self.rope_gain = gpt_oss_hf.yarn_frequencies(cfg)
        self.freqs = tuple(freqs)  # static (hashable): a numpy constant in the program
        self.scale = H**-0.5

    def qkv(self, x_BTD, positions):
        dt = x_BTD.dtype
        q_BTNH = lora_mod.project(self, "wq_DNH", x_BTD, ("embed", "heads", "head_dim")) + self.bq_NH[...].astype(dt)
        k_BTKH = lora_mod.project(self, "wk_DKH", x_BTD, ("embed", "kv_heads", "head_dim")) + self.bk_KH[...].astype(dt)
        v_BTKH = lora_mod.project(self, "wv_DKH", x_BTD, ("embed", "kv_heads", "head_dim")) + self.bv_KH[...].astype(dt)
        freq_H = np.asarray(self.freqs, np.float32)
        q_BTNH = rotary_by(q_BTNH, positions, freq_H) * jnp.asarray(self.rope_gain, dt)
        k_BTKH = rotary_by(k_BTKH, positions, freq_H) * jnp.asarray(self.rope_gain, dt)
        q_BTNH = constrain(q_BTNH, ("batch", "seq", "heads", None))
        k_BTKH = constrain(k_BTKH, ("batch", "seq", "kv_heads", None))
        return q_BTNH, k_BTKH, v_BTKH

    def out(self, o_BTNH):
        B, T, N, H = o_BTNH.shape
        y_BTD = lora_mod.project(self, "wo_NHD", o_BTNH.reshape(B, T, N * H), ("heads", "head_dim", "embed"), in_dims=2)
        return y_BTD + self.bo_D[...].astype(y_BTD.dtype)

    def __call__(self, x_BTD, positions_T, segment_ids_BT, window):
        q_BTNH, k_BTKH, v_BTKH = self.qkv(x_BTD, positions_T)
        t = jax.lax.iota(jnp.int32, x_BTD.shape[1])
        mask_1TS = ((t[:, None] >= t[None, :]) & any_window_mask(t, t, window))[None]
        doc = document_mask(segment_ids_BT)
        mask_BTS = mask_1TS if doc is None else mask_1TS & doc[:, 0]
        return self.out(sink_attention(q_BTNH, k_BTKH, v_BTKH, mask_BTS, self.sinks_N[...], self.scale))

    def cached(self, x_BTD, positions_BT, k_BSKH, v_BSKH, index, mask_BTS, window):
        """Decoding (as decoder_layers.Attention.cached): the full-length cache, masked to the layer's window."""
        q_BTNH, k_BTKH, v_BTKH = self.qkv(x_BTD, positions_BT)
        k_BSKH = jax.lax.dynamic_update_slice_in_dim(k_BSKH, k_BTKH.astype(k_BSKH.dtype), index, axis=1)
        v_BSKH = jax.lax.dynamic_update_slice_in_dim(v_BSKH, v_BTKH.astype(v_BSKH.dtype), index, axis=1)
        T, S = x_BTD.shape[1], k_BSKH.shape[1]
        mask_BTS = mask_BTS & any_window_mask(index + jnp.arange(T), jnp.arange(S), window)[None]
        dt = q_BTNH.dtype
        o_BTNH = sink_attention(q_BTNH, k_BSKH.astype(dt), v_BSKH.astype(dt), mask_BTS, self.sinks_N[...], self.scale)
        return self.out(o_BTNH), k_BSKH, v_BSKH


class Experts(nnx.Module):
    """Router (with bias) -> top-K -> softmax over the chosen logits; biased clamped-SwiGLU experts."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        init, zeros = nnx.initializers.normal(cfg.init_std), nnx.initializers.zeros
        out_init = nnx.initializers.normal(cfg.init_std / (2 * cfg.num_layers) ** 0.5)
        E, D, F = cfg.moe_experts, cfg.d_model, moe.expert_dim(cfg)
        self.router_DE = param(rngs, init, (D, E), ("embed", None))
        self.router_bias_E = param(rngs, zeros, (E,), (None,))
        self.w_gate_up_EDG = param(rngs, init, (E, D, 2 * F), ("expert", "embed", "mlp"))
        self.b_gate_up_EG = param(rngs, zeros, (E, 2 * F), ("expert", "mlp"))
        self.w_down_EFD = param(rngs, out_init, (E, F, D), ("expert", "mlp", "embed"))
        self.b_down_ED = param(rngs, zeros, (E, D), ("expert", "embed"))
        self.topk, self.alpha, self.limit = cfg.moe_topk, cfg.swiglu_alpha, cfg.swiglu_limit
        self.weights = (cfg.moe_aux_weight, cfg.moe_z_weight)

    def __call__(self, x_BTD):
        """-> (y_BTD, aux) with moe.MoE's aux sums (balance and z losses, loads per expert)."""
        dt, B, E = x_BTD.dtype, x_BTD.shape[0], self.router_DE.shape[1]
        logits_BTE = x_BTD.astype(jnp.float32) @ self.router_DE[...] + self.router_bias_E[...]
        idx_BTK, gate_BTK = moe.route(logits_BTE, self.topk, "softmax", True)
        onehot_BTKE = jax.nn.one_hot(idx_BTK, E, dtype=jnp.float32)
        w_BTE = jnp.einsum("btke,btk->bte", onehot_BTKE, gate_BTK).astype(dt)
        w_EDG, w_EFD = lora_mod.fused_expert_weights(self)  # with expert adapters (LoRA): base + delta
        h_BTEG = jnp.einsum("btd,edg->bteg", x_BTD, w_EDG.astype(dt)) + self.b_gate_up_EG[...].astype(dt)
        h_BTEF2 = h_BTEG.reshape(*h_BTEG.shape[:-1], -1, 2)
        gate, up = jnp.minimum(h_BTEF2[..., 0], self.limit), jnp.clip(h_BTEF2[..., 1], -self.limit, self.limit)
        a_BTEF = (up + 1) * (gate * jax.nn.sigmoid(gate * self.alpha))
        y_BTD = jnp.einsum("btef,efd->btd", a_BTEF * w_BTE[..., None], w_EFD.astype(dt))
        y_BTD = y_BTD + jnp.einsum("bte,ed->btd", w_BTE, self.b_down_ED[...].astype(dt))
        counts_BE = onehot_BTKE.sum((1, 2))
        lb = moe.balance_loss_sum(counts_BE, logits_BTE, self.topk, "softmax")
        z = jnp.sum(jnp.square(jax.nn.logsumexp(logits_BTE, axis=-1)))
        aux = {
            "objective": self.weights[0] * lb + self.weights[1] * z,
            "moe_aux_loss": lb,
            "moe_z_loss": z,
            "moe_dropped": jnp.zeros((B,), jnp.int32).sum(),
            "moe_load": counts_BE.sum(0),
        }
        return constrain(y_BTD, ("batch", "seq", None)), aux


class Block(nnx.Module):
    """x + attn(norm(x)), then x + experts(norm(x)); `consts` = this layer's window (None: full)."""

    lora_experts = True  # LoRA's gate/up/down targets are the experts' gate_up_proj and down_proj (as peft's)

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.attn_norm, self.attn = decoder_layers.RMSNorm(cfg.d_model, cfg.norm_eps, rngs), Attention(cfg, rngs)
        self.mlp_norm, self.mlp = decoder_layers.RMSNorm(cfg.d_model, cfg.norm_eps, rngs), Experts(cfg, rngs)
        self.sparse = True

    def __call__(self, x_BTD, positions_T, segment_ids_BT=None, consts=None):
        window = jnp.int32(0) if consts is None else consts
        x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD), positions_T, segment_ids_BT, window)
        y_BTD, aux = self.mlp(self.mlp_norm(x_BTD))
        return constrain(x_BTD + y_BTD, ("batch", "seq", None)), aux

    def cached(self, x_BTD, positions_BT, k_BSKH, v_BSKH, index, mask_BTS, consts=None):
        window = jnp.int32(0) if consts is None else consts
        a_BTD, k_BSKH, v_BSKH = self.attn.cached(
            self.attn_norm(x_BTD), positions_BT, k_BSKH, v_BSKH, index, mask_BTS, window
        )
        x_BTD = x_BTD + a_BTD
        x_BTD = x_BTD + self.mlp(self.mlp_norm(x_BTD))[0]
        return constrain(x_BTD, ("batch", "seq", None)), k_BSKH, v_BSKH


class GptOss(llama.Llama):
    """`model(tokens_BT) -> logits_BTV`, `model.loss_head(tokens_BT) -> (loss.Head, aux)`:
    as `llama.Llama` with MoE layers, with gpt-oss's parts."""

    def unit(self, cfg: ModelConfig):
        return Block, cfg.num_layers

    def layer_consts(self):
        return jnp.asarray(gpt_oss_hf.layer_windows(self.cfg), jnp.int32)


Model = GptOss


def count_params(cfg: ModelConfig) -> dict[str, int]:
    """Exact parameter counts by group: the decoder's with q/k/v biases and MoE layers, plus o_proj's
    bias and the sinks per layer, the router's bias and the experts' biases."""
    counts = llama.count_params(
        dataclasses.replace(cfg, qk_norm=False, qkv_bias=True, moe_every=1, moe_shared_experts=0)
    )
    E, K, F, D, L = cfg.moe_experts, cfg.moe_topk, moe.expert_dim(cfg), cfg.d_model, cfg.num_layers
    always = L * (D + cfg.num_heads + E)  # o bias, sinks, router bias
    experts = L * E * (2 * F + D)  # gate_up and down biases
    active = L * K * (2 * F + D)
    return {**counts, "layers": counts["layers"] + always + experts, "total": counts["total"] + always + experts,
            "active": counts["active"] + always + active}  # fmt: skip
