"""DeepSeek-V3's Hugging Face family (`DeepseekV3ForCausalLM`, model_type deepseek_v3): the config.json
fields read into `model.*` (MLA ranks and head widths, group routing, dense first layers) and written
back, and the tensor table of its two stacks (`dense_blocks`: the first `first_k_dense_replace` layers;
`blocks`: the MoE layers after them). Refused in one line each: multi-token-prediction layers, FP8
block-quantised weights (`quantization_config`), rotary scaling other than none and YaRN."""

from __future__ import annotations

from typing import Any

from jaxdist.config import ModelConfig
from jaxdist.errors import JaxdistError
from jaxdist.models.hf_spec import Family

DEFAULTS = {  # transformers' DeepseekV3Config defaults that differ from Llama's
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "max_position_embeddings": 4096,
    "moe_intermediate_size": 2048,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "rope_interleave": True,
    "num_nextn_predict_layers": 1,
}
MAPPED = frozenset(
    {"q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "qk_head_dim",
     "n_routed_experts", "num_local_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size",
     "n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob", "first_k_dense_replace", "rope_interleave",
     "num_nextn_predict_layers", "num_mtp_layers", "quantization_config"}
)  # fmt: skip
# Settings of DeepSeek's own training code (the loss, expert placement), not of the forward pass.
IGNORED = frozenset({"aux_loss_alpha", "seq_aux", "ep_size", "output_router_logits", "router_aux_loss_coef"})
REQUIRED = {"attention_bias": False, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1}


def _read(get, where) -> dict:
    mtp = get("num_nextn_predict_layers") if get("num_mtp_layers") is None else get("num_mtp_layers")
    if mtp:
        raise JaxdistError(
            f"{where}: num_nextn_predict_layers={mtp}: multi-token prediction layers are not supported; set it to 0 "
            f"in config.json and remove the model.layers.{get('num_hidden_layers')}.* tensors (the main model is unchanged)"
        )
    if get("quantization_config") is not None:
        raise JaxdistError(
            f"{where}: the weights are FP8 block-quantised (quantization_config); jaxdist imports float weights: "
            "dequantise to bfloat16 first (DeepSeek's inference/fp8_cast_bf16.py, or transformers with "
            "FineGrainedFP8Config(dequantize=True) and save_pretrained) and drop quantization_config"
        )
    experts = get("n_routed_experts") if get("num_local_experts") is None else get("num_local_experts")
    nope, rope = int(get("qk_nope_head_dim")), int(get("qk_rope_head_dim"))
    heads = int(get("num_attention_heads"))
    return {
        "head_dim": nope + rope,  # the query/key width per head
        "num_kv_heads": heads,  # MLA: every head has its own expanded key and value
        "qkv_bias": False,
        "qk_norm": False,
        "sliding_window": 0,
        "embed_scale": 1.0,
        "mla_q_rank": int(get("q_lora_rank") or 0),
        "mla_kv_rank": int(get("kv_lora_rank")),
        "mla_nope_dim": nope,
        "mla_rope_dim": rope,
        "mla_v_dim": int(get("v_head_dim")),
        "rope_interleave": bool(get("rope_interleave")),
        "dense_layers": int(get("first_k_dense_replace") or 0),
        "moe_experts": int(experts),
        "moe_topk": int(get("num_experts_per_tok")),
        "moe_router": "sigmoid",
        "moe_shared_experts": int(get("n_shared_experts") or 0),
        "moe_mlp_dim": int(get("moe_intermediate_size")),
        "moe_every": 1,
        "moe_norm_topk": bool(get("norm_topk_prob")),
        "moe_groups": int(get("n_group") or 1),
        "moe_topk_groups": int(get("topk_group") or 1),
        "moe_routed_scale": float(get("routed_scaling_factor")),
    }


YARN = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


