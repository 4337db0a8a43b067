"""The decoder's Hugging Face families (Llama, Qwen2, Qwen3, Mistral, Mixtral, Qwen3-MoE): which
config.json fields each reads into the `model.*` switches of `models/llama.py`, and its per-layer
tensor names. A family is configuration, not a fork; the common fields (shapes, rope, norms) are
`jaxdist.hf.mapping`'s.
"""

from __future__ import annotations

from jaxdist.config import ModelConfig
from jaxdist.errors import JaxdistError
from jaxdist.models.hf_spec import Family

DENSE = {"moe_experts": 0, "moe_shared_experts": 0, "moe_every": 1, "moe_mlp_dim": 0, "moe_norm_topk": True}
PLAIN = {"qkv_bias": False, "qk_norm": False, "sliding_window": 0}
# Qwen's sliding-window fields only act with use_sliding_window=true (refused): otherwise inert.
QWEN_WINDOW = frozenset({"sliding_window", "max_window_layers", "layer_types"})


def _window(get, where) -> int:
    w = get("sliding_window")
    if w is not None and (not isinstance(w, int) or w < 1):
        raise JaxdistError(f"{where}: sliding_window={w!r} must be a positive integer or null")
    return int(w or 0)


def _full_attention(get, where) -> None:
    kinds = set(get("layer_types") or ["full_attention"])
    if kinds != {"full_attention"}:
        raise JaxdistError(
            f"{where}: layer_types {sorted(kinds)} is not supported (per-layer local/global attention "
            "is not implemented); only full_attention layers"
        )


def _moe_common(get, experts: int) -> dict:
    return {
        "moe_experts": int(experts),
        "moe_topk": int(get("num_experts_per_tok")),
        "moe_router": "softmax",
        "moe_shared_experts": 0,
    }


def _read_llama(get, where):
    return {**PLAIN, **DENSE}


def _read_qwen2(get, where):
    _full_attention(get, where)
    return {**PLAIN, **DENSE, "qkv_bias": True}


def _read_qwen3(get, where):
    _full_attention(get, where)
    return {**PLAIN, **DENSE, "qk_norm": True}


def _read_mistral(get, where):
    return {**PLAIN, **DENSE, "sliding_window": _window(get, where)}


def _read_mixtral(get, where):
    fields = {**PLAIN, **_moe_common(get, get("num_local_experts")), "sliding_window": _window(get, where)}
    return {**fields, "moe_every": 1, "moe_mlp_dim": 0, "moe_norm_topk": True}


def _read_qwen3_moe(get, where):
    _full_attention(get, where)
    if get("mlp_only_layers"):
        raise JaxdistError(
            f"{where}: mlp_only_layers={get('mlp_only_layers')} is not supported (the scanned layer stack "
            "needs a periodic dense/sparse pattern: use decoder_sparse_step); only []"
        )
    # The Hub spells it num_experts; transformers 5 writes num_local_experts.
    experts = get("num_local_experts") if get("num_local_experts") is not None else get("num_experts")
    step = int(get("decoder_sparse_step"))
    fields = {**PLAIN, **_moe_common(get, experts), "qk_norm": True}
    return {
        **fields,
        "moe_every": step,
        "moe_mlp_dim": int(get("moe_intermediate_size")),
        "moe_norm_topk": bool(get("norm_topk_prob")),
    }


def _write_llama(m, src):
    return {"attention_bias": False, "mlp_bias": False}


def _write_qwen(m, src):
    return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": m.num_layers}


def _write_qwen3(m, src):
    return {**_write_qwen(m, src), "attention_bias": False}


def _write_mistral(m, src):
    return {"sliding_window": m.sliding_window or None}


def _moe_written(m, src) -> dict:
    return {
        "num_experts_per_tok": m.moe_topk,
        "output_router_logits": False,
        "router_aux_loss_coef": src.get("router_aux_loss_coef", m.moe_aux_weight),
    }


def _write_mixtral(m, src):
    # Mixtral has one inner width: its experts'.
    inner = m.moe_mlp_dim or m.mlp_dim
    return {**_write_mistral(m, src), **_moe_written(m, src), "num_local_experts": m.moe_experts,
            "intermediate_size": inner, "router_jitter_noise": 0.0}  # fmt: skip


def _write_qwen3_moe(m, src):
    return {
        **_write_qwen3(m, src),
        **_moe_written(m, src),
        "num_experts": m.moe_experts,
        "moe_intermediate_size": m.moe_mlp_dim or m.mlp_dim,
        "decoder_sparse_step": m.moe_every,
        "mlp_only_layers": [],
        "norm_topk_prob": m.moe_norm_topk,
    }


