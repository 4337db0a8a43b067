"""The collectives of a pipeline table schedule (1f1b, 1f1b_paired, interleaved_1f1b, zb_h1), counted per
slot of its table, each lane at its largest branch (`schedule_table_traffic`)."""

from __future__ import annotations

from jaxdist.planner.head_traffic import embedding_shard_bytes, head_tables
from jaxdist.planner.layout import PARAM_BYTES
from jaxdist.planner.tally import Tally
from jaxdist.planner.temporaries import gathered_layer_bytes


def schedule_table_traffic(t: Tally) -> None:
    """A table schedule (jaxdist.parallel.pipeline_1f1b): a scan over the table's slots, each lane a
    lax.switch of idle / forward / backward, and inside a backward, conds for the first virtual stage
    (the embedding) and the last (head + loss). In lock-step every slot costs its slowest action (as
    the bubble model has it), so each lane's collectives per slot are those of its largest branch — a
    backward where the lane runs any (the one lane of 1f1b and interleaved, lane 1 of paired), else a
    forward — with the embedding and head parts of it; `hlo.summarize` counts the compiled program the
    same way (the largest branch of each conditional). Read from the HLO of tiny at pp=2,fsdp=4, M=4:
    - a backward slot: the chunk's G layers gathered twice (the recompute and the gradient), their
      gradients reduced over the batch axes (G layers), the head's blocks and the final norm gathered
      twice and their gradients reduced, the embedding's tokens gathered and its rows sent by
      all-to-all forward and back (7 tp all-reduces per layer: 2 recomputed forward, 5 backward);
    - a forward slot: G layers gathered once, the embedding's tokens and one all-to-all (2 per layer);
    - every slot: one micro-batch's activation permuted forward and one gradient backward;
    - after the scan: the embedding, final norm and head gradients summed over pp (a psum), and the
      embedding's gradient reduced over dp (its lookup's gradient is local, as without a pipeline).
    Nothing is hoisted out of the slot loop: the gathers sit inside the switch."""
    lay, m, pp = t.lay, t.lay.cfg.model, t.mesh["pp"]
    table, _ = lay.tabled
    group = m.num_layers // (pp * lay.repeats)  # G layers per chunk
    layer = gathered_layer_bytes(lay)
    gather = lay.act_bytes / PARAM_BYTES
    kinds = [table.kind[..., lane] for lane in range(table.lanes)]
    # lane-slots costed as B (zb_h1's B and W slots alike: each gathers the chunk twice; an upper bound for B)
    backward = sum(int((k >= 2).any()) for k in kinds) * table.slots * t.passes
    forward = sum(int((k == 1).any() and not (k >= 2).any()) for k in kinds) * table.slots * t.passes
    D, rows = m.d_model, lay.micro_batch * t.T  # one micro-batch's rows on a device
    t.add(
        "fsdp",
        "all-gather",
        "layer weights (slot F / B)",
        layer * gather,
        group * (forward + 2 * backward),
        n=lay.weight_shards,
    )
    t.reduce_grads("layer gradients (slot B)", layer, group * backward, group * backward)
    activations = rows * D * lay.act_bytes
    t.add("tp", "all-reduce", "layer activations", activations, group * (2 * forward + 7 * backward))
    tables, head_full = head_tables(lay)
    norm = tables["norm"].size * PARAM_BYTES
    t.add(
        "fsdp",
        "all-gather",
        "head + final norm weights (slot B)",
        head_full * gather + norm * lay.gathered(tables["norm"]),
        2 * backward,
        n=lay.weight_shards,
    )
    t.reduce_grads("head + final norm gradients (slot B)", head_full + norm, backward, backward)
    if m.loss_impl != "naive":
        t.add("tp", "all-reduce", "head input gradient, statistics (slot B)", rows * (D + 3) * PARAM_BYTES, backward)
    t.add("fsdp", "all-gather", "embedding lookup tokens (int32)", rows * t.mesh["fsdp"] * 4, forward + backward)
    t.add("tp", "all-reduce", "embedding lookup rows", rows * D * PARAM_BYTES, forward + backward)
    t.add("fsdp", "all-to-all", "embedding rows (F: 1, B: 2)", rows * D * lay.act_bytes, forward + 2 * backward)
    slots = table.slots * t.passes
    t.add("pp", "collective-permute", "activation and gradient (every slot)", activations, 2 * slots)
    rest = sum(g.size * PARAM_BYTES / lay.shards(g) for g in tables.values())
    t.add("pp", "all-reduce", "embedding, norm, head gradients summed over stages", rest, t.passes)
    t.add("dp", "all-reduce", "embedding gradient", embedding_shard_bytes(lay, tables["embed"]), t.dp_syncs)
