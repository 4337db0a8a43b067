"""Qwen3-Next's Hugging Face side, JAX-free (its model is `models/qwen3next.py`): the family
(`Qwen3NextForCausalLM`, model_type qwen3_next: config.json fields in and out), the tensor table (per
group of `full_attention_interval` layers: the DeltaNet layers' fused in_proj_qkvz / in_proj_ba, conv1d,
A_log, dt_bias, gated norm, out_proj; the full layer's gated q_proj, k/v/o and q/k norms; per layer the
experts, router, shared expert and its gate), the refusals of a whole config and the attention FLOPs.

Refused in one line each: a `layer_types` other than (n-1 linear, 1 full) repeated, `mlp_only_layers`,
`decoder_sparse_step` > 1, multi-token-prediction layers (`mtp_*` / num_nextn_predict_layers), rotary
scaling, LoRA beyond the full-attention layers' q/k/v/o, pp and cp meshes, packed documents (models/qwen3next.py).
"""

from __future__ import annotations

from jaxdist.config import ModelConfig
from jaxdist.errors import JaxdistError
from jaxdist.models.hf_spec import Family

DEFAULTS = {  # transformers' Qwen3NextConfig defaults that differ from Llama's
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "max_position_embeddings": 32768,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "decoder_sparse_step": 1,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "num_experts_per_tok": 10,
    "num_experts": 512,
    "norm_topk_prob": True,
    "partial_rotary_factor": 0.25,
    "full_attention_interval": 4,
}
MAPPED = frozenset(
    {"linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
     "linear_num_value_heads", "decoder_sparse_step", "moe_intermediate_size", "shared_expert_intermediate_size",
     "num_experts_per_tok", "num_experts", "norm_topk_prob", "mlp_only_layers", "layer_types",
     "full_attention_interval", "partial_rotary_factor", "num_nextn_predict_layers", "mtp_num_hidden_layers"}
)  # fmt: skip
IGNORED = frozenset({"router_aux_loss_coef", "output_router_logits", "mtp_use_dedicated_embeddings"})
REQUIRED = {"attention_bias": False}


def layer_kinds(layers: int, interval: int) -> list[str]:
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]


def _read(get, where) -> dict:
    mtp = get("num_nextn_predict_layers") or get("mtp_num_hidden_layers")
    if mtp:
        raise JaxdistError(
            f"{where}: {mtp} multi-token-prediction layers are not supported; set mtp_num_hidden_layers=0 "
            "and drop the mtp.* tensors (the main model is unchanged)"
        )
    layers, kinds = int(get("num_hidden_layers")), get("layer_types")
    interval = int(get("full_attention_interval") or 4)
    if kinds is not None:
        full = [i for i, k in enumerate(kinds) if k == "full_attention"]
        interval = full[0] + 1 if full else 0
    if not interval or layers % interval or (kinds is not None and list(kinds) != layer_kinds(layers, interval)):
        raise JaxdistError(
            f"{where}: layer_types {kinds} is not (n-1 linear_attention, 1 full_attention) repeated over "
            f"{layers} layers; jaxdist's Qwen3-Next scans that pattern only"
        )
    if get("mlp_only_layers") or int(get("decoder_sparse_step") or 1) != 1:
        raise JaxdistError(
            f"{where}: mlp_only_layers={get('mlp_only_layers')} / decoder_sparse_step={get('decoder_sparse_step')}: "
            "jaxdist's Qwen3-Next has experts in every layer (or none); convert another model"
        )
    kh, vh = int(get("linear_num_key_heads")), int(get("linear_num_value_heads"))
    if vh % kh:
        raise JaxdistError(f"{where}: linear_num_value_heads={vh} is not a multiple of linear_num_key_heads={kh}")
    return {
        "qkv_bias": False,
        "qk_norm": False,  # its zero-centred q/k norms are the architecture's own (models/qwen3next.py)
        "sliding_window": 0,
        "embed_scale": 1.0,
        "linear_key_heads": kh,
        "linear_value_heads": vh,
        "linear_key_dim": int(get("linear_key_head_dim")),
        "linear_value_dim": int(get("linear_value_head_dim")),
        "linear_conv_kernel": int(get("linear_conv_kernel_dim")),
        "full_attention_interval": interval,
        "moe_experts": int(get("num_experts") or 0),
        "moe_topk": int(get("num_experts_per_tok")),
        "moe_mlp_dim": int(get("moe_intermediate_size")),
        "moe_shared_dim": int(get("shared_expert_intermediate_size") or 0),
        "moe_router": "softmax",
        "moe_norm_topk": bool(get("norm_topk_prob")),
        "moe_every": 1,
        "moe_shared_experts": 0,
    }


