"""gpt-oss's registry side, JAX-free (its model is `models/gpt_oss.py`): the Hugging Face family
(`GptOssForCausalLM`, model_type gpt_oss: config.json fields in and out, YaRN rotary), the tensor
table (q/k/v/o with biases, per-head sinks, router with bias, the experts' fused gate_up / down
tensors with biases, stored as transformers stores them), the refusals of a whole config and the
attention term of FLOPs per token.

MXFP4 experts (`quantization_config` mxfp4, the published checkpoints) are de-quantised on import
(hf/mxfp4.py). Refused in one line each: another quantisation method, a `layer_types` other than
alternating sliding/full, YaRN with an explicit attention_factor / mscale, pp and cp meshes.
LoRA takes q/k/v/o and the experts (gate/up/down: peft's target_parameters gate_up_proj, down_proj).
"""

from __future__ import annotations

import math
from typing import Any

from jaxdist.config import ModelConfig
from jaxdist.errors import JaxdistError
from jaxdist.models.hf_spec import Family

DEFAULTS = {  # transformers' GptOssConfig defaults that differ from Llama's
    "vocab_size": 201088,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 36,
    "num_attention_heads": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 150000.0,
    "max_position_embeddings": 131072,
    "sliding_window": 128,
    "num_local_experts": 128,
    "num_experts_per_tok": 4,
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
}
YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 4096}  # fmt: skip
MAPPED = frozenset({"num_local_experts", "num_experts", "num_experts_per_tok", "swiglu_alpha", "swiglu_limit",
                    "sliding_window", "layer_types", "quantization_config"})  # fmt: skip
# The training loss's settings in transformers, not the forward pass's; the published config.json's
# copies of num_experts_per_tok and YaRN's original_max_position_embeddings (OpenAI's own names).
IGNORED = frozenset({"router_aux_loss_coef", "output_router_logits", "experts_per_token", "initial_context_length"})
REQUIRED = {"attention_bias": True}
DEQUANTISE = (
    "dequantise the experts first: GptOssForCausalLM.from_pretrained(path, quantization_config="
    "Mxfp4Config(dequantize=True), dtype=torch.bfloat16).save_pretrained(out), then import out"
)


def layer_windows(m: ModelConfig) -> list[int]:
    """Each layer's window (0 = full attention): gpt-oss alternates sliding (even layers) and full (odd)."""
    return [0 if i % 2 else m.sliding_window for i in range(m.num_layers)]


def _read(get, where) -> dict:
    if get("quantization_config") is not None:
        q = get("quantization_config")
        method = q.get("quant_method") if isinstance(q, dict) else q
        if method != "mxfp4":  # MXFP4's *_blocks / *_scales are de-quantised on import (hf/tensors.py)
            raise JaxdistError(f"{where}: the experts are {method}-quantised (quantization_config); {DEQUANTISE}")
    window, layers = get("sliding_window"), int(get("num_hidden_layers"))
    if not isinstance(window, int) or window < 1:
        raise JaxdistError(f"{where}: sliding_window={window!r} must be a positive integer")
    want = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    kinds = get("layer_types")
    if kinds is not None and list(kinds) != want:
        raise JaxdistError(
            f"{where}: layer_types {kinds} does not alternate sliding/full from layer 0; jaxdist's gpt-oss takes that pattern only"
        )
    experts = get("num_local_experts") if get("num_experts") is None else get("num_experts")
    return {
        "qkv_bias": True,  # and o_proj's bias, the sinks: the architecture's own (models/gpt_oss.py)
        "qk_norm": False,
        "sliding_window": window,
        "embed_scale": 1.0,
        "moe_experts": int(experts),
        "moe_topk": int(get("num_experts_per_tok")),
        "moe_mlp_dim": int(get("intermediate_size")),
        "moe_router": "softmax",  # softmax over the top-k logits = the top-k softmax scores renormalised
        "moe_norm_topk": True,
        "moe_every": 1,
        "moe_shared_experts": 0,
        "swiglu_alpha": float(get("swiglu_alpha")),
        "swiglu_limit": float(get("swiglu_limit")),
    }


