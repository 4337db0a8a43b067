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
from safetensors.numpy import load_file, save_file

from jaxdist.adapters.lora import TARGETS, A, B, per_layer_shapes
from jaxdist.errors import JaxdistError

MODULES = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}


def adapter_tensors(blocks: dict, lora, dtype=np.float32) -> dict[str, np.ndarray]:
    """PEFT's tensors from the (host, unstaged) `params['blocks']` of a LoRA run."""
    out = {}
    for target in lora.targets:
        part, weight, _ = TARGETS[target]
        a, b = np.asarray(blocks[part][weight + A]), np.asarray(blocks[part][weight + B])
        r = a.shape[-1]
        for i in range(a.shape[0]):
            name = f"base_model.model.model.layers.{i}.{MODULES[target]}"
            out[f"{name}.lora_A.weight"] = np.ascontiguousarray(a[i].reshape(-1, r).T.astype(dtype))
            out[f"{name}.lora_B.weight"] = np.ascontiguousarray(b[i].reshape(r, -1).T.astype(dtype))
    return out


def adapter_config(lora, base_model: str = "") -> dict:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": [MODULES[t].split(".")[-1] for t in lora.targets],
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
        "modules_to_save": None,
    }


def write(out_dir: Path, blocks: dict, lora, base_model: str = "", dtype=np.float32) -> list[Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(adapter_tensors(blocks, lora, dtype), str(out_dir / "adapter_model.safetensors"), {"format": "pt"})
    (out_dir / "adapter_config.json").write_text(json.dumps(adapter_config(lora, base_model), indent=2))
    return [out_dir / "adapter_model.safetensors", out_dir / "adapter_config.json"]


def read(adapter_dir: Path, m) -> tuple[dict, dict]:
    """A PEFT LoRA adapter directory -> (lora config overrides {rank, alpha, targets}, `blocks` adapters in
    jaxdist's stacked layout, numpy float32), the inverse of `adapter_tensors`."""

    adapter_dir = Path(adapter_dir)
    conf = json.loads((adapter_dir / "adapter_config.json").read_text())
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
            "use_rslora",
            "rank_pattern",
            "alpha_pattern",
            "layers_to_transform",
            "modules_to_save",
            "lora_bias",
            "exclude_modules",
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
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    expected = {
        f"base_model.model.model.layers.{i}.{MODULES[t]}.lora_{x}.weight"
        for t in targets
        for i in range(m.num_layers)
        for x in "AB"
    }
    missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or extra:
        raise JaxdistError(
            f"{adapter_dir}/adapter_model.safetensors does not hold exactly the A and B tensors of "
            f"{len(targets)} module(s) x {m.num_layers} layers: missing {missing[:2]}, unexpected {extra[:2]} "
            f"({len(missing)} / {len(extra)} in all); is it an adapter for this base model?"
        )
    shapes = per_layer_shapes(m)
    blocks: dict = {}
    for target in targets:
        part, weight, n_in = TARGETS[target]
        shape = shapes[weight]
        a, b = [], []
        for i in range(m.num_layers):
            name = f"base_model.model.model.layers.{i}.{MODULES[target]}"
            ta, tb = tensors[f"{name}.lora_A.weight"], tensors[f"{name}.lora_B.weight"]
            want = ((r, math.prod(shape[:n_in])), (math.prod(shape[n_in:]), r))
            if (ta.shape, tb.shape) != want:
                raise JaxdistError(
                    f"{adapter_dir}: {name} has lora_A {ta.shape} / lora_B {tb.shape}, this base model needs "
                    f"{want[0]} / {want[1]} (r={r}); is it an adapter for this base model?"
                )
            a.append(ta.T.reshape(*shape[:n_in], r))
            b.append(tb.T.reshape(r, *shape[n_in:]))
        blocks.setdefault(part, {})[weight + A] = np.stack(a).astype(np.float32)
        blocks[part][weight + B] = np.stack(b).astype(np.float32)
    return {"rank": r, "alpha": float(conf["lora_alpha"]), "targets": targets}, blocks
