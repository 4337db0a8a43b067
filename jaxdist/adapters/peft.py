"""LoRA adapters in PEFT's format: `adapter_config.json` + `adapter_model.safetensors`, which
`peft.PeftModel.from_pretrained(base_model, DIR)` loads onto the original Hugging Face model.

PEFT's LoRA on a Linear: y = W x + (alpha / r) B (A x) with A (r, in), B (out, r), stored under
`base_model.model.<module path>.lora_A.weight` / `.lora_B.weight`. Ours are A (*in, r), B (r, *out)
per layer (HF's q_proj (N H, D) is our wq_DNH flattened (D, N H) and transposed), so A -> flatten ->
transpose, B -> flatten -> transpose.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from jaxdist.adapters.lora import IN_DIMS, TARGETS, A, B, per_layer_shapes
from jaxdist.errors import JaxdistError

MODULES = {  # lora.targets name -> the HF module path (its last part: peft's target_modules entry)
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
    "q_a": "self_attn.q_a_proj",
    "q_b": "self_attn.q_b_proj",
    "kv_a": "self_attn.kv_a_proj_with_mqa",
    "kv_b": "self_attn.kv_b_proj",
}
WEIGHT_MODULES = {w: MODULES[t] for t, (_, w, _) in TARGETS.items()}  # each adapted matrix's HF module


def dense_offset(m) -> int:
    """HF's number of the MoE stack's first layer: DeepSeek-V3's `dense_layers` (its dense first layers are
    the `dense_blocks` stack, HF layers 0..k-1), else 0."""
    if m is None or m.family != "deepseek_v3" or not m.moe_experts:
        return 0
    return min(m.dense_layers, m.num_layers)


def tree_tensors(trainable: dict, lora, dtype=np.float32, m=None) -> dict[str, np.ndarray]:
    """`adapter_tensors` of a whole (host, unstaged) trainable tree: `blocks` and, for DeepSeek-V3, `dense_blocks`."""
    return adapter_tensors(trainable["blocks"], lora, dtype, m, trainable.get("dense_blocks"))


def adapter_tensors(blocks: dict, lora, dtype=np.float32, m=None, dense: dict | None = None) -> dict[str, np.ndarray]:
    """PEFT's tensors from the (host, unstaged) `params['blocks']` of a LoRA run. A stack of layer groups
    (Qwen3-Next: `blocks['layers'][j]`, the group's j-th layer) needs the model config `m` for the
    group size: HF layer g * n + j. `dense`: DeepSeek-V3's `params['dense_blocks']` (HF layers 0..k-1;
    `blocks` then starts at HF layer k, which `m` gives)."""
    if "layers" in blocks:
        if m is None:
            raise ValueError("adapter_tensors of grouped layers needs the model config")
        units = [(0, m.full_attention_interval, int(j), unit) for j, unit in blocks["layers"].items()]
    else:
        if dense is not None and m is None:
            raise ValueError("adapter_tensors of a dense stack needs the model config")
        units = [(0, 1, 0, dense)] if dense is not None else []
        units.append((dense_offset(m), 1, 0, blocks))
    out = {}
    for target in lora.targets:
        part, weight, _ = TARGETS[target]
        for first, n, j, unit in units:
            if weight + A not in unit.get(part, {}):
                continue
            a, b = np.asarray(unit[part][weight + A]), np.asarray(unit[part][weight + B])
            r = a.shape[-1]
            for g in range(a.shape[0]):
                name = f"base_model.model.model.layers.{first + g * n + j}.{MODULES[target]}"
                out[f"{name}.lora_A.weight"] = np.ascontiguousarray(a[g].reshape(-1, r).T.astype(dtype))
                out[f"{name}.lora_B.weight"] = np.ascontiguousarray(b[g].reshape(r, -1).T.astype(dtype))
    return out


def placements(m, targets) -> list[tuple[str, str, str, list[int]]]:
    """(stack, submodule, weight, HF layers) of every adapted matrix `targets` give this model, in the order
    of `targets`: DeepSeek-V3's MLA in its dense first layers (`dense_blocks`, HF 0..k-1) and its MoE ones
    (`blocks`, HF k..); Qwen3-Next's attention in its full-attention layers; every other family's in every layer."""
    k = dense_offset(m)
    out = []
    for target in targets:
        part, weight, _ = TARGETS[target]
        if m.family != "deepseek_v3":
            out.append(("blocks", part, weight, carriers(m)))
            continue
        out += [("dense_blocks", part, weight, list(range(k)))] if k else []
        out.append(("blocks", part, weight, list(range(k, m.num_layers))))
    return out


def carriers(m) -> list[int]:
    """The HF layers whose projections take adapters: all, or Qwen3-Next's full-attention ones (the
    last of each group of `full_attention_interval`)."""
    if m.family == "qwen3_next":
        n = m.full_attention_interval
        return [i for i in range(m.num_layers) if i % n == n - 1]
    return list(range(m.num_layers))


def adapter_config(lora, base_model: str = "", revision: str | None = None) -> dict:
    """`base_model_name_or_path` (a Hub id or a folder) and `revision` are what
    `AutoPeftModelForCausalLM.from_pretrained(DIR)` loads the base from."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "revision": revision,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": [MODULES[t].split(".")[-1] for t in lora.targets],
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": bool(lora.rslora),
        "use_dora": False,
        "inference_mode": True,
        "modules_to_save": None,
    }


