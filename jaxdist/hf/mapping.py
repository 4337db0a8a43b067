"""Hugging Face decoders <-> jaxdist: the config mapping and the tensor name/layout table (the
families' differences are their architectures' entries in `jaxdist.models.registry`).

HF stores every linear layer as (out, in); jaxdist stores (in..., out...) with heads split out, e.g.
`q_proj.weight` (N*H, D) is `wq_DNH` (D, N, H) = W.T reshaped. HF's RoPE is rotate-half, as ours, so no
q/k permutation is needed (Meta's original checkpoints are interleaved; convert those with
transformers first). Reading and writing the tensors is in `tensors.py`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from jaxdist import config
from jaxdist.config import Config, ModelConfig, parse_override
from jaxdist.config.model_section import SHAPE_FIELDS
from jaxdist.errors import JaxdistError
from jaxdist.hf import families
from jaxdist.models import registry

# transformers' LlamaConfig defaults: a field absent from config.json takes these.
HF_DEFAULTS = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "max_position_embeddings": 2048,
    "initializer_range": 0.02,
}
# Fields that must hold these values (anything else would be a different model than ours); each
# family adds its own (models/hf_spec.Family).
REQUIRED = {
    "hidden_act": "silu",
    "attention_dropout": 0.0,
    "partial_rotary_factor": 1.0,
}
# Fields read into ModelConfig (model_type and architectures are checked separately).
MAPPED = {
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "tie_word_embeddings",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "initializer_range",
    "model_type",
    "architectures",
}
# Fields that do not change the computation of the forward pass (token ids are kept for the export).
IGNORED = {
    "transformers_version",
    "torch_dtype",
    "dtype",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "max_position_embeddings",
    "use_cache",
    "pretraining_tp",
    "_name_or_path",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "id2label",
    "label2id",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "_attn_implementation_autoset",
}
ROPE_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
SHAPE_KEYS = (
    *SHAPE_FIELDS,
    "rope_theta",
    "norm_eps",
    "rope_scaling",
    "rope_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_max_len",
    *families.fields_of(ModelConfig()),
    *registry.OWNED,  # an architecture's own fields (DeepSeek-V3's ranks, Gemma 3's pattern)
)  # fields config.json decides


def read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise JaxdistError(f"{path} not found; pass a Hugging Face model directory (with {what})")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise JaxdistError(f"{path} is not valid JSON ({e}); re-download or fix the file") from None
    if not isinstance(data, dict):
        raise JaxdistError(f"{path} must hold a JSON object")
    return data


def _rope(hf: dict, where: Path) -> dict[str, Any]:
    """rope_theta + rope_scaling (Hub files, transformers 4) or rope_parameters (transformers 5)."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise JaxdistError(f"{where}: rope_scaling/rope_parameters must be an object, got {params!r}")
    theta = params.get("rope_theta", hf.get("rope_theta", HF_DEFAULTS["rope_theta"]))
    kind = params.get("rope_type", params.get("type", "default"))
    out = {"rope_theta": float(theta)}
    if kind == "default":
        return {**out, "rope_scaling": "none"}
    if kind != "llama3":
        raise JaxdistError(
            f"{where}: rope type {kind!r} is not supported (only default and llama3); convert another model"
        )
    params = {
        "original_max_position_embeddings": hf.get("max_position_embeddings", HF_DEFAULTS["max_position_embeddings"]),
        **params,
    }
    missing = [k for k in ROPE_FIELDS if k not in params]
    if missing:
        raise JaxdistError(f"{where}: llama3 rope scaling lacks {', '.join(missing)}; add them to config.json")
    unknown = set(params) - set(ROPE_FIELDS) - {"rope_type", "type", "rope_theta"}
    if unknown:
        raise JaxdistError(f"{where}: rope field {min(unknown)!r} is not supported; remove it or convert another model")
    return {
        **out,
        "rope_scaling": "llama3",
        "rope_factor": float(params["factor"]),
        "rope_low_freq_factor": float(params["low_freq_factor"]),
        "rope_high_freq_factor": float(params["high_freq_factor"]),
        "rope_original_max_len": int(params["original_max_position_embeddings"]),
    }


