"""The training state's bytes on one device: parameters as stored (and one layer gathered), gradients,
optimizer moments, accumulators, a frozen reference copy, the batch, and what offload keeps on the host.

Conventions (those of jaxdist.training.step): float32 master parameters, float32 gradients, AdamW's two float32
moments (mu, nu) — 4 + 4 + 8 = 16 bytes per parameter before sharding (so 70B parameters are 280 GB,
and AdamW adds 560 GB). Each array is divided by the devices that shard it under the logical rules.
"""

from __future__ import annotations

from jaxdist.objectives import registry as objectives
from jaxdist.optim import registry as optimizers
from jaxdist.planner import lora
from jaxdist.planner.layout import PARAM_BYTES, Layout, param_table


def stored_bytes(lay: Layout, keep=lambda g: True) -> float:
    """float32 bytes on one device of the parameters `keep` selects, as stored (sharded): the size of
    their gradients, and of each AdamW moment, too."""
    return sum(g.size * PARAM_BYTES / lay.shards(g) for g in param_table(lay.cfg.model) if keep(g))


def gathered_per_layer(lay: Layout, keep=lambda g: True) -> float:
    """One layer's float32 bytes of the layer parameters `keep` selects after the fsdp all-gather
    (still split by tp, and expert weights by ep), averaged over the layers (moe_every)."""
    m = lay.cfg.model
    return sum(
        g.size / m.num_layers * PARAM_BYTES / lay.tp_shards(g) for g in param_table(m) if g.role == "layer" and keep(g)
    )


def param_bytes(lay: Layout) -> float:
    """The parameters as stored: float32; under LoRA the frozen base in its dtype plus the adapters."""
    if lora.enabled(lay):
        return lora.base_bytes(lay) + lora.adapter_bytes(lay)
    return stored_bytes(lay)


def trained_bytes(lay: Layout) -> float:
    """float32 bytes of what the optimizer trains: every parameter, or under LoRA the adapters alone."""
    return lora.adapter_bytes(lay) if lora.enabled(lay) else stored_bytes(lay)


def state_bytes(lay: Layout) -> float:
    """The optimizer's float32 state on one device, sharded like the trained parameters: per entry of
    each trained tensor as many values as `optim.name`'s entry keeps there (jaxdist.optim.registry:
    AdamW mu and nu; Muon one momentum on the layers' matrices, mu and nu elsewhere; Lion one)."""
    floats = optimizers.entry(lay.cfg.optim).state_floats
    groups = lora.adapter_groups(lay) if lora.enabled(lay) else param_table(lay.cfg.model)
    return sum(floats(g.path, g.names) * g.size * PARAM_BYTES / lay.shards(g) for g in groups)


def optimizer_bytes(lay: Layout) -> float:
    """The optimizer's state (state_bytes) plus its and the schedule's int32 step counters."""
    return state_bytes(lay) + optimizers.entry(lay.cfg.optim).counters * 4


def grad_bytes(lay: Layout) -> float:
    """One set of float32 gradients, sharded like the parameters: the model reduces each layer's
    gradient to its parameter's sharding inside the backward scan (jaxdist.parallel.matmul.cast_sharded). Under
    LoRA, the adapters' only: the frozen base has none."""
    return trained_bytes(lay)


def accumulator_bytes(lay: Layout) -> float:
    """The gradient accumulator across micro-batches beyond the one set of gradients: the backward scan
    adds each layer's reduced gradient into the accumulator in place (XLA:CPU's buffer assignment holds
    one layer-gradient stack under accumulation), so only the other parameters' gradients (embedding,
    head, final norm) exist twice. Under LoRA every trained parameter (an adapter) is a layer's."""
    return 0.0 if lora.enabled(lay) else stored_bytes(lay, lambda g: g.role != "layer")


def reference_bytes(lay: Layout) -> float:
    """DPO's (and GRPO's, with objective.beta > 0) frozen reference without LoRA: a float32 copy of the
    parameters in the gradient stage's state, sharded as they are (`objectives.registry.keeps_reference_copy`).
    With LoRA the reference is the base with the adapters off: nothing stored."""
    return stored_bytes(lay) if objectives.keeps_reference_copy(lay.cfg) else 0.0


def batch_bytes(lay: Layout) -> float:
    """The step's int32 input on one device: rows of seq_len + 1 tokens; a preference pair (chosen then
    rejected) and a GRPO row (tokens, then its advantage and old log-probs) are two rows wide."""
    width = 1 if objectives.is_default(lay.cfg) else 2
    return lay.cfg.train.global_batch // lay.batch_shards * width * (lay.cfg.model.seq_len + 1) * 4


def host_bytes(lay: Layout) -> float:
    """Bytes per device that offload keeps in pinned host memory between steps (the device's temp is
    not modelled lower: the transfers and the layer being computed still use it)."""
    o = lay.cfg.offload
    return (param_bytes(lay) if o.params == "host" else 0.0) + (optimizer_bytes(lay) if o.optimizer == "host" else 0.0)