def write(
    out_dir: Path,
    blocks: dict,
    lora,
    base_model: str = "",
    dtype=np.float32,
    revision: str | None = None,
    m=None,
    dense: dict | None = None,
) -> list[Path]:
    """The adapter files of `blocks` (and DeepSeek-V3's `dense` first layers) in `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = adapter_tensors(blocks, lora, dtype, m, dense)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), {"format": "pt"})
    config = adapter_config(lora, base_model, revision)
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return [out_dir / "adapter_model.safetensors", out_dir / "adapter_config.json"]


def read(adapter_dir: Path, m) -> tuple[dict, dict]:
    """A PEFT LoRA adapter directory -> (lora config overrides {rank, alpha, targets[, rslora]}, `blocks` adapters in
    jaxdist's stacked layout, numpy float32), the inverse of `adapter_tensors` (DeepSeek-V3's dense first
    layers: `read_tree`)."""
    lora, tree = read_tree(adapter_dir, m)
    if "dense_blocks" in tree:
        raise ValueError("this model has a dense_blocks stack: use read_tree")
    return lora, tree["blocks"]


def read_tree(adapter_dir: Path, m) -> tuple[dict, dict]:
    """A PEFT LoRA adapter directory -> (lora config overrides {rank, alpha, targets[, rslora]}, the trainable
    tree {'blocks': ...[, 'dense_blocks': ...]} in jaxdist's stacked layout, numpy float32), the inverse of
    `tree_tensors`."""

    adapter_dir = Path(adapter_dir)
    conf = _config(adapter_dir)
    by_module = {v.split(".")[-1]: k for k, v in MODULES.items()}
    modules = conf["target_modules"]
    modules = [modules] if isinstance(modules, str) else modules
    unknown = [x for x in modules if x not in by_module]
    # Anything peft trains beside A and B (biases, lm_head / embeddings via modules_to_save, DoRA
    # magnitudes) would be dropped silently by a reader that takes A and B only: refuse it by name.
    special = [
        k
        for k in (
            "use_dora",
            "rank_pattern",
            "alpha_pattern",
            "layers_to_transform",
            "modules_to_save",
            "lora_bias",
            "exclude_modules",
            "target_parameters",
        )
        if conf.get(k)
    ]
    special += [f"bias={conf['bias']}"] if conf.get("bias", "none") != "none" else []
    if conf.get("peft_type") != "LORA" or unknown or special:
        raise JaxdistError(
            f"{adapter_dir}: only plain LoRA on {', '.join(by_module)} reads into jaxdist "
            f"(peft_type={conf.get('peft_type')}, unknown modules {unknown}, unsupported {special})"
        )
    targets = [t for t in MODULES if MODULES[t].split(".")[-1] in modules]
    r = int(conf["r"])
    tensors = _tensors(adapter_dir / "adapter_model.safetensors")
    placed = placements(m, targets)
    expected = {
        f"base_model.model.model.layers.{i}.{WEIGHT_MODULES[w]}.lora_{x}.weight"
        for _, _, w, layers in placed
        for i in layers
        for x in "AB"
    }
    missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or extra:
        raise JaxdistError(
            f"{adapter_dir}/adapter_model.safetensors does not hold exactly the A and B tensors of "
            f"{len(targets)} module(s) over this model's layers: missing {missing[:2]}, unexpected {extra[:2]} "
            f"({len(missing)} / {len(extra)} in all); is it an adapter for this base model?"
        )
    shapes = per_layer_shapes(m)
    tree: dict = {}
    for stack, part, weight, layers in placed:
        n_in, shape = IN_DIMS[weight], shapes[weight]
        a, b = [], []
        for i in layers:
            name = f"base_model.model.model.layers.{i}.{WEIGHT_MODULES[weight]}"
            ta, tb = tensors[f"{name}.lora_A.weight"], tensors[f"{name}.lora_B.weight"]
            want = ((r, math.prod(shape[:n_in])), (math.prod(shape[n_in:]), r))
            if (ta.shape, tb.shape) != want:
                raise JaxdistError(
                    f"{adapter_dir}: {name} has lora_A {ta.shape} / lora_B {tb.shape}, this base model needs "
                    f"{want[0]} / {want[1]} (r={r}); is it an adapter for this base model?"
                )
            a.append(ta.T.reshape(*shape[:n_in], r))
            b.append(tb.T.reshape(r, *shape[n_in:]))
        unit = tree.setdefault(stack, {})
        if m.family == "qwen3_next":  # the group's full-attention layer
            unit = unit.setdefault("layers", {}).setdefault(m.full_attention_interval - 1, {})
        unit.setdefault(part, {})[weight + A] = np.stack(a).astype(np.float32)
        unit[part][weight + B] = np.stack(b).astype(np.float32)
    lora = {"rank": r, "alpha": float(conf["lora_alpha"]), "targets": targets}
    return lora | ({"rslora": True} if conf.get("use_rslora") else {}), tree


def _config(adapter_dir: Path) -> dict:
    """adapter_config.json as a dict with the keys read, or a one-line error naming the file."""
    path = adapter_dir / "adapter_config.json"
    if not path.is_file():
        raise JaxdistError(
            f"{path} not found; pass a PEFT adapter folder (adapter_config.json + adapter_model.safetensors)"
        )
    try:
        conf = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise JaxdistError(f"{path} is not readable JSON ({type(e).__name__}); re-save the adapter") from None
    if not isinstance(conf, dict):
        raise JaxdistError(f"{path} must hold a JSON object; re-save the adapter")
    bad = [k for k in ("r", "lora_alpha", "target_modules") if k not in conf]
    r, alpha, modules = conf.get("r"), conf.get("lora_alpha"), conf.get("target_modules")
    if not bad and not (isinstance(r, int) and not isinstance(r, bool) and r > 0):
        bad.append(f"r={r!r} (a positive integer)")
    if not bad and not (
        isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and math.isfinite(alpha) and alpha > 0
    ):
        bad.append(f"lora_alpha={alpha!r} (a positive number)")
    if not bad and not (
        isinstance(modules, str) or (isinstance(modules, list) and all(isinstance(m, str) for m in modules))
    ):
        bad.append(f"target_modules={modules!r} (a list of module names)")
    if bad:
        raise JaxdistError(f"{path}: missing or invalid {', '.join(bad)}; is it a PEFT LoRA adapter?")
    return conf


def _tensors(path: Path) -> dict[str, np.ndarray]:
    """The adapter's tensors: a float dtype and finite values, or a one-line error naming the first bad one."""
    if not path.is_file():
        raise JaxdistError(f"{path} not found; a PEFT adapter folder holds adapter_model.safetensors beside its config")
    try:
        tensors = load_file(str(path))
    except (OSError, SafetensorError, ValueError, TypeError) as e:
        raise JaxdistError(
            f"{path} is not a readable safetensors file ({type(e).__name__}); re-save the adapter"
        ) from None
    for name, t in sorted(tensors.items()):
        if t.dtype.kind != "f" and str(t.dtype) != "bfloat16":
            raise JaxdistError(f"{path}: {name} is {t.dtype}, not a float tensor; is it a LoRA adapter?")
        if not np.all(np.isfinite(t.astype(np.float32))):
            raise JaxdistError(f"{path}: {name} holds NaN or Inf; the adapter is damaged (re-save or re-train it)")
    return tensors
