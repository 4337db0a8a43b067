"""LoRA's and QLoRA's state on one device (lora.rank > 0, jaxdist.adapters): the frozen base as it is
stored, and the adapters, which alone have gradients and AdamW moments.

The base (jaxdist.adapters.tree.store_base): the seven layer matrices in lora.base_dtype — float32 4
bytes per entry, bfloat16 2, int8 1 + 4/block (codes and one float32 scale per block), NF4 0.5 + 4/block
(two codes per byte) — and every other frozen tensor (embedding, head, norms) in base_dtype, bfloat16
when the matrices are quantised. Codes and scales carry the matrix's logical names, so they shard as
it does. Adapters: A (the matrix's input names, lora_rank) and B (lora_rank, its output names),
float32, placed by the same rules (lora_rank is replicated), as jaxdist.adapters.lora builds them.
"""

from __future__ import annotations

from jaxdist.adapters import quant
from jaxdist.adapters.lora import TARGETS, A, B
from jaxdist.planner.layout import PARAM_BYTES, Layout, ParamGroup, model_table, param_table

MATRICES = frozenset(w for _, w, _ in TARGETS.values())
DENSE_BYTES = {"float32": 4, "bfloat16": 2, "int8": 2, "nf4": 2}  # the frozen tensors not quantised


def enabled(lay: Layout) -> bool:
    return lay.cfg.lora.rank > 0


def _weight(g: ParamGroup) -> str:
    return g.path.split("/")[-1]


def adapter_groups(lay: Layout) -> tuple[ParamGroup, ...]:
    """Each targeted matrix's A and B, stacked over the layers as the matrix is: the adapters the model
    itself holds with lora attached (DeepSeek-V3's routed experts' per expert, split over ep)."""
    return tuple(g for g in model_table(lay.cfg.model, lay.cfg.lora) if g.path.endswith((A, B)))


def adapter_bytes(lay: Layout) -> float:
    """The adapters' float32 bytes on one device: their gradients' and each AdamW moment's size too."""
    return sum(g.size * PARAM_BYTES / lay.shards(g) for g in adapter_groups(lay))


def base_entry_bytes(lay: Layout, g: ParamGroup) -> float:
    """Bytes the frozen base stores per entry of `g`."""
    lo = lay.cfg.lora
    if is_matrix(g) and lo.base_dtype in quant.KINDS:
        return quant.stored_bytes_per_entry(lo.base_dtype, lo.block_size)
    return DENSE_BYTES[lo.base_dtype]


def base_bytes(lay: Layout, keep=lambda g: True) -> float:
    """The frozen base's stored bytes on one device (of the groups `keep` selects)."""
    return sum(g.size * base_entry_bytes(lay, g) / lay.shards(g) for g in param_table(lay.cfg.model) if keep(g))


def is_matrix(g: ParamGroup) -> bool:
    """One of the seven layer matrices (quantised under QLoRA; the norms are not)."""
    return g.role == "layer" and _weight(g) in MATRICES


def gathered_entry_bytes(lay: Layout) -> float:
    """Bytes per entry of a layer matrix as the fsdp all-gather moves it: the float base cast to the
    compute dtype on its shard first (XLA:CPU: float32, a bfloat16 base too — llama3-8b, 2 layers:
    6,425 MiB gathered for either), QLoRA's codes and scales as stored (jaxdist.adapters.lora.project)."""
    lo = lay.cfg.lora
    if lo.base_dtype in quant.KINDS:
        return quant.stored_bytes_per_entry(lo.base_dtype, lo.block_size)
    return lay.act_bytes
