"""LoRA adapters in PEFT's format: `adapter_config.json` + `adapter_model.safetensors`, which
`peft.PeftModel.from_pretrained(base_model, DIR)` loads onto the original Hugging Face model.

PEFT's LoRA on a Linear: y = W x + (alpha / r) B (A x) with A (r, in), B (out, r), stored under
`base_model.model.<module path>.lora_A.weight` / `.lora_B.weight`. Ours are A (*in, r), B (r, *out)
per layer (HF's q_proj (N H, D) is our wq_DNH flattened (D, N H) and transposed), so A -> flatten ->
transpose, B -> flatten -> transpose.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from jaxdist.adapters import layout
from jaxdist.adapters.lora import EXPERTS, FUSED, GATE_UP, IN_DIMS, TARGETS, A, B, per_layer_shapes
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


def _expert_names(mlp_has_gate_up: bool, mlp_has_down: bool, gate_up: str = GATE_UP) -> dict[str, str]:
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
    names = _expert_names(gate_up + A in mlp, "w_down_EFD" + A in mlp, gate_up)
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


def _read_experts(tensors: dict, m, r: int, targets: list[str], adapter_dir) -> dict:
    """The inverse of `_expert_tensors` for every MoE layer: the `blocks` stack's mlp adapters."""
    fused = layout.of(m).experts == "fused"
    names = _expert_names("gate" in targets, "down" in targets, FUSED if fused else GATE_UP)
    E, D, F = m.moe_experts, m.d_model, m.moe_mlp_dim or m.mlp_dim
    shapes = {GATE_UP: (2 * r, D, 2 * F), FUSED: (r, D, 2 * F), "w_down_EFD": (r, F, D)}  # rank, in, out
    mlp: dict = {}
    for weight, path in names.items():
        rank, n_in, n_out = shapes[weight]
        a, b = [], []
        for i in range(dense_offset(m), m.num_layers):
            name = f"base_model.model.model.layers.{i}.{path}"
            ta, tb = tensors[f"{name}.lora_A.weight"], tensors[f"{name}.lora_B.weight"]
            if (ta.shape, tb.shape) != ((rank * E, n_in), (n_out, rank * E)):
                raise JaxdistError(
                    f"{adapter_dir}: {name} has lora_A {ta.shape} / lora_B {tb.shape}, this base model needs "
                    f"{(rank * E, n_in)} / {(n_out, rank * E)}; is it an adapter for this base model?"
                )
            a.append(ta.reshape(E, rank, n_in).transpose(0, 2, 1))
            bt = tb.reshape(n_out, rank, E).transpose(2, 1, 0)
            b.append(bt.reshape(E, rank, 2, F) if weight == GATE_UP else bt)
        mlp[weight + A], mlp[weight + B] = np.stack(a).astype(np.float32), np.stack(b).astype(np.float32)
    return mlp


def _expert_keys(m, targets) -> set[str]:
    if not layout.of(m).experts or not m.moe_experts:
        return set()
    paths = _expert_names("gate" in targets, "down" in targets).values()
    return {
        f"base_model.model.model.layers.{i}.{p}.lora_{x}.weight"
        for p in paths
        for i in range(dense_offset(m), m.num_layers)
        for x in "AB"
    }


def placements(m, targets) -> list[tuple[str, str, str, list[int]]]:
    """(stack, submodule, weight, HF layers) of every adapted matrix `targets` give this model, in the order
    of `targets`: DeepSeek-V3's MLA in its dense first layers (`dense_blocks`, HF 0..k-1) and its MoE ones
    (`blocks`, HF k..); Qwen3-Next's attention in its full-attention layers; every other family's in every layer."""
    k, lay = dense_offset(m), layout.of(m)
    out = []
    for target in targets:
        part, weight, _ = TARGETS[target]
        if lay.experts and m.moe_experts and target in EXPERTS:
            continue  # the routed experts: _expert_keys / _read_experts
        if not lay.dense_stack:
            out.append(("blocks", part, weight, carriers(m)))
            continue
        out += [("dense_blocks", part, weight, list(range(k)))] if k else []
        out.append(("blocks", part, weight, list(range(k, m.num_layers))))
    return out