def exportable(m: ModelConfig) -> None:
    """Nothing, or a one-line error naming the switch the architecture cannot
    hold (transformers would load such a model without error and compute something else)."""
    f = BY_NAME[m.family]
    moe = f.experts != ()
    wants = {
        "qkv_bias": f.name == "qwen2",
        "qk_norm": f.name in ("qwen3", "qwen3_moe"),
    }
    for key, value in wants.items():
        if getattr(m, key) != value:
            fix = {"qkv_bias": "qwen2", "qk_norm": "qwen3 or qwen3_moe"}[key] if not value else "llama"
            raise JaxdistError(
                f"model.{key}={str(getattr(m, key)).lower()}: {f.architecture} "
                f"{'always has' if value else 'has no'} it, so the export would compute something else; "
                f"export with model.family={fix}"
            )
    if m.sliding_window and f.name not in ("mistral", "mixtral"):
        raise JaxdistError(
            f"model.sliding_window={m.sliding_window}: {f.architecture} has no sliding window here; "
            "export with model.family=mistral"
        )
    if bool(m.moe_experts) != moe:
        raise JaxdistError(
            f"model.moe_experts={m.moe_experts}: {f.architecture} is "
            f"{'a mixture of experts' if moe else 'dense'}; export with model.family="
            f"{'mixtral or qwen3_moe' if m.moe_experts else 'llama'}"
        )
    if moe:
        bad = [
            (k, v)
            for k, v, ok in [
                ("moe_router", m.moe_router, "softmax"),
                ("moe_shared_experts", m.moe_shared_experts, 0),
                ("moe_every", m.moe_every, 1 if f.name == "mixtral" else m.moe_every),
                ("moe_norm_topk", m.moe_norm_topk, True if f.name == "mixtral" else m.moe_norm_topk),
            ]
            if v != ok
        ]
        if bad:
            raise JaxdistError(
                f"model.{bad[0][0]}={bad[0][1]!r} has no {f.architecture} form; export a model "
                "with the architecture's routing (softmax, no shared experts"
                f"{', every layer sparse, renormalised top-k' if f.name == 'mixtral' else ''})"
            )
    if m.embed_scale != 1.0:
        raise JaxdistError(
            f"model.embed_scale={m.embed_scale}: {f.architecture} does not scale its embeddings, so the "
            "exported model would compute something else; export a model trained with model.embed_scale=1"
        )


LLAMA_ONLY = {"attention_bias": False, "mlp_bias": False}
QWEN_REQUIRED = {"use_sliding_window": False}
MOE_IGNORED = frozenset({"router_aux_loss_coef", "output_router_logits"})  # training-loss settings

QWEN_DEFAULTS = {"vocab_size": 151936, "intermediate_size": 22016, "max_position_embeddings": 32768}
MISTRAL_DEFAULTS = {"intermediate_size": 14336, "sliding_window": 4096}

FAMILIES = tuple(
    [
        Family(
            name="llama",
            architecture="LlamaForCausalLM",
            model_type="llama",
            defaults={},
            required=LLAMA_ONLY,
            mapped=frozenset(),
            ignored=frozenset(),
            read=_read_llama,
            write=_write_llama,
            exportable=exportable,
        ),
        Family(
            name="qwen2",
            architecture="Qwen2ForCausalLM",
            model_type="qwen2",
            defaults=QWEN_DEFAULTS,
            required={**QWEN_REQUIRED, "use_mrope": False},  # Qwen2-VL's multimodal rotary
            mapped=frozenset({"layer_types"}),
            ignored=QWEN_WINDOW,
            read=_read_qwen2,
            write=_write_qwen,
            exportable=exportable,
        ),
        Family(
            name="qwen3",
            architecture="Qwen3ForCausalLM",
            model_type="qwen3",
            defaults=QWEN_DEFAULTS,
            required={**QWEN_REQUIRED, "attention_bias": False},  # true would add an o_proj bias too
            mapped=frozenset({"layer_types"}),
            ignored=QWEN_WINDOW,
            read=_read_qwen3,
            write=_write_qwen3,
            exportable=exportable,
        ),
        Family(
            name="mistral",
            architecture="MistralForCausalLM",
            model_type="mistral",
            defaults=MISTRAL_DEFAULTS,
            required={},
            mapped=frozenset({"sliding_window"}),
            ignored=frozenset(),
            read=_read_mistral,
            write=_write_mistral,
            exportable=exportable,
        ),
        Family(
            name="mixtral",
            architecture="MixtralForCausalLM",
            model_type="mixtral",
            defaults={
                **MISTRAL_DEFAULTS,
                "sliding_window": None,
                "rope_theta": 1e6,
                "num_local_experts": 8,
                "num_experts_per_tok": 2,
            },  # fmt: skip
            required={"router_jitter_noise": 0.0},  # training-time noise on the router logits
            mapped=frozenset({"sliding_window", "num_local_experts", "num_experts_per_tok"}),
            ignored=MOE_IGNORED,
            read=_read_mixtral,
            write=_write_mixtral,
            exportable=exportable,
            experts=("block_sparse_moe.gate", "block_sparse_moe.experts.{e}", ("w1", "w3", "w2")),
        ),
        Family(
            name="qwen3_moe",
            architecture="Qwen3MoeForCausalLM",
            model_type="qwen3_moe",
            defaults={
                **QWEN_DEFAULTS,
                "intermediate_size": 6144,
                "num_experts": 128,
                "num_experts_per_tok": 8,
                "moe_intermediate_size": 768,
                "decoder_sparse_step": 1,
                "norm_topk_prob": False,
                "mlp_only_layers": [],
            },  # fmt: skip
            required={**QWEN_REQUIRED, "attention_bias": False},
            mapped=frozenset(
                {
                    "layer_types",
                    "num_experts",
                    "num_local_experts",
                    "num_experts_per_tok",
                    "moe_intermediate_size",
                    "decoder_sparse_step",
                    "mlp_only_layers",
                    "norm_topk_prob",
                }
            ),  # fmt: skip
            ignored=QWEN_WINDOW | MOE_IGNORED,
            read=_read_qwen3_moe,
            write=_write_qwen3_moe,
            exportable=exportable,
            experts=("mlp.gate", "mlp.experts.{e}", ("gate_proj", "up_proj", "down_proj")),
        ),
    ]
)

