"""Gemma 3's Hugging Face family (`Gemma3ForCausalLM`, model_type gemma3_text): the config.json fields
read into `model.*` (the layer pattern, the two rotary bases, query_pre_attn_scalar) and written back,
and one layer's tensor names (four norms around attention and MLP, q/k norms)."""

from __future__ import annotations

from jaxdist.config import ModelConfig
from jaxdist.errors import JaxdistError
from jaxdist.models.hf_spec import Family

ACT = "gelu_pytorch_tanh"
DEFAULTS = {  # transformers' Gemma3TextConfig defaults that differ from Llama's
    "vocab_size": 262208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1e6,
    "tie_word_embeddings": True,
    "max_position_embeddings": 131072,
    "sliding_window": 4096,
    "query_pre_attn_scalar": 256,
}
GLOBAL_THETA, LOCAL_THETA, PATTERN = 1e6, 1e4, 6


def tabled_pp(m: ModelConfig) -> str:
    """Why a table pipeline schedule cannot run Gemma 3: only the scan schedules carry its per-layer
    windows and rotary bases (staged beside the weights, as gpt-oss's windows)."""
    return "its per-layer windows and rotary bases are carried by the scan schedules only"


def _pattern(get, where, layers: int) -> int:
    n = get("sliding_window_pattern") or get("_sliding_window_pattern") or PATTERN
    want = ["sliding_attention" if (i + 1) % n else "full_attention" for i in range(layers)]
    kinds = get("layer_types")
    if kinds is not None and list(kinds) != want:
        raise JaxdistError(
            f"{where}: layer_types {kinds} is not every {n}-th layer full attention; jaxdist's Gemma 3 takes "
            "periodic patterns only (sliding_window_pattern)"
        )
    return int(n)


def _read(get, where) -> dict:
    window = get("sliding_window")
    if not isinstance(window, int) or window < 1:
        raise JaxdistError(f"{where}: sliding_window={window!r} must be a positive integer")
    return {
        "qkv_bias": False,
        "qk_norm": True,
        "sliding_window": window,
        "sliding_window_pattern": _pattern(get, where, int(get("num_hidden_layers"))),
        "query_pre_attn_scalar": float(get("query_pre_attn_scalar")),
        "moe_experts": 0,
        "embed_scale": 1.0,  # Gemma's sqrt(d_model) is the architecture's own (models/gemma3.py)
    }


def _kind(params: dict | None, where, layer: str) -> tuple[float | None, float]:
    """(rope_theta or None, linear factor) of one layer kind's rope parameters."""
    params = params or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "linear") or (layer == "sliding" and kind != "default"):
        raise JaxdistError(
            f"{where}: {layer} layers' rope type {kind!r} is not supported (Gemma 3: default, linear on full layers)"
        )
    return params.get("rope_theta"), float(params.get("factor", 1.0)) if kind == "linear" else 1.0


def _rope(hf: dict, where) -> dict:
    """transformers 5's rope_parameters {sliding_attention, full_attention}, or the Hub's rope_theta +
    rope_local_base_freq + rope_scaling (which applies to the full layers)."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        full_theta, factor = _kind(params.get("full_attention"), where, "full")
        local_theta, _ = _kind(params.get("sliding_attention"), where, "sliding")
    else:
        full_theta, factor = _kind(hf.get("rope_scaling") or params, where, "full")
        full_theta, local_theta = hf.get("rope_theta") or full_theta, hf.get("rope_local_base_freq")
    return {
        "rope_theta": float(full_theta or GLOBAL_THETA),
        "rope_local_theta": float(local_theta or LOCAL_THETA),
        "rope_scaling": "linear" if factor != 1.0 else "none",
        "rope_factor": factor if factor != 1.0 else 8.0,  # 8.0: the field's default when unused
    }


def _number(x: float) -> int | float:
    return int(x) if float(x).is_integer() else float(x)


def _write(m: ModelConfig, src: dict) -> dict:
    linear = {"rope_type": "linear", "factor": m.rope_factor} if m.rope_scaling == "linear" else None
    return {
        "hidden_act": ACT,
        "hidden_activation": ACT,
        "rope_scaling": linear,
        "rope_local_base_freq": m.rope_local_theta or m.rope_theta,
        "sliding_window": m.sliding_window,
        "sliding_window_pattern": m.sliding_window_pattern,
        "query_pre_attn_scalar": _number(m.query_pre_attn_scalar or m.head_dim),  # transformers wants an int
        "attention_bias": False,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "use_bidirectional_attention": False,
    }


def exportable(m: ModelConfig) -> None:
    bad = [(k, getattr(m, k)) for k, ok in (("qkv_bias", False), ("moe_experts", 0), ("embed_scale", 1.0))
           if getattr(m, k) != ok]  # fmt: skip
    if bad:
        raise JaxdistError(f"model.{bad[0][0]}={bad[0][1]!r}: Gemma3ForCausalLM has no such form; remove it")
    if not m.sliding_window:
        raise JaxdistError("model.sliding_window=0: Gemma3ForCausalLM has windowed layers; set model.sliding_window")


FAMILY = Family(
    name="gemma3",
    architecture="Gemma3ForCausalLM",
    model_type="gemma3_text",
    defaults=DEFAULTS,
    required={
        "hidden_act": ACT,
        "hidden_activation": ACT,
        "attention_bias": False,
        "final_logit_softcapping": None,  # not implemented: any value is refused
        "attn_logit_softcapping": None,
        "use_bidirectional_attention": False,  # EmbeddingGemma's encoder mode
    },
    mapped=frozenset(
        {
            "sliding_window",
            "sliding_window_pattern",
            "_sliding_window_pattern",
            "layer_types",
            "query_pre_attn_scalar",
            "rope_local_base_freq",
        }
    ),  # fmt: skip
    ignored=frozenset({"cache_implementation"}),
    read=_read,
    write=_write,
    rope=_rope,
    exportable=exportable,
)

P = "model.layers.{i}."
LAYER = [
    (("attn_norm", "scale"), P + "input_layernorm.weight", 0),
    (("attn", "wq_DNH"), P + "self_attn.q_proj.weight", 1),
    (("attn", "wk_DKH"), P + "self_attn.k_proj.weight", 1),
    (("attn", "wv_DKH"), P + "self_attn.v_proj.weight", 1),
    (("attn", "wo_NHD"), P + "self_attn.o_proj.weight", 2),
    (("attn", "q_norm", "scale"), P + "self_attn.q_norm.weight", 0),
    (("attn", "k_norm", "scale"), P + "self_attn.k_norm.weight", 0),
    (("attn_post_norm", "scale"), P + "post_attention_layernorm.weight", 0),
    (("mlp_norm", "scale"), P + "pre_feedforward_layernorm.weight", 0),
    (("mlp", "w_gate_DF"), P + "mlp.gate_proj.weight", 1),
    (("mlp", "w_up_DF"), P + "mlp.up_proj.weight", 1),
    (("mlp", "w_down_FD"), P + "mlp.down_proj.weight", 1),
    (("mlp_post_norm", "scale"), P + "post_feedforward_layernorm.weight", 0),
]


def layer_tensors(m: ModelConfig, sparse: bool) -> list[tuple]:
    """(path, hf name, n_in, per expert) of one Gemma 3 layer (always dense)."""
    return [(*t, False) for t in LAYER]
