"""What LoRA adapts in each architecture, as its model registry entry declares it (`Architecture.lora`,
jaxdist/models/registry.py, which hands every family's declaration here as it loads): the adapters, a
layer below the models, read it by `model.family` instead of naming families. JAX-free."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LoraLayout:
    # how lora.targets gate/up/down reach the routed experts (peft's target_parameters on mlp.experts):
    # "" they take no adapters; "split": gate and up are separate (E, D, F) weights that peft's v4 -> v5
    # conversion adapts as one gate_up_proj of rank 2r, alpha 2 alpha, gate rows then up (DeepSeek-V3);
    # "fused": one (E, D, 2F) gate/up weight, gate and up interleaved, adapted whole at rank r (gpt-oss)
    experts: str = ""
    mla: bool = False  # the attention is MLA (q_a, q_b or q, kv_a, kv_b, o), not q/k/v/o
    dense_stack: bool = False  # a `dense_blocks` stack of dense first layers (HF layers 0..k-1) before `blocks`
    # the stack's unit is a group of `full_attention_interval` layers whose last alone has the attention
    # (Qwen3-Next: `blocks['layers'][j]`), and its q_proj gives q and a gate per head (2 head_dim)
    grouped: bool = False
    why: str = "its feed-forward is mixture-of-experts, whose experts take no adapters"  # of a target it lacks


# model.family -> its declaration, filled by jaxdist.models.registry, which `import jaxdist` loads first
DECLARED: dict[str, LoraLayout] = {}


def declare(by_family: dict[str, LoraLayout]) -> None:
    DECLARED.update(by_family)


def of(m) -> LoraLayout:
    """The LoRA layout `m.family`'s registry entry declares."""
    return DECLARED[m.family]
