"""Sparse mixture-of-experts feed-forward block: linear router, top-K gating, SwiGLU experts.

Shapes: B batch, T sequence, D d_model, E experts, K chosen per token, F expert inner dim.
The router scores each token (softmax, or sigmoid as in DeepSeek-V3), keeps its K best experts and
renormalises their scores into gates that sum to 1. Expert weights carry the logical `expert` axis
(rule `expert -> ep`); `jaxdist.parallel.moe` sends tokens to their experts and back.
Optional shared experts (DeepSeek) see every token; S of them are one SwiGLU of inner dim S·F.

Auxiliary losses, returned as token-weighted sums so that micro-batch / replica sums add up exactly:
- load balancing (Switch, Fedus et al. 2021, eq. 4): E · sum_e f_e · P_e, with f_e the fraction of
  the K·T assignments routed to e and P_e the mean router probability of e. It is computed per
  sequence (as DeepSeek-V3's sequence-wise balance loss), which makes it independent of how the batch
  is split over micro-batches or devices.
- router z-loss (ST-MoE, Zoph et al. 2022): logsumexp of the router logits, squared, per token.
Both are averaged over the MoE layers and weighted by `model.moe_aux_weight` / `model.moe_z_weight`.

Routing at initialisation. Which experts a token picks depends only on the direction of its router
input (top-K of a linear map is unchanged by scaling the router), so the router's init scale cannot
balance it. What unbalances it is the residual stream: with embeddings at std 0.02 and every layer
reading RMS-normalised input, the first layers add outputs as large as the embeddings, and attention
at init averages over the causal prefix, so those outputs are largely shared by a sequence's tokens.
In tiny-moe at init (random tokens) the per-sequence mean carries 6% of the router input's energy at
layer 0 and 64% at layer 3, and the fullest expert takes 59-127 of a device's 128 tokens there (32 is
balanced; 8 random sequences, `python scripts/studies/moe_init_routing.py`). Embeddings at std 1 (`model.embed_init_std=1.0`, torchtitan's init) keep the tokens
distinct, but Adam moves such a table ~50x slower relative to its size, and that alone costs dense
tiny as much eval loss as tiny-moe trails it by (docs/moe.md's study). tiny-moe keeps tiny's 0.02
table and multiplies its output by `model.embed_scale` = sqrt(d_model) = 16 (Vaswani et al. 2017,
Gemma): an effective std of 0.32 keeps the router's inputs apart (tests/test_moe.py: the fullest
expert within twice the balanced load at every layer), and the table learns at dense tiny's pace.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdist.adapters import lora as lora_mod
from jaxdist.config import ModelConfig
from jaxdist.distributed.sharding import constrain
from jaxdist.parallel import matmul
from jaxdist.parallel.moe import expert_ffn

EXPERT_NAMES = ("expert", "embed", "mlp")


def expert_dim(cfg: ModelConfig) -> int:
    return cfg.moe_mlp_dim or cfg.mlp_dim


def _param(rngs, init, shape, names):
    return nnx.Param(init(rngs.params(), shape, jnp.float32), out_sharding=names, eager_sharding=False)


def _matmul(x, w):  # tokens flattened: a 2-D matmul (see mixed.token_matmul)
    return (x.reshape(-1, x.shape[-1]) @ w).reshape(*x.shape[:-1], w.shape[-1])


def _shared_matmul(x, w, names):
    """A shared expert's matmul: under model.fp8 (tensorwise, rowwise) the dense layers' FP8 matmul
    (w arrives cast to the compute dtype on its shard by the layer scan), else in the compute dtype."""
    mode = matmul.fp8_mode()
    if mode in ("tensorwise", "rowwise"):
        return matmul.fp8_weight_matmul(x, w, names, 1, mode == "rowwise")
    return _matmul(x, w.astype(x.dtype))


def scores(logits_BTE, router: str):
    return jax.nn.softmax(logits_BTE, axis=-1) if router == "softmax" else jax.nn.sigmoid(logits_BTE)


def route(logits_BTE, topk: int, router: str, norm: bool = True):
    """-> (expert ids (B,T,K), gates (B,T,K)): the K best scores, renormalised to sum to 1 (`norm`;
    Qwen3-MoE's norm_topk_prob=false keeps the softmax probabilities as they are)."""
    top_BTK, idx_BTK = jax.lax.top_k(scores(logits_BTE, router), topk)
    return idx_BTK, top_BTK / jnp.sum(top_BTK, axis=-1, keepdims=True) if norm else top_BTK


def balance_loss_sum(counts_BE, logits_BTE, topk: int, router: str):
    """Per-sequence Switch loss E·sum_e f_e P_e, summed over sequences with weight T (token-weighted).
    counts_BE: assignments per sequence and expert; P from the scores normalised per token."""
    T, E = logits_BTE.shape[1], logits_BTE.shape[2]
    s_BTE = scores(logits_BTE, router)
    p_BE = (s_BTE / jnp.sum(s_BTE, axis=-1, keepdims=True)).mean(1)
    return T * E * jnp.sum(counts_BE / (T * topk) * p_BE)


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        init = nnx.initializers.normal(cfg.init_std)
        out_init = nnx.initializers.normal(cfg.init_std / (2 * cfg.num_layers) ** 0.5)
        E, D, F = cfg.moe_experts, cfg.d_model, expert_dim(cfg)
        self.router_DE = _param(rngs, init, (D, E), ("embed", None))
        self.w_gate_EDF = _param(rngs, init, (E, D, F), EXPERT_NAMES)
        self.w_up_EDF = _param(rngs, init, (E, D, F), EXPERT_NAMES)
        self.w_down_EFD = _param(rngs, out_init, (E, F, D), ("expert", "mlp", "embed"))
        if cfg.moe_shared_experts:
            S = cfg.moe_shared_experts * F
            self.shared_gate_DS = _param(rngs, init, (D, S), ("embed", "mlp"))
            self.shared_up_DS = _param(rngs, init, (D, S), ("embed", "mlp"))
            self.shared_down_SD = _param(rngs, out_init, (S, D), ("mlp", "embed"))
        self.topk, self.router, self.shared = cfg.moe_topk, cfg.moe_router, cfg.moe_shared_experts
        self.norm_topk = cfg.moe_norm_topk
        self.factor = None if cfg.moe_dispatch == "dropless" else cfg.moe_capacity_factor
        self.weights = (cfg.moe_aux_weight, cfg.moe_z_weight)

    def __call__(self, x_BTD, route_fn=None, route_args=()):
        """-> (y_BTD, aux): aux sums over this call's tokens (see `combine_layers`). `route_fn`: another
        router's (logits_BTE, *route_args -> (ids, gates)), e.g. DeepSeek-V3's group-limited one with its
        selection bias as `route_args` (models/deepseek3.py)."""
        logits_BTE = _matmul(x_BTD.astype(jnp.float32), self.router_DE[...])
        route_fn = route_fn or functools.partial(route, topk=self.topk, router=self.router, norm=self.norm_topk)
        w_gate, w_up, w_down = lora_mod.expert_weights(self)  # with expert adapters (LoRA): base + delta
        y_BTD, dropped_B, counts_BE = expert_ffn(
            x_BTD,
            logits_BTE,
            w_gate,
            w_up,
            w_down,
            EXPERT_NAMES,
            self.factor,
            route_fn,
            *((route_args,) if route_args else ()),  # only when given: tests swap in a reference expert_ffn
        )
        if self.shared:
            up = ("embed", "mlp")
            h = jax.nn.silu(_shared_matmul(x_BTD, self.shared_gate_DS[...], up))
            h = constrain(h * _shared_matmul(x_BTD, self.shared_up_DS[...], up), ("batch", "seq", "mlp"))
            y_BTD = y_BTD + _shared_matmul(h, self.shared_down_SD[...], ("mlp", "embed"))
        lb = balance_loss_sum(counts_BE, logits_BTE, self.topk, self.router)
        z = jnp.sum(jnp.square(jax.nn.logsumexp(logits_BTE, axis=-1)))
        aux = {
            "objective": self.weights[0] * lb + self.weights[1] * z,
            "moe_aux_loss": lb,
            "moe_z_loss": z,
            "moe_dropped": dropped_B.sum(),
            "moe_load": counts_BE.sum(0),
        }
        return y_BTD, aux


def combine_layers(aux_L):
    """Per-layer aux (leading layer axis) -> the model's: losses averaged over MoE layers, dropped
    assignments summed, expert loads kept per layer (L, E)."""
    out = {k: v.mean(0) for k, v in aux_L.items() if k in ("objective", "moe_aux_loss", "moe_z_loss")}
    return {**out, "moe_dropped": aux_L["moe_dropped"].sum(), "moe_load": aux_L["moe_load"]}


def metrics_from_sums(stats: dict, count) -> dict:
    """Summed statistics of a step (over micro-batches and replicas) -> logged scalars: the two aux
    losses per routed token (`moe_routed`: every position, whatever the loss mask keeps), dropped assignments (count and fraction), and the expert-load coefficient of
    variation (std/mean of tokens per expert, averaged over layers; 0 = perfectly balanced)."""
    if "moe_load" not in stats:
        return {}
    load_LE = stats["moe_load"]
    cv = jnp.mean(jnp.std(load_LE, axis=-1) / jnp.mean(load_LE, axis=-1))
    assignments = jnp.sum(load_LE)  # over layers, like the dropped count
    routed = stats.get("moe_routed", count)  # per routed token (every position), not per kept target
    return {
        "moe_aux_loss": stats["moe_aux_loss"] / routed,
        "moe_z_loss": stats["moe_z_loss"] / routed,
        "moe_dropped": stats["moe_dropped"],
        "moe_dropped_fraction": stats["moe_dropped"] / assignments,
        "moe_load_cv": cv,
        "moe_load_LE": load_LE,  # per layer and expert: the training step takes it out (Architecture.after_step)
    }


def count_moe_layer(cfg: ModelConfig) -> tuple[int, int]:
    """(total, active) parameters of one MoE feed-forward block: router + experts (+ shared)."""
    D, E, K, F = cfg.d_model, cfg.moe_experts, cfg.moe_topk, expert_dim(cfg)
    shared = 3 * D * F * cfg.moe_shared_experts
    return D * E + 3 * D * F * E + shared, D * E + 3 * D * F * K + shared