BY_NAME = {f.name: f for f in FAMILIES}


# One decoder layer's tensors by role: (path in the layer's parameters, Hugging Face name, n_in — the
# axes that are the matmul's input, 0 for a vector). `layer_tensors` lists them by name, in file order.
LAYER_TENSORS = {
    "attn_norm": (("attn_norm", "scale"), "model.layers.{i}.input_layernorm.weight", 0),
    "q_proj": (("attn", "wq_DNH"), "model.layers.{i}.self_attn.q_proj.weight", 1),
    "k_proj": (("attn", "wk_DKH"), "model.layers.{i}.self_attn.k_proj.weight", 1),
    "v_proj": (("attn", "wv_DKH"), "model.layers.{i}.self_attn.v_proj.weight", 1),
    "o_proj": (("attn", "wo_NHD"), "model.layers.{i}.self_attn.o_proj.weight", 2),
    "mlp_norm": (("mlp_norm", "scale"), "model.layers.{i}.post_attention_layernorm.weight", 0),
    "gate_proj": (("mlp", "w_gate_DF"), "model.layers.{i}.mlp.gate_proj.weight", 1),
    "up_proj": (("mlp", "w_up_DF"), "model.layers.{i}.mlp.up_proj.weight", 1),
    "down_proj": (("mlp", "w_down_FD"), "model.layers.{i}.mlp.down_proj.weight", 1),
}
ATTENTION = ("attn_norm", "q_proj", "k_proj", "v_proj", "o_proj")  # before the optional bias / q-k norms
DENSE_FFN = ("gate_proj", "up_proj", "down_proj")  # a dense layer's feed-forward (a sparse one: its experts)
BIAS_TENSORS = [
    (("attn", "bq_NH"), "model.layers.{i}.self_attn.q_proj.bias", -1),
    (("attn", "bk_KH"), "model.layers.{i}.self_attn.k_proj.bias", -1),
    (("attn", "bv_KH"), "model.layers.{i}.self_attn.v_proj.bias", -1),
]
QK_NORM_TENSORS = [
    (("attn", "q_norm", "scale"), "model.layers.{i}.self_attn.q_norm.weight", 0),
    (("attn", "k_norm", "scale"), "model.layers.{i}.self_attn.k_norm.weight", 0),
]


def layer_tensors(m: ModelConfig, sparse: bool) -> list[tuple]:
    """(path, hf name, n_in, per expert) of one decoder layer, dense or sparse."""
    out = [(*LAYER_TENSORS[name], False) for name in ATTENTION]
    out += [(*t, False) for t in BIAS_TENSORS] if m.qkv_bias else []
    out += [(*t, False) for t in QK_NORM_TENSORS] if m.qk_norm else []
    out.append((*LAYER_TENSORS["mlp_norm"], False))
    if not sparse:
        return out + [(*LAYER_TENSORS[name], False) for name in DENSE_FFN]
    experts = BY_NAME[m.family].experts
    if not experts:
        exportable(m)  # a dense family: the one-line error naming model.moe_experts
    router, expert, (gate, up, down) = experts
    prefix = "model.layers.{i}."
    return out + [
        (("mlp", "router_DE"), f"{prefix}{router}.weight", 1, False),
        (("mlp", "w_gate_EDF"), f"{prefix}{expert}.{gate}.weight", 1, True),
        (("mlp", "w_up_EDF"), f"{prefix}{expert}.{up}.weight", 1, True),
        (("mlp", "w_down_EFD"), f"{prefix}{expert}.{down}.weight", 1, True),
    ]
