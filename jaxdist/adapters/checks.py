"""Start-up checks of a LoRA run against its model and mesh, as one-line errors."""

from __future__ import annotations

from jaxdist.adapters import quant
from jaxdist.adapters.lora import TARGETS, block_axis, per_layer_shapes
from jaxdist.distributed.mesh import axis_size
from jaxdist.distributed.sharding import logical_to_spec
from jaxdist.errors import JaxdistError


def check(cfg, mesh, rules) -> None:
    lo, m = cfg.lora, cfg.model
    if not lo.rank:
        if lo.base_dtype != "float32":
            raise JaxdistError(
                f"lora.base_dtype={lo.base_dtype} needs lora.rank > 0 (a frozen base trains through adapters only)"
            )
        return
    if m.moe_experts:
        raise JaxdistError(
            "lora.rank > 0 with model.moe_experts > 0: LoRA on mixture-of-experts layers is not supported "
            "yet; use a dense model or lora.rank=0"
        )
    if mesh.shape.get("cp", 1) > 1:
        raise JaxdistError(
            "lora.rank > 0 with cp > 1: LoRA is not supported with context parallelism yet; use dp/fsdp/tp/pp"
        )
    if lo.base_dtype not in quant.KINDS:
        return
    if lo.base_dtype == "nf4" and lo.block_size % 2:
        raise JaxdistError(f"lora.block_size={lo.block_size} must be even for nf4 (two codes per byte)")
    shapes = per_layer_shapes(m)
    names = {
        "wq_DNH": ("embed", "heads", "head_dim"),
        "wk_DKH": ("embed", "kv_heads", "head_dim"),
        "wv_DKH": ("embed", "kv_heads", "head_dim"),
        "wo_NHD": ("heads", "head_dim", "embed"),
        "w_gate_DF": ("embed", "mlp"),
        "w_up_DF": ("embed", "mlp"),
        "w_down_FD": ("mlp", "embed"),
    }
    for _, weight, _ in TARGETS.values():
        shape = shapes[weight]
        axis = block_axis(weight) % len(shape)
        n = shape[axis]
        shards = axis_size(mesh, logical_to_spec(names[weight], rules)[axis])
        if n % lo.block_size or (n // lo.block_size) % shards:
            raise JaxdistError(
                f"lora.block_size={lo.block_size} does not fit {weight}'s dimension {n} split over {shards} "
                f"device(s) ({n} / block_size blocks must divide by {shards}); choose a block size that does"
            )
