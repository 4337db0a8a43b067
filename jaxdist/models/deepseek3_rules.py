"""DeepSeek-V3's registry entry beside its model (`models/deepseek3.py`, which loads JAX): the refusals of
a whole config (one line each), the attention term of FLOPs per token, and the after-step hook of the
auxiliary-loss-free bias update. JAX-free, like the registry that names them."""

from __future__ import annotations

import importlib

from jaxdist.config import ModelConfig
from jaxdist.errors import JaxdistError


def dense_count(m: ModelConfig) -> int:
    """Layers with a dense MLP: the first `dense_layers` (all of them without experts)."""
    return m.num_layers if not m.moe_experts else min(m.dense_layers, m.num_layers)


def attention_flops(m: ModelConfig) -> float:
    """The decoder's term with MLA's widths: q.k over nope + rope, p.v over v_head_dim, per head."""
    return 6 * m.num_layers * m.seq_len * m.num_heads * (m.mla_nope_dim + m.mla_rope_dim + m.mla_v_dim)


def _routing(m: ModelConfig) -> None:
    """The sigmoid group router's settings hold together."""
    if not m.moe_experts:
        return
    if m.moe_router != "sigmoid":
        raise JaxdistError(
            f"model.moe_router={m.moe_router}: DeepSeek-V3 routes by sigmoid; set model.moe_router=sigmoid"
        )
    g, kept = m.moe_groups or 1, m.moe_topk_groups or 1
    if m.moe_experts % g or kept > g or m.moe_topk > kept * (m.moe_experts // g):
        raise JaxdistError(
            f"model.moe_groups={m.moe_groups}, moe_topk_groups={m.moe_topk_groups}: groups must divide the "
            f"{m.moe_experts} experts, keep at most all groups and hold moe_topk={m.moe_topk} experts"
        )
    if m.dense_layers >= m.num_layers:
        raise JaxdistError(
            f"model.dense_layers={m.dense_layers} leaves no MoE layer of {m.num_layers}; lower it or set model.moe_experts=0"
        )


def check(cfg, sizes: dict) -> None:
    """What DeepSeek-V3 here does not meet, one line each."""
    m = cfg.model
    fix = "set model.family=deepseek_v3's fields from a DeepseekV3 config.json (convert from-hf)"
    for field, ok in (("qkv_bias", False), ("qk_norm", False), ("sliding_window", 0), ("embed_scale", 1.0),
                      ("moe_every", 1)):  # fmt: skip
        if getattr(m, field) != ok:
            raise JaxdistError(
                f"model.{field}={getattr(m, field)!r} has no DeepSeek-V3 form (model.family=deepseek_v3); remove it"
            )
    if m.rope_scaling not in ("none", "yarn"):
        raise JaxdistError(f"model.rope_scaling={m.rope_scaling} has no DeepSeek-V3 form; use none or yarn")
    for field in ("mla_kv_rank", "mla_nope_dim", "mla_rope_dim", "mla_v_dim"):
        if not getattr(m, field):
            raise JaxdistError(
                f"model.{field}=0: multi-head latent attention needs it (model.family=deepseek_v3); {fix}"
            )
    if m.mla_rope_dim % 2:
        raise JaxdistError(f"model.mla_rope_dim={m.mla_rope_dim} must be even (rotary pairs)")
    _routing(m)
    if cfg.lora.rank and m.moe_bias_rate:
        raise JaxdistError(
            f"model.moe_bias_rate={m.moe_bias_rate} with lora.rank>0: the selection bias is part of the frozen "
            "base under LoRA; set model.moe_bias_rate=0 (or train fully, lora.rank=0)"
        )


def tabled_pp(m: ModelConfig) -> str:
    """Why a table pipeline schedule cannot run this config: its dense first layers run before the stages."""
    return "its dense first layers run before the stages" if m.dense_layers else ""


def after_step(m: ModelConfig, params, load_LE):
    """The auxiliary-loss-free balancing update of the selection biases (models/deepseek3.py)."""
    return importlib.import_module("jaxdist.models.deepseek3").after_step(m, params, load_LE)
