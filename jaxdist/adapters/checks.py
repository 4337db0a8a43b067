"""Start-up checks of a LoRA run against its model and mesh, as one-line errors."""

from __future__ import annotations

import math

from jaxdist.adapters import layout, quant
from jaxdist.adapters.lora import EXPERTS, TARGETS, block_axis, carried, per_layer_shapes
from jaxdist.distributed.mesh import axis_size
from jaxdist.distributed.sharding import logical_to_spec
from jaxdist.errors import JaxdistError

NAMES = {  # each LoRA-able matrix's logical axes (as the models declare them)
    "wq_DNH": ("embed", "heads", "head_dim"),
    "wk_DKH": ("embed", "kv_heads", "head_dim"),
    "wv_DKH": ("embed", "kv_heads", "head_dim"),
    "wo_NHD": ("heads", "head_dim", "embed"),
    "w_gate_DF": ("embed", "mlp"),
    "w_up_DF": ("embed", "mlp"),
    "w_down_FD": ("mlp", "embed"),
    "wq_a_DR": ("embed", None),
    "wq_b_RNH": (None, "heads", "head_dim"),
    "wkv_a_DC": ("embed", None),
    "wkv_b_CNH": (None, "heads", "head_dim"),
}


def check(cfg, mesh, rules) -> None:
    lo, m = cfg.lora, cfg.model
    if not lo.rank:
        if lo.base_dtype != "float32":
            raise JaxdistError(
                f"lora.base_dtype={lo.base_dtype} needs lora.rank > 0 (a frozen base trains through adapters only)"
            )
        return
    have = carried(m)
    if [t for t in lo.targets if t not in have]:
        raise JaxdistError(
            f"lora.targets={list(lo.targets)} names {', '.join(t for t in lo.targets if t not in have)}, which "
            f"this model's layers do not have ({layout.of(m).why}); set lora.targets=[{','.join(have)}]"
        )
    _fused_pair(lo, m)
    if mesh.shape.get("cp", 1) > 1:
        raise JaxdistError(
            "lora.rank > 0 with cp > 1: LoRA is not supported with context parallelism yet; use dp/fsdp/tp/pp"
        )
    shapes, widest = per_layer_shapes(m), _widest(lo, m)
    if lo.rank > widest:
        raise JaxdistError(
            f"lora.rank={lo.rank} exceeds {widest}, the smaller side of the smallest adapted matrix: a rank above "
            f"min(inputs, outputs) adds parameters and nothing the adapter can express; use lora.rank <= {widest}"
        )
    if lo.base_dtype not in quant.KINDS:
        return
    dims = []  # (weight, its block dimension, the shards that dimension is split over)
    for weight in quantised(m, have):
        shape = shapes[weight]
        axis = block_axis(weight) % len(shape)
        dims.append((weight, shape[axis], axis_size(mesh, logical_to_spec(NAMES[weight], rules)[axis])))

    def fits(b: int) -> bool:
        return (lo.base_dtype != "nf4" or b % 2 == 0) and all(n % b == 0 and (n // b) % k == 0 for _, n, k in dims)

    if fits(lo.block_size):
        return
    good = [b for b in range(1, min(n for _, n, _ in dims) + 1) if fits(b)]
    near = sorted(good, key=lambda b: (abs(b - lo.block_size), -b))[:3]
    suggest = f"lora.block_size={near[0]} fits (so do {', '.join(map(str, sorted(near[1:])))})" if near else ""
    if not near:
        suggest = "no block size fits this mesh; use lora.base_dtype=bfloat16 or fewer shards"
    if lo.base_dtype == "nf4" and lo.block_size % 2:
        raise JaxdistError(f"lora.block_size={lo.block_size} must be even for nf4 (two codes per byte); {suggest}")
    weight, n, shards = next((w, n, k) for w, n, k in dims if n % lo.block_size or (n // lo.block_size) % k)
    raise JaxdistError(
        f"lora.block_size={lo.block_size} does not fit {weight}'s dimension {n} split over {shards} "
        f"device(s) ({n} / block_size blocks must divide by {shards}); {suggest}"
    )


def _widest(lo, m) -> int:
    """The smaller side of the smallest adapted matrix (a routed expert's (D, F) or (F, D) for gate/up/down)."""
    shapes = per_layer_shapes(m)
    if layout.of(m).experts and m.moe_experts:
        F = m.moe_mlp_dim or m.mlp_dim
        shapes = shapes | {"w_gate_DF": (m.d_model, F), "w_up_DF": (m.d_model, F), "w_down_FD": (F, m.d_model)}
    return min(
        min(math.prod(shapes[weight][:n_in]), math.prod(shapes[weight][n_in:]))
        for target, (_, weight, n_in) in TARGETS.items()
        if target in lo.targets
    )


def quantised(m, have) -> list[str]:
    """The layer matrices QLoRA stores as int8 / NF4 blocks: the carried targets' (routed experts stay in
    bfloat16) and a dense first stack's MLP (DeepSeek-V3's: it has scale slots like every matrix lora.TARGETS
    names)."""
    lay = layout.of(m)
    out = [TARGETS[t][1] for t in have if not (lay.experts and m.moe_experts and t in EXPERTS)]
    if lay.dense_stack and (m.dense_layers or not m.moe_experts):
        out += ["w_gate_DF", "w_up_DF", "w_down_FD"]
    return list(dict.fromkeys(out))


def _fused_pair(lo, m) -> None:
    if layout.of(m).experts and m.moe_experts and ("gate" in lo.targets) != ("up" in lo.targets):
        raise JaxdistError(
            f"lora.targets={list(lo.targets)} names one of gate and up: this model's routed experts hold them as one "
            "fused parameter (transformers' experts.gate_up_proj, which peft adapts whole); name both or neither"
        )
