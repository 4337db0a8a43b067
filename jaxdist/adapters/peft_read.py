"""A PEFT LoRA adapter folder read into jaxdist's stacked layout (`read`, `read_tree`): the inverse of
peft.py's tensors (lora_A (r, in) -> transpose -> A (*in, r); the routed experts' ParamWrapper blocks
unstacked per expert), with which HF layers carry which adapter per architecture; anything peft trains
beside A and B, a damaged file or another model's adapter is refused in one line naming it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file

from jaxdist.adapters import layout
from jaxdist.adapters.lora import EXPERTS, FUSED, GATE_UP, IN_DIMS, TARGETS, A, B, per_layer_shapes
from jaxdist.adapters.peft import MODULES, WEIGHT_MODULES, dense_offset, expert_names
from jaxdist.errors import JaxdistError


def _read_experts(tensors: dict, m, r: int, targets: list[str], adapter_dir) -> dict:
    """The inverse of peft.py's `_expert_tensors` for every MoE layer: the `blocks` stack's mlp adapters."""
    fused = layout.of(m).experts == "fused"
    names = expert_names("gate" in targets, "down" in targets, FUSED if fused else GATE_UP)
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
    paths = expert_names("gate" in targets, "down" in targets).values()
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


def read(adapter_dir: Path, m) -> tuple[dict, dict]:
    """A PEFT LoRA adapter directory -> (lora config overrides {rank, alpha, targets[, rslora]}, `blocks` adapters in
    jaxdist's stacked layout, numpy float32), the inverse of peft.adapter_tensors (DeepSeek-V3's dense first
    layers: `read_tree`)."""
    lora, tree = read_tree(adapter_dir, m)
    if "dense_blocks" in tree:
        raise ValueError("this model has a dense_blocks stack: use read_tree")
    return lora, tree["blocks"]


def read_tree(adapter_dir: Path, m) -> tuple[dict, dict]:
    """A PEFT LoRA adapter directory -> (lora config overrides {rank, alpha, targets[, rslora]}, the trainable
    tree {'blocks': ...[, 'dense_blocks': ...]} in jaxdist's stacked layout, numpy float32), the inverse of
    peft.tree_tensors."""

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