def model_fields(hf_dir: Path) -> dict[str, Any]:
    """config.json -> ModelConfig fields, or a one-line error naming the first unsupported field."""
    where = Path(hf_dir) / "config.json"
    hf = read_json(where, "config.json")
    family = families.of(hf, where)
    required = {k: v for k, v in {**REQUIRED, **family.required}.items() if k not in family.mapped}
    for key, value in hf.items():
        if key in required:
            if value != required[key] and value is not None:
                raise JaxdistError(
                    f"{where}: {key}={value!r} is not supported (jaxdist's {family.architecture} has "
                    f"{key}={required[key]!r}); convert another model"
                )
        elif key not in MAPPED | IGNORED | family.mapped | family.ignored:
            raise JaxdistError(
                f"{where}: field {key!r} is not supported by jaxdist's {family.architecture}; a model "
                "that needs it would compute differently — remove it only if it has no effect"
            )
    defaults = {**HF_DEFAULTS, **family.defaults}

    # Absent: transformers' default. Null: the default for the shape fields, else null (Mistral's
    # sliding_window: null is no window, absent is 4096).
    def get(k: str) -> Any:
        return hf[k] if k in hf and (hf[k] is not None or k not in HF_DEFAULTS) else defaults.get(k)

    heads, d_model = int(get("num_attention_heads")), int(get("hidden_size"))
    head_dim = hf.get("head_dim") or d_model // heads
    fields = {
        "num_layers": int(get("num_hidden_layers")),
        "d_model": d_model,
        "num_heads": heads,
        "num_kv_heads": int(hf.get("num_key_value_heads") or heads),
        "head_dim": int(head_dim),
        "mlp_dim": int(get("intermediate_size")),
        "vocab_size": int(get("vocab_size")),
        "tie_embeddings": bool(get("tie_word_embeddings")),
        "norm_eps": float(get("rms_norm_eps")),
        "init_std": float(get("initializer_range")),
        **(family.rope(hf, where) or _rope({**hf, "rope_theta": get("rope_theta")}, where)),
        "family": family.name,
        **family.read(get, where),
    }
    return fields


def apply(cfg: Config, hf_dir: Path, explicit: dict[str, Any] | None = None) -> Config:
    """`cfg` with the model shape of `hf_dir/config.json`. A shape field the user set (`explicit`)
    to another value is an error, not silently replaced."""
    fields = model_fields(hf_dir)
    for key, value in (explicit or {}).items():
        if key in fields and key in SHAPE_KEYS and fields[key] != value:
            raise JaxdistError(
                f"model.{key}={value!r} conflicts with {hf_dir}/config.json ({fields[key]!r}); "
                "drop the override: the model shape comes from the checkpoint"
            )
    return cfg.replace(model=fields)


def check_positions(seq_len: int, hf_dir: Path) -> None:
    """Refuse a training window past the positions the HF model was made for (config.json's
    max_position_embeddings): it would train silently on positions the model never saw."""
    where = Path(hf_dir) / "config.json"
    limit = read_json(where, "config.json").get("max_position_embeddings")
    if isinstance(limit, int) and 0 < limit < seq_len:
        raise JaxdistError(
            f"model.seq_len={seq_len} exceeds the model's max_position_embeddings={limit} (from {where}); "
            f"lower model.seq_len to at most {limit}, or pass --extend-context to train on longer windows on purpose"
        )


def model_overrides(overrides: list[str]) -> dict:
    """The model.* keys a user set on the command line (to refuse ones that contradict config.json)."""
    out = {}
    for text in overrides:
        section, name, value = parse_override(text)
        if section == "model":
            out[name] = value
    return out


def hf_config(cfg_path, overrides: list[str], hf_dir: Path, mesh: str | None = None):
    """The run config for an HF model: a config file and overrides, the model shape from config.json."""
    overrides = list(overrides) + ([f"mesh.shape={mesh}"] if mesh else [])
    return apply(config.load(cfg_path, overrides), hf_dir, model_overrides(overrides))