def _rope(hf: dict, where) -> dict:
    """transformers 5's rope_parameters or the Hub's rope_theta + rope_scaling; absent: GptOssConfig's YaRN."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling")
    params = dict(YARN, rope_theta=hf.get("rope_theta", DEFAULTS["rope_theta"])) if params is None else params
    theta = float(params.get("rope_theta", hf.get("rope_theta") or DEFAULTS["rope_theta"]))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return {"rope_theta": theta, "rope_scaling": "none"}
    unknown = set(params) - {"rope_type", "type", "rope_theta", "factor", "beta_fast", "beta_slow", "truncate",
                             "original_max_position_embeddings"}  # fmt: skip
    if kind != "yarn" or unknown:
        raise JaxdistError(
            f"{where}: rope {kind!r} with {sorted(unknown) or 'these fields'} is not supported for gpt-oss "
            "(YaRN without attention_factor/mscale, or default)"
        )
    return {
        "rope_theta": theta,
        "rope_scaling": "yarn",
        "rope_factor": float(params["factor"]),
        "rope_original_max_len": int(
            params.get("original_max_position_embeddings") or YARN["original_max_position_embeddings"]
        ),
        "rope_beta_fast": float(params.get("beta_fast") or 32.0),
        "rope_beta_slow": float(params.get("beta_slow") or 1.0),
        "rope_truncate": bool(params.get("truncate", True)),
    }


def _write(m: ModelConfig, src: dict) -> dict:
    yarn = None
    if m.rope_scaling == "yarn":
        yarn = {"rope_type": "yarn", "factor": m.rope_factor, "beta_fast": m.rope_beta_fast,
                "beta_slow": m.rope_beta_slow, "truncate": m.rope_truncate,
                "original_max_position_embeddings": m.rope_original_max_len}  # fmt: skip
    return {
        "rope_scaling": yarn,
        "intermediate_size": m.moe_mlp_dim or m.mlp_dim,
        "num_local_experts": m.moe_experts,
        "num_experts_per_tok": m.moe_topk,
        "sliding_window": m.sliding_window,
        "layer_types": ["full_attention" if w == 0 else "sliding_attention" for w in layer_windows(m)],
        "swiglu_alpha": m.swiglu_alpha,
        "swiglu_limit": m.swiglu_limit,
        "attention_bias": True,
    }


def exportable(m: ModelConfig) -> None:
    if not m.moe_experts or not m.sliding_window:
        raise JaxdistError(
            "GptOssForCausalLM has experts and windowed layers; set model.moe_experts and model.sliding_window"
        )


FAMILY = Family(
    name="gpt_oss",
    architecture="GptOssForCausalLM",
    model_type="gpt_oss",
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


def _layer(m: ModelConfig) -> list[tuple]:
    """(path in the layer, HF name, n_in, one layer's jaxdist shape)."""
    D, N, K, H, E, F = m.d_model, m.num_heads, m.num_kv_heads, m.head_dim, m.moe_experts, m.moe_mlp_dim or m.mlp_dim
    return [
        (("attn_norm", "scale"), "input_layernorm.weight", 0, (D,)),
        (("attn", "wq_DNH"), "self_attn.q_proj.weight", 1, (D, N, H)),
        (("attn", "bq_NH"), "self_attn.q_proj.bias", -1, (N, H)),
        (("attn", "wk_DKH"), "self_attn.k_proj.weight", 1, (D, K, H)),
        (("attn", "bk_KH"), "self_attn.k_proj.bias", -1, (K, H)),
        (("attn", "wv_DKH"), "self_attn.v_proj.weight", 1, (D, K, H)),
        (("attn", "bv_KH"), "self_attn.v_proj.bias", -1, (K, H)),
        (("attn", "wo_NHD"), "self_attn.o_proj.weight", 2, (N, H, D)),
        (("attn", "bo_D"), "self_attn.o_proj.bias", 0, (D,)),
        (("attn", "sinks_N"), "self_attn.sinks", 0, (N,)),
        (("mlp_norm", "scale"), "post_attention_layernorm.weight", 0, (D,)),
        (("mlp", "router_DE"), "mlp.router.weight", 1, (D, E)),
        (("mlp", "router_bias_E"), "mlp.router.bias", 0, (E,)),
        (("mlp", "w_gate_up_EDG"), "mlp.experts.gate_up_proj", 0, (E, D, 2 * F)),  # gate, up interleaved
        (("mlp", "b_gate_up_EG"), "mlp.experts.gate_up_proj_bias", 0, (E, 2 * F)),
        (("mlp", "w_down_EFD"), "mlp.experts.down_proj", 0, (E, F, D)),
        (("mlp", "b_down_ED"), "mlp.experts.down_proj_bias", 0, (E, D)),
    ]


def layer_tensors(m: ModelConfig, sparse: bool) -> list[tuple]:
    """(path in the unit, hf name, n_in, per expert) of one layer (the experts are whole tensors)."""
    return [(p, P + name, n_in, False) for p, name, n_in, _ in _layer(m)]


def tensors(m: ModelConfig) -> list[dict]:
    """Every parameter in HF's order, as `jaxdist.hf.mapping.Tensor` fields."""
    out: list[dict[str, Any]] = [dict(path=("embed_VD",), hf="model.embed_tokens.weight", n_in=0, stacked=False)]
    for p, name, n_in, shape in _layer(m):
        out.append(dict(path=("blocks", *p), hf=P + name, n_in=n_in, stacked=True, shape=shape))
    out.append(dict(path=("final_norm", "scale"), hf="model.norm.weight", n_in=0, stacked=False))
    if not m.tie_embeddings:
        out.append(dict(path=("head_DV",), hf="lm_head.weight", n_in=1, stacked=False))
    return out


def attention_flops(m: ModelConfig) -> float:
    """The decoder's 12·T·N·H per layer, a windowed layer counting min(T, W) keys per query."""
    keys = sum(min(m.seq_len, w) if w else m.seq_len for w in layer_windows(m))
    return 12 * keys * m.num_heads * m.head_dim


def check(cfg, sizes: dict) -> None:
    """What gpt-oss here does not meet, one line each."""
    m = cfg.model
    for field, ok in (("qkv_bias", True), ("qk_norm", False), ("embed_scale", 1.0), ("moe_every", 1),
                      ("moe_shared_experts", 0), ("moe_router", "softmax"), ("moe_norm_topk", True)):  # fmt: skip
        if getattr(m, field) != ok:
            raise JaxdistError(
                f"model.{field}={getattr(m, field)!r} has no gpt-oss form (model.family=gpt_oss); set {ok!r}"
            )
    if m.rope_scaling not in ("none", "yarn"):
        raise JaxdistError(f"model.rope_scaling={m.rope_scaling} has no gpt-oss form; use yarn or none")
    if not m.moe_experts or not m.sliding_window:
        raise JaxdistError(
            "model.family=gpt_oss needs model.moe_experts and model.sliding_window (import a GptOss config.json)"
        )


def tabled_pp(m: ModelConfig) -> str:
    """Why a table pipeline schedule cannot run gpt-oss: only the scan schedules carry per-layer windows."""
    return "its per-layer windows are carried by the scan schedules only"


def yarn_frequencies(m: ModelConfig) -> tuple[list[float], float]:
    """(per-pair rotary frequencies, attention factor) of YaRN, as transformers' `_compute_yarn_parameters`
    (no attention_factor / mscale given: 0.1·ln(factor) + 1 multiplies cos and sin); rope_scaling=none:
    the plain frequencies and 1."""
    dim, base = m.head_dim, m.rope_theta
    pos = [base ** (2 * i / dim) for i in range(dim // 2)]
    if m.rope_scaling != "yarn":
        return [1 / p for p in pos], 1.0
    factor, orig = m.rope_factor, m.rope_original_max_len

    def correction(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction(m.rope_beta_fast), correction(m.rope_beta_slow)
    if m.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    freqs = []
    for i, p in enumerate(pos):
        extrapolation = 1 - min(max((i - low) / (high - low), 0.0), 1.0)
        freqs.append((1 / (factor * p)) * (1 - extrapolation) + (1 / p) * extrapolation)
    return freqs, (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
