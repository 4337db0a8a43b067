"""LoRA adapters written in PEFT's format: `adapter_config.json` + `adapter_model.safetensors`, which
`peft.PeftModel.from_pretrained(base_model, DIR)` loads onto the original Hugging Face model; and the names
both directions share (our targets -> HF module paths). Reading them back: peft_read.py.

PEFT's LoRA on a Linear: y = W x + (alpha / r) B (A x) with A (r, in), B (out, r), stored under
`base_model.model.<module path>.lora_A.weight` / `.lora_B.weight`. Ours are A (*in, r), B (r, *out)
per layer (HF's q_proj (N H, D) is our wq_DNH flattened (D, N H) and transposed), so A -> flatten ->
transpose, B -> flatten -> transpose.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from jaxdist.adapters import layout
from jaxdist.adapters.lora import EXPERTS, FUSED, GATE_UP, TARGETS, A, B

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
    """HF's number of the MoE stack's first layer: `dense_layers` where the layout has a dense first stack
    (DeepSeek-V3's `dense_blocks`, HF layers 0..k-1), else 0."""
    if m is None or not layout.of(m).dense_stack or not m.moe_experts:
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
    for first, _, _, unit in units:
        out |= _expert_tensors(unit.get("mlp", {}), first, dtype)
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


def expert_names(mlp_has_gate_up: bool, mlp_has_down: bool, gate_up: str = GATE_UP) -> dict[str, str]:
    """peft's module paths of the expert adapters: one ParamWrapper per targeted parameter, nested, gate_up_proj
    the inner one (`base_layer`) when down_proj is adapted too (peft 0.21.2's files for DeepSeek-V3 and gpt-oss).
    `gate_up`: the adapter's name, GATE_UP (split gate/up weights) or FUSED (a fused weight)."""
    out = {}
    if mlp_has_gate_up:
        out[gate_up] = "mlp.experts.base_layer" if mlp_has_down else "mlp.experts"
    if mlp_has_down:
        out["w_down_EFD"] = "mlp.experts"
    return out


def _expert_tensors(mlp: dict, first: int, dtype) -> dict[str, np.ndarray]:
    """Routed-expert adapters as peft's ParamWrapper stores them, per layer: lora_A (r E, in) with expert e's A_e
    in rows e r..(e+1) r, lora_B (out, r E) with B_e in columns k E + e (gate_up: in = D, out = 2F, split: gate's
    rows then up's at rank 2r, fused: the weight's own interleaved columns at rank r; down: in = F, out = D)."""
    gate_up = FUSED if FUSED + A in mlp else GATE_UP
    names = expert_names(gate_up + A in mlp, "w_down_EFD" + A in mlp, gate_up)
    out = {}
    for weight, path in names.items():
        a, b = np.asarray(mlp[weight + A]), np.asarray(mlp[weight + B])
        for g in range(a.shape[0]):
            E, n_in, r = a[g].shape
            bg = b[g].reshape(E, r, -1)  # split gate_up's (2, F) -> 2F
            name = f"base_model.model.model.layers.{first + g}.{path}"
            out[f"{name}.lora_A.weight"] = np.ascontiguousarray(
                a[g].transpose(0, 2, 1).reshape(E * r, n_in).astype(dtype)
            )
            out[f"{name}.lora_B.weight"] = np.ascontiguousarray(bg.transpose(2, 1, 0).reshape(-1, r * E).astype(dtype))
    return out


def adapter_config(lora, base_model: str = "", revision: str | None = None, m=None) -> dict:
    """`base_model_name_or_path` (a Hub id or a folder) and `revision` are what
    `AutoPeftModelForCausalLM.from_pretrained(DIR)` loads the base from. Expert targets are written as peft
    saves them: target_parameters gate_up_proj (split gate/up, DeepSeek-V3: rank 2r, alpha 2 alpha; fused,
    gpt-oss: r, alpha) and down_proj."""
    experts = layout.of(m).experts if m is not None and m.moe_experts else ""
    if experts and set(EXPERTS) & set(lora.targets):
        fused = [
            *(["gate_up_proj"] if "gate" in lora.targets else []),
            *(["down_proj"] if "down" in lora.targets else []),
        ]
        pattern = {".*\\.gate_up_proj": 2} if "gate" in lora.targets and experts == "split" else {}
        plain = [t for t in lora.targets if t not in EXPERTS]
        return adapter_config(dataclasses.replace(lora, targets=plain), base_model, revision) | {
            "target_parameters": fused,
            "rank_pattern": {k: v * lora.rank for k, v in pattern.items()},
            "alpha_pattern": {k: v * lora.alpha for k, v in pattern.items()},
        }
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
    config = adapter_config(lora, base_model, revision, m)
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return [out_dir / "adapter_model.safetensors", out_dir / "adapter_config.json"]