def to_hf_config(m: ModelConfig, dtype: str, source: dict | None = None) -> dict:
    """ModelConfig -> config.json (Hub spelling: rope_theta + rope_scaling, which transformers 5 reads too).
    Token ids and the context length come from the imported model's config when there was one."""
    source = source or {}
    family = families.exportable(m)
    rope = None
    if m.rope_scaling == "llama3":
        rope = {
            "rope_type": "llama3",
            "factor": m.rope_factor,
            "low_freq_factor": m.rope_low_freq_factor,
            "high_freq_factor": m.rope_high_freq_factor,
            "original_max_position_embeddings": m.rope_original_max_len,
        }
    common = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "hidden_size": m.d_model,
        "intermediate_size": m.mlp_dim,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_kv_heads,
        "head_dim": m.head_dim,
        "vocab_size": m.vocab_size,
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        "rope_scaling": rope,
        "tie_word_embeddings": m.tie_embeddings,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "initializer_range": m.init_std,
        "max_position_embeddings": source.get("max_position_embeddings", m.seq_len),
        "bos_token_id": source.get("bos_token_id"),
        "eos_token_id": source.get("eos_token_id"),
        "pad_token_id": source.get("pad_token_id"),
        "torch_dtype": dtype,
        "use_cache": True,
    }
    return {**common, **family.write(m, source)}


# ------------------------------------------------------------------------------------ tensor layout


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One jaxdist parameter and its HF counterpart. `n_in` > 0: HF stores (out, in) = the transpose of
    ours with our first `n_in` dims flattened as `in` and the rest as `out`; 0: the same layout; -1:
    HF stores ours flattened (a bias (N*H,) is our (N, H))."""

    path: tuple  # in the params dict
    hf: str  # HF name; '{i}' is the layer index for stacked tensors, '{e}' the expert's
    n_in: int
    stacked: bool
    experts: bool = False  # one HF tensor per expert: our leading (per-layer) dim is the expert
    every: int = 1  # stacked entry g is HF layer g * every + offset (model.moe_every > 1 groups)
    offset: int = 0
    depth: int = 0  # stacked entries (0: model.stack_depth; an architecture with two stacks says)
    shape: tuple = ()  # one layer's jaxdist shape (): the shared table (tensors.layer_shape)


def tensors(m: ModelConfig) -> list[Tensor]:
    """Every parameter of the model, in HF's file order."""
    arch = registry.of(m)
    if arch.hf_tensors is not None:  # an architecture with its own layout (several stacks)
        return [Tensor(**t) for t in arch.hf_tensors(m)]
    layer = arch.hf_layer  # one layer's tensors: the architecture's entry
    out = [Tensor(("embed_VD",), "model.embed_tokens.weight", 0, False)]
    n = m.moe_every if m.moe_experts else 1
    for j in range(n):  # n > 1: the scanned unit holds n layers (models/llama.py SparseGroup)
        where = ("blocks",) if n == 1 else ("blocks", "layers", j)
        for p, name, n_in, per_expert in layer(m, bool(m.moe_experts) and j == n - 1):
            out.append(Tensor((*where, *p), name, n_in, True, per_expert, n, j))
    out.append(Tensor(("final_norm", "scale"), "model.norm.weight", 0, False))
    if not m.tie_embeddings:
        out.append(Tensor(("head_DV",), "lm_head.weight", 1, False))
    return out


def _prod(shape) -> int:
    out = 1
    for x in shape:
        out *= int(x)
    return out


def hf_shape(shape: tuple[int, ...], n_in: int) -> tuple[int, ...]:
    """One layer's jaxdist shape -> its HF shape."""
    if n_in == -1:
        return (_prod(shape),)
    return tuple(shape) if n_in == 0 else (_prod(shape[n_in:]), _prod(shape[:n_in]))


def to_hf(a, n_in: int):
    """One layer's jaxdist array -> HF layout (numpy)."""
    if n_in == -1:
        return a.reshape(-1)
    return a if n_in == 0 else a.reshape(_prod(a.shape[:n_in]), -1).T


def get_path(tree: dict, path: tuple[str, ...]) -> Any:
    for k in path:
        tree = tree[k]
    return tree
