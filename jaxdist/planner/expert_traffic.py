"""The MoE layers' collectives: expert weights gathered over fsdp inside the dispatch, their gradients
reduced, and the ep all-to-all of dispatch and combine (jaxdist.planner.comms's docstring says what the
compiler emits); or, for an architecture whose experts see every token (registry `dense_experts`:
gpt-oss), the experts gathered whole and their gradients reduced whole, and no tokens exchanged."""

from __future__ import annotations

from jaxdist.models import registry
from jaxdist.parallel.moe import a2a_bytes_per_direction
from jaxdist.planner.layout import PARAM_BYTES, Layout
from jaxdist.planner.state_memory import gathered_per_layer


def expert_layer_bytes(lay: Layout) -> float:
    """One MoE layer's expert weights after the fsdp all-gather (split by ep and tp), float32, averaged
    over all layers (moe_every, dense first layers), as `gathered_layer_bytes`."""
    return gathered_per_layer(lay, lambda g: "expert" in g.names)


def expert_traffic(lay: Layout, add, experts: float, layer_steps: int, implicit: bool) -> None:
    """ep collectives and the expert weights' fsdp ones (module docstring), through `add`. Expert
    weights are gathered by hand inside the dispatch shard_map: once per application (the backward
    reuses the gathered copy; remat=full gathers again), their gradients reduce-scattered (every backend)."""
    m, ep = lay.cfg.model, lay.mesh["ep"]
    arch = registry.of(m)
    share = arch.moe_layers(m) / m.num_layers  # of the layer applications: those that hold experts
    sparse_steps = round(layer_steps * share)
    per_sparse = experts / share  # `experts` is averaged over all layers
    if arch.dense_experts:
        _dense_expert_traffic(lay, add, per_sparse, sparse_steps)
        return
    remat = int(m.remat == "full")
    add(
        "fsdp",
        "all-gather",
        "expert weights (fwd)",
        per_sparse * lay.act_bytes / PARAM_BYTES,
        (1 + remat) * sparse_steps,
    )
    add("fsdp", "reduce-scatter", "expert gradients", per_sparse, sparse_steps)
    add(
        "dp",
        "all-reduce",
        "expert gradients",
        per_sparse / lay.mesh["fsdp"],
        sparse_steps if implicit else arch.moe_layers(m),
    )
    if ep > 1:
        tokens = lay.micro_batch * m.seq_len
        buffer = a2a_bytes_per_direction(tokens, m, lay.act_bytes, ep) * ep / (ep - 1)  # the E·C·D buffer
        what = "MoE dispatch + combine (fwd + bwd)" + (", dropless worst tier" if m.moe_dispatch == "dropless" else "")
        add("ep", "all-to-all", what, buffer, (4 + 2 * remat) * sparse_steps)


def _dense_expert_traffic(lay: Layout, add, per_sparse: float, sparse_steps: int) -> None:
    """Experts that see every token (gpt-oss), as XLA's partitioner compiles them (read in the HLO of the
    fixture at fsdp=4,ep=2; XLA:CPU's, the GPU form not read): each layer's experts all-gathered over
    fsdp (the device's E/ep of them), then over ep (all E), in the forward and again in the backward;
    their float32 gradients, computed whole on every device, all-reduced whole over fsdp and then over
    ep (no reduce-scatter); the router's logits (B·T·E float32) all-gathered over the batch axes for
    top_k (the partitioner replicates its operand), once per layer forward; no all-to-all."""
    m, ep, fsdp = lay.cfg.model, lay.mesh["ep"], lay.mesh["fsdp"]
    whole = per_sparse * ep  # `per_sparse` is the ep shard's
    gather = lay.act_bytes / PARAM_BYTES
    add("fsdp", "all-gather", "dense experts (fwd + bwd)", per_sparse * gather, 2 * sparse_steps)
    add("ep", "all-gather", "dense experts over ep (fwd + bwd)", whole * gather, 2 * sparse_steps)
    add("fsdp", "all-reduce", "dense expert gradients", whole, sparse_steps)
    add("ep", "all-reduce", "dense expert gradients", whole, sparse_steps)
    add("dp", "all-reduce", "dense expert gradients", whole / (fsdp * ep), sparse_steps)
    logits = lay.micro_batch * lay.batch_shards * m.seq_len * m.moe_experts * 4
    add("ep", "all-gather", "router logits for top_k (fwd)", logits, sparse_steps, n=lay.batch_shards)
