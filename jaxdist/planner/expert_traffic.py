"""The MoE layers' collectives: expert weights gathered over fsdp inside the dispatch, their gradients
reduced, and the ep all-to-all of dispatch and combine (jaxdist.planner.comms's docstring says what the
compiler emits)."""

from __future__ import annotations

from jaxdist.parallel.moe import a2a_bytes_per_direction
from jaxdist.planner.layout import PARAM_BYTES, Layout
from jaxdist.planner.state_memory import gathered_per_layer


def expert_layer_bytes(lay: Layout) -> float:
    """One MoE layer's expert weights after the fsdp all-gather (split by ep and tp), float32, averaged
    over all layers (moe_every), as `gathered_layer_bytes`."""
    return gathered_per_layer(lay, lambda g: "expert" in g.names)


def expert_traffic(lay: Layout, add, experts: float, layer_steps: int, implicit: bool) -> None:
    """ep collectives and the expert weights' fsdp ones (module docstring), through `add`. Expert
    weights are gathered by hand inside the dispatch shard_map: once per application (the backward
    reuses the gathered copy; remat=full gathers again), their gradients reduce-scattered (every backend)."""
    m, ep = lay.cfg.model, lay.mesh["ep"]
    remat, n = int(m.remat == "full"), m.moe_every
    sparse_steps = layer_steps // n
    per_sparse = experts * n  # `experts` is averaged over all layers
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
        sparse_steps if implicit else m.num_layers // n,
    )
    if ep > 1:
        tokens = lay.micro_batch * m.seq_len
        buffer = a2a_bytes_per_direction(tokens, m, lay.act_bytes, ep) * ep / (ep - 1)  # the E·C·D buffer
        what = "MoE dispatch + combine (fwd + bwd)" + (", dropless worst tier" if m.moe_dispatch == "dropless" else "")
        add("ep", "all-to-all", what, buffer, (4 + 2 * remat) * sparse_steps)