def _rope(hf: dict, where) -> dict:
    """rope_theta and rope_scaling (Hub) or rope_parameters (transformers 5): default, or YaRN."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta") or 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return {"rope_theta": theta, "rope_scaling": "none"}
    unknown = set(params) - set(YARN) - {"rope_type", "type", "rope_theta", "truncate"}
    fixed = {"truncate": True, "beta_fast": 32, "beta_slow": 1}  # models/deepseek3.py's BETA_FAST, BETA_SLOW
    odd = sorted(unknown | {k for k, v in fixed.items() if params.get(k, v) not in (v, None)})
    if kind != "yarn" or odd:
        what = f"rope type {kind!r}" if kind != "yarn" else f"YaRN field {odd[0]}={params.get(odd[0])!r}"
        raise JaxdistError(
            f"{where}: {what} is not supported for DeepSeek-V3 (default, or YaRN with {', '.join(YARN)})"
        )
    orig = params.get("original_max_position_embeddings") or hf.get("max_position_embeddings") or 4096
    return {
        "rope_theta": theta,
        "rope_scaling": "yarn",
        "rope_factor": float(params.get("factor") or (hf.get("max_position_embeddings") or 4096) / orig),
        "rope_original_max_len": int(orig),
        "rope_mscale": float(params.get("mscale") or 0.0),
        "rope_mscale_all_dim": float(params.get("mscale_all_dim") or 0.0),
    }


def _write(m: ModelConfig, src: dict) -> dict:
    return {
        "q_lora_rank": m.mla_q_rank or None,
        "kv_lora_rank": m.mla_kv_rank,
        "qk_nope_head_dim": m.mla_nope_dim,
        "qk_rope_head_dim": m.mla_rope_dim,
        "v_head_dim": m.mla_v_dim,
        "head_dim": m.mla_rope_dim,  # transformers' DeepseekV3Config sets head_dim = qk_rope_head_dim
        "rope_interleave": m.rope_interleave,
        "n_routed_experts": m.moe_experts,
        "n_shared_experts": m.moe_shared_experts,
        "num_experts_per_tok": m.moe_topk,
        "moe_intermediate_size": m.moe_mlp_dim or m.mlp_dim,
        "n_group": m.moe_groups or 1,
        "topk_group": m.moe_topk_groups or 1,
        "routed_scaling_factor": m.moe_routed_scale,
        "norm_topk_prob": m.moe_norm_topk,
        "first_k_dense_replace": m.dense_layers,
        "num_nextn_predict_layers": 0,
        "attention_bias": False,
        "rope_scaling": None
        if m.rope_scaling != "yarn"
        else {
            "rope_type": "yarn",
            "factor": m.rope_factor,
            "original_max_position_embeddings": m.rope_original_max_len,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": m.rope_mscale,
            "mscale_all_dim": m.rope_mscale_all_dim,
        },
    }


def exportable(m: ModelConfig) -> None:
    if not m.moe_experts:
        raise JaxdistError("model.moe_experts=0: DeepseekV3ForCausalLM has routed experts; set model.moe_experts")
    if m.moe_router != "sigmoid":
        raise JaxdistError(f"model.moe_router={m.moe_router}: DeepseekV3ForCausalLM routes by sigmoid; set sigmoid")


FAMILY = Family(
    name="deepseek_v3",
    architecture="DeepseekV3ForCausalLM",
    model_type="deepseek_v3",
    defaults=DEFAULTS,
    required=REQUIRED,
    mapped=MAPPED,
    ignored=IGNORED,
    read=_read,
    write=_write,
    rope=_rope,
    exportable=exportable,
)

P = "model.layers.{i}."


def _attention(m: ModelConfig) -> list[tuple]:
    """(path, hf name, n_in, one layer's jaxdist shape) of the MLA projections and norms."""
    D, N, R, C = m.d_model, m.num_heads, m.mla_q_rank, m.mla_kv_rank
    Hn, Pr, Hv = m.mla_nope_dim, m.mla_rope_dim, m.mla_v_dim
    if R:
        q = [(("attn", "wq_a_DR"), "self_attn.q_a_proj.weight", 1, (D, R)),
             (("attn", "q_norm", "scale"), "self_attn.q_a_layernorm.weight", 0, (R,)),
             (("attn", "wq_b_RNH"), "self_attn.q_b_proj.weight", 1, (R, N, Hn + Pr))]  # fmt: skip
    else:
        q = [(("attn", "wq_DNH"), "self_attn.q_proj.weight", 1, (D, N, Hn + Pr))]
    return [
        (("attn_norm", "scale"), "input_layernorm.weight", 0, (D,)),
        *q,
        (("attn", "wkv_a_DC"), "self_attn.kv_a_proj_with_mqa.weight", 1, (D, C + Pr)),
        (("attn", "kv_norm", "scale"), "self_attn.kv_a_layernorm.weight", 0, (C,)),
        (("attn", "wkv_b_CNH"), "self_attn.kv_b_proj.weight", 1, (C, N, Hn + Hv)),
        (("attn", "wo_NHD"), "self_attn.o_proj.weight", 2, (N, Hv, D)),
        (("mlp_norm", "scale"), "post_attention_layernorm.weight", 0, (D,)),
    ]


def _mlp(m: ModelConfig, sparse: bool) -> list[tuple]:
    D, F, E = m.d_model, m.mlp_dim, m.moe_experts
    if not sparse:
        return [(("mlp", "w_gate_DF"), "mlp.gate_proj.weight", 1, (D, F)),
                (("mlp", "w_up_DF"), "mlp.up_proj.weight", 1, (D, F)),
                (("mlp", "w_down_FD"), "mlp.down_proj.weight", 1, (F, D))]  # fmt: skip
    Fe, S = m.moe_mlp_dim or F, (m.moe_mlp_dim or F) * m.moe_shared_experts
    out = [
        (("mlp", "router_DE"), "mlp.gate.weight", 1, (D, E)),
        (("mlp", "e_bias_E"), "mlp.gate.e_score_correction_bias", 0, (E,)),
        (("mlp", "w_gate_EDF"), "mlp.experts.{e}.gate_proj.weight", 1, (D, Fe)),
        (("mlp", "w_up_EDF"), "mlp.experts.{e}.up_proj.weight", 1, (D, Fe)),
        (("mlp", "w_down_EFD"), "mlp.experts.{e}.down_proj.weight", 1, (Fe, D)),
    ]
    if S:
        out += [(("mlp", "shared_gate_DS"), "mlp.shared_experts.gate_proj.weight", 1, (D, S)),
                (("mlp", "shared_up_DS"), "mlp.shared_experts.up_proj.weight", 1, (D, S)),
                (("mlp", "shared_down_SD"), "mlp.shared_experts.down_proj.weight", 1, (S, D))]  # fmt: skip
    return out


def layer_tensors(m: ModelConfig, sparse: bool) -> list[tuple]:
    """(path in the unit, hf name, n_in, per expert) of one layer."""
    return [(p, P + name, n_in, "{e}" in name) for p, name, n_in, _ in _attention(m) + _mlp(m, sparse)]


def tensors(m: ModelConfig) -> list[dict]:
    """Every parameter in HF's file order, as `jaxdist.hf.mapping.Tensor` fields: the dense stack's
    layers 0..k-1, then the MoE stack's k..L-1 (entry g of a stack is HF layer g + its offset)."""
    k = min(m.dense_layers, m.num_layers)  # deepseek3_rules.dense_count (experts set here)
    stacks = [("dense_blocks", False, 0, k), ("blocks", True, k, m.num_layers - k)] if m.moe_experts and k else []
    stacks = stacks or [("blocks", bool(m.moe_experts), 0, m.num_layers)]
    out: list[dict[str, Any]] = [dict(path=("embed_VD",), hf="model.embed_tokens.weight", n_in=0, stacked=False)]
    for where, sparse, offset, depth in stacks:
        for p, name, n_in, shape in _attention(m) + _mlp(m, sparse):
            out.append(dict(path=(where, *p), hf=P + name, n_in=n_in, stacked=True, experts="{e}" in name,
                            offset=offset, depth=depth, shape=shape))  # fmt: skip
    out.append(dict(path=("final_norm", "scale"), hf="model.norm.weight", n_in=0, stacked=False))
    if not m.tie_embeddings:
        out.append(dict(path=("head_DV",), hf="lm_head.weight", n_in=1, stacked=False))
    return out