def _rope(hf: dict, where) -> dict:
    """Default rotary only, on `partial_rotary_factor` of each head (top level or in rope_parameters)."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise JaxdistError(f"{where}: rope type {kind!r} is not supported for Qwen3-Next (default only)")
    fraction = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", DEFAULTS["partial_rotary_factor"]))
    theta = params.get("rope_theta", hf.get("rope_theta") or 10000.0)
    return {"rope_theta": float(theta), "rope_scaling": "none", "rope_fraction": float(fraction)}


def _write(m: ModelConfig, src: dict) -> dict:
    return {
        "rope_scaling": None,
        "partial_rotary_factor": m.rope_fraction,
        "linear_num_key_heads": m.linear_key_heads,
        "linear_num_value_heads": m.linear_value_heads,
        "linear_key_head_dim": m.linear_key_dim,
        "linear_value_head_dim": m.linear_value_dim,
        "linear_conv_kernel_dim": m.linear_conv_kernel,
        "layer_types": layer_kinds(m.num_layers, m.full_attention_interval),
        "num_experts": m.moe_experts,
        "num_experts_per_tok": m.moe_topk,
        "moe_intermediate_size": m.moe_mlp_dim or m.mlp_dim,
        "shared_expert_intermediate_size": m.moe_shared_dim,
        "norm_topk_prob": m.moe_norm_topk,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "attention_bias": False,
    }


def exportable(m: ModelConfig) -> None:
    if not m.full_attention_interval or not m.linear_key_heads:
        raise JaxdistError(
            "Qwen3NextForCausalLM has gated DeltaNet layers; set model.full_attention_interval and model.linear_*"
        )


FAMILY = Family(
    name="qwen3_next",
    architecture="Qwen3NextForCausalLM",
    model_type="qwen3_next",
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


def _mixer(m: ModelConfig, linear: bool) -> list[tuple]:
    """(path in the layer, HF name, n_in, one layer's jaxdist shape) of the token mixer and the norms."""
    D, N, K, H = m.d_model, m.num_heads, m.num_kv_heads, m.head_dim
    Kh, Vh, dk, dv, W = (
        m.linear_key_heads,
        m.linear_value_heads,
        m.linear_key_dim,
        m.linear_value_dim,
        m.linear_conv_kernel,
    )
    R = Vh // max(Kh, 1)
    norms = [(("attn_norm", "scale"), "input_layernorm.weight", 0, (D,)),
             (("mlp_norm", "scale"), "post_attention_layernorm.weight", 0, (D,))]  # fmt: skip
    if linear:
        return norms + [
            (("attn", "wqkvz_DKX"), "linear_attn.in_proj_qkvz.weight", 1, (D, Kh, 2 * dk + 2 * R * dv)),
            (("attn", "wba_DKX"), "linear_attn.in_proj_ba.weight", 1, (D, Kh, 2 * R)),
            (("attn", "conv_C1W"), "linear_attn.conv1d.weight", 0, (2 * Kh * dk + Vh * dv, 1, W)),
            (("attn", "dt_bias_V"), "linear_attn.dt_bias", 0, (Vh,)),
            (("attn", "a_log_V"), "linear_attn.A_log", 0, (Vh,)),
            (("attn", "norm", "scale"), "linear_attn.norm.weight", 0, (dv,)),
            (("attn", "wo_VHD"), "linear_attn.out_proj.weight", 2, (Vh, dv, D)),
        ]
    return norms + [
        (("attn", "wq_DNH"), "self_attn.q_proj.weight", 1, (D, N, 2 * H)),
        (("attn", "wk_DKH"), "self_attn.k_proj.weight", 1, (D, K, H)),
        (("attn", "wv_DKH"), "self_attn.v_proj.weight", 1, (D, K, H)),
        (("attn", "wo_NHD"), "self_attn.o_proj.weight", 2, (N, H, D)),
        (("attn", "q_norm", "scale"), "self_attn.q_norm.weight", 0, (H,)),
        (("attn", "k_norm", "scale"), "self_attn.k_norm.weight", 0, (H,)),
    ]


def _mlp(m: ModelConfig) -> list[tuple]:
    D, E, F, S = m.d_model, m.moe_experts, m.moe_mlp_dim or m.mlp_dim, m.moe_shared_dim
    if not E:
        F = m.mlp_dim
        return [(("mlp", "w_gate_DF"), "mlp.gate_proj.weight", 1, (D, F)),
                (("mlp", "w_up_DF"), "mlp.up_proj.weight", 1, (D, F)),
                (("mlp", "w_down_FD"), "mlp.down_proj.weight", 1, (F, D))]  # fmt: skip
    out = [
        (("mlp", "router_DE"), "mlp.gate.weight", 1, (D, E)),
        (("mlp", "w_gate_EDF"), "mlp.experts.{e}.gate_proj.weight", 1, (D, F)),
        (("mlp", "w_up_EDF"), "mlp.experts.{e}.up_proj.weight", 1, (D, F)),
        (("mlp", "w_down_EFD"), "mlp.experts.{e}.down_proj.weight", 1, (F, D)),
    ]
    if S:
        out += [(("mlp", "sh_gate_DS"), "mlp.shared_expert.gate_proj.weight", 1, (D, S)),
                (("mlp", "sh_up_DS"), "mlp.shared_expert.up_proj.weight", 1, (D, S)),
                (("mlp", "sh_down_SD"), "mlp.shared_expert.down_proj.weight", 1, (S, D)),
                (("mlp", "sh_router_D1"), "mlp.shared_expert_gate.weight", 1, (D, 1))]  # fmt: skip
    return out


def layer_tensors(m: ModelConfig, sparse: bool) -> list[tuple]:
    """(path in the unit, hf name, n_in, per expert) of every layer of one group."""
    n = m.full_attention_interval
    return [(("layers", j, *p), P + name, n_in, "{e}" in name)
            for j in range(n) for p, name, n_in, _ in _mixer(m, j < n - 1) + _mlp(m)]  # fmt: skip


def tensors(m: ModelConfig) -> list[dict]:
    """Every parameter, as `jaxdist.hf.mapping.Tensor` fields: group g's layer j is HF layer g * n + j."""
    n = m.full_attention_interval
    out: list[dict] = [dict(path=("embed_VD",), hf="model.embed_tokens.weight", n_in=0, stacked=False)]
    for j in range(n):
        for p, name, n_in, shape in _mixer(m, j < n - 1) + _mlp(m):
            out.append(dict(path=("blocks", "layers", j, *p), hf=P + name, n_in=n_in, stacked=True,
                            experts="{e}" in name, every=n, offset=j, depth=m.num_layers // n, shape=shape))  # fmt: skip
    out.append(dict(path=("final_norm", "scale"), hf="model.norm.weight", n_in=0, stacked=False))
    if not m.tie_embeddings:
        out.append(dict(path=("head_DV",), hf="lm_head.weight", n_in=1, stacked=False))
    return out


def attention_flops(m: ModelConfig) -> float:
    """Full layers: 12·T·N·H each (PaLM's convention, as the decoder). DeltaNet layers: per token and
    value head the recurrence's decay, read, write and output over the dk x dv state, ~4 multiply-adds
    each: 8·dk·dv forward, x3 with the backward = 24·Vh·dk·dv (independent of T)."""
    full = m.num_layers // m.full_attention_interval if m.full_attention_interval else m.num_layers
    linear = m.num_layers - full
    return (
        12 * full * m.seq_len * m.num_heads * m.head_dim
        + 24 * linear * m.linear_value_heads * m.linear_key_dim * m.linear_value_dim
    )


def check(cfg, sizes: dict) -> None:
    """What Qwen3-Next here does not meet, one line each."""
    m = cfg.model
    for field, ok in (("qkv_bias", False), ("qk_norm", False), ("sliding_window", 0), ("embed_scale", 1.0),
                      ("moe_every", 1), ("moe_shared_experts", 0), ("moe_router", "softmax"),
                      ("rope_scaling", "none")):  # fmt: skip
        if getattr(m, field) != ok:
            raise JaxdistError(
                f"model.{field}={getattr(m, field)!r} has no Qwen3-Next form (model.family=qwen3_next); set {ok!r}"
            )
    need = ("full_attention_interval", "linear_key_heads", "linear_value_heads", "linear_key_dim",
            "linear_value_dim", "linear_conv_kernel")  # fmt: skip
    for field in need:
        if not getattr(m, field):
            raise JaxdistError(
                f"model.{field}=0: model.family=qwen3_next needs it (import a Qwen3Next config.json: convert from-hf)"
            )
    if m.full_attention_interval < 2 or m.num_layers % m.full_attention_interval:
        raise JaxdistError(
            f"model.full_attention_interval={m.full_attention_interval} must be >= 2 and divide "
            f"model.num_layers={m.num_layers}"
        )
    if m.linear_value_heads % m.linear_key_heads:
        raise JaxdistError(
            f"model.linear_value_heads={m.linear_value_heads} must be a multiple of model.linear_key_heads={m.linear_key_heads}"
        )
    if int(m.head_dim * m.rope_fraction) % 2:
        raise JaxdistError(f"model.rope_fraction={m.rope_fraction} x head_dim={m.head_dim} must be an even width")
    if cfg.data.document_mask:  # refused here, at start-up, rather than by the model once traced
        raise JaxdistError(
            "data.document_mask=true (packed documents; prepare --chat data needs it) is not supported by "
            "model.family=qwen3_next yet: its linear-attention state would run from one document into the next; "
            "train it on unpacked text (data.document_mask=false), not on chat data"
        )
    extra = [t for t in cfg.lora.targets if t not in ("q", "k", "v", "o")] if cfg.lora.rank else []
    if extra:
        raise JaxdistError(
            f"lora.targets names {', '.join(extra)}: Qwen3-Next takes adapters on its full-attention layers' "
            f"q/k/v/o only here (not the experts, shared expert or DeltaNet projections); set lora.targets=[q,k,v,o]"
        )