def carriers(m) -> list[int]:
    """The HF layers whose projections take adapters: all, or Qwen3-Next's full-attention ones (the
    last of each group of `full_attention_interval`)."""
    if layout.of(m).grouped:
        n = m.full_attention_interval
        return [i for i in range(m.num_layers) if i % n == n - 1]
    return list(range(m.num_layers))


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
        )
        if conf.get(k) and not (k in FUSED_KEYS and layout.of(m).experts == "split")
    ]
    special += [f"bias={conf['bias']}"] if conf.get("bias", "none") != "none" else []
    if conf.get("peft_type") != "LORA" or unknown or special:
        raise JaxdistError(
            f"{adapter_dir}: only plain LoRA on {', '.join(by_module)} reads into jaxdist "
            f"(peft_type={conf.get('peft_type')}, unknown modules {unknown}, unsupported {special})"
        )
    targets = [t for t in MODULES if MODULES[t].split(".")[-1] in modules]
    r = int(conf["r"])
    targets += _fused_targets(conf, m, r, adapter_dir)
    tensors = _tensors(adapter_dir / "adapter_model.safetensors")
    placed = placements(m, targets)
    expected = _expert_keys(m, targets) | {
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
        if layout.of(m).grouped:  # the group's full-attention layer
            unit = unit.setdefault("layers", {}).setdefault(m.full_attention_interval - 1, {})
        unit.setdefault(part, {})[weight + A] = np.stack(a).astype(np.float32)
        unit[part][weight + B] = np.stack(b).astype(np.float32)
    if _expert_keys(m, targets):
        tree.setdefault("blocks", {}).setdefault("mlp", {}).update(_read_experts(tensors, m, r, targets, adapter_dir))
    lora = {"rank": r, "alpha": float(conf["lora_alpha"]), "targets": targets}
    return lora | ({"rslora": True} if conf.get("use_rslora") else {}), tree


FUSED_KEYS = ("rank_pattern", "alpha_pattern")  # peft's own, for split gate/up experts' gate_up_proj (_fused_targets)


def _fused_targets(conf: dict, m, r: int, adapter_dir) -> list[str]:
    """The expert targets from peft's target_parameters (gate_up_proj -> gate, up; down_proj -> down), with
    exactly the rank and alpha patterns peft's conversion gives split gate/up experts' gate_up_proj (DeepSeek-V3:
    2r, 2 alpha; none for a fused one, gpt-oss); anything else peft targets by parameter, or another pattern, is
    refused in one line."""
    fused = conf.get("target_parameters") or []
    experts = layout.of(m).experts if m.moe_experts else ""
    want = {".*\\.gate_up_proj": 2} if "gate_up_proj" in fused and experts == "split" else {}
    rank, alpha = conf.get("rank_pattern") or {}, conf.get("alpha_pattern") or {}
    ok = bool(experts) and set(fused) <= {"gate_up_proj", "down_proj"}
    if (
        fused
        and not ok
        or (rank or alpha or fused)
        and (
            rank != {k: v * r for k, v in want.items()} or alpha != {k: v * conf["lora_alpha"] for k, v in want.items()}
        )
    ):
        raise JaxdistError(
            f"{adapter_dir}: target_parameters={fused}, rank_pattern={rank}, alpha_pattern={alpha}: jaxdist reads "
            "peft's expert adapters (gate_up_proj, down_proj) of models whose experts take them, DeepSeek-V3's "
            "gate_up_proj at rank 2r, alpha 2 alpha, and no other per-module rank or alpha; is it an adapter for "
            "this base model?"
        )
    return [*(["gate", "up"] if "gate_up_proj" in fused else []), *(["down"] if "down_proj" in fused else [])]


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
