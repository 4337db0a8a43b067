"""The collectives of the embedding lookup, the head and the final norm (once per pass, on every pp rank):
gathers, the head's blockwise chunks, tp all-reduces, the lookup's all-to-alls, their gradients'
reductions (`table_traffic`); and those tables' sizes, which the table schedules' count shares
(`head_tables`, `embedding_shard_bytes`)."""

from __future__ import annotations

from jaxdist.parallel.loss import block_rows
from jaxdist.planner.layout import PARAM_BYTES, Layout, param_table
from jaxdist.planner.tally import Tally
from jaxdist.planner.temporaries import loss_plan


def table_traffic(t: Tally) -> None:
    """Embedding lookup, head, final norm: once per pass, on every pp rank. A tied table serves two
    uses, each gathered and with its gradient reduced separately (as compiled)."""
    lay, m, passes, rows = t.lay, t.lay.cfg.model, t.passes, t.rows
    D, tp = m.d_model, t.mesh["tp"]
    tables, head_full = head_tables(lay)
    # A gather of a loop-invariant weight (not sliced by a block index) is hoisted out of the
    # accumulation loop (XLA:CPU's HLO): the final norm, the naive head and a one-block head, once a step.
    one_block = m.vocab_size // tp == block_rows(m.vocab_size, tp, rows, D, m.loss_block)
    head_passes = 1 if m.loss_impl == "naive" or one_block else passes
    if m.loss_impl == "naive":
        gathers = 2 if m.tie_embeddings and tp > 1 else 1
        t.add("fsdp", "all-gather", "head weights", head_full, gathers * head_passes, n=lay.weight_shards)
        t.add("tp", "all-reduce", "head input gradient", rows * D * lay.act_bytes, passes)
    else:  # jaxdist.parallel.loss: every chunk of blocks gathered in the forward; again for the backward
        # only when the logits are recomputed (kept, the forward computes the input gradient too)
        blocks = head_full * lay.act_bytes / PARAM_BYTES
        rows_per_block = block_rows(m.vocab_size, tp, rows, D, m.loss_block)
        nb = m.vocab_size // (tp * rows_per_block)
        plan = loss_plan(lay, rows, rows_per_block)
        chunks = nb // plan.chunk
        t.add(
            "fsdp",
            "all-gather",
            "head weight chunks (fwd)" if plan.keep_logits else "head weight chunks (fwd + bwd)",
            blocks,
            (1 if plan.keep_logits else 2) * head_passes,
            n=lay.weight_shards,
            tensors=chunks,
        )
        t.add("tp", "all-reduce", "head input gradient (float32)", rows * D * PARAM_BYTES, passes)
        t.add("tp", "all-reduce", "log-sum-exp statistics", rows * 3 * PARAM_BYTES, passes)
    if not t.frozen:  # each block's gradient is reduced in the backward's block loop (blockwise)
        per_block = nb if m.loss_impl != "naive" else 1
        scale = t.grad_scale if m.loss_impl != "naive" else 1.0  # the naive head's gradient is not weight_grad's
        t.reduce_grads("head gradient", head_full * scale, passes, t.dp_syncs, tensors=per_block)
    norm = tables["norm"]
    norm_gathers = 1 if m.remat == "none" and not t.frozen else 2  # without remat, kept for the backward
    if lay.gathered(norm):  # the default `norm` rule replicates it: not gathered
        t.add("fsdp", "all-gather", "final norm weights", norm.size * PARAM_BYTES, norm_gathers, n=lay.weight_shards)
    if not t.frozen:
        t.reduce_grads("final norm gradient", norm.size * PARAM_BYTES, passes, t.dp_syncs)
    _embedding_traffic(t, tables["embed"])


def _embedding_traffic(t: Tally, table) -> None:
    """The lookup (jaxdist.parallel.embedding): tokens gathered over fsdp, rows summed over tp, then an
    all-to-all over fsdp (and its transpose in the backward); the table's gradient stays local."""
    lay, passes, rows, D = t.lay, t.passes, t.rows, t.lay.cfg.model.d_model
    t.add("fsdp", "all-gather", "embedding lookup tokens (int32)", rows * t.mesh["fsdp"] * 4, passes)
    t.add("tp", "all-reduce", "embedding lookup rows (vocab-sharded)", rows * D * PARAM_BYTES, passes)
    a2a = 1 if t.frozen else 2  # a frozen table (LoRA) sends no gradient back
    t.add("fsdp", "all-to-all", "embedding rows to their tokens (fwd + bwd)", rows * D * lay.act_bytes, a2a * passes)
    table_shard = embedding_shard_bytes(lay, table)
    if not t.frozen:  # a frozen table (LoRA) has no gradient to sum (HLO of DeepSeek-V3's fixture, ep=2)
        t.add("dp", "all-reduce", "embedding gradient", table_shard, t.dp_syncs)
        # The lookup's shard_map is manual over the token axes too: ep and cp split the tokens, not the
        # table, so the table's local gradient is summed over each of them (a psum, once per pass).
        t.add("ep", "all-reduce", "embedding gradient (tokens split over ep)", table_shard, passes)
        t.add("cp", "all-reduce", "embedding gradient (sequence split over cp)", table_shard, passes)
    # The loss flattens (batch, seq) into rows; with seq split over cp that re-shards the rows: one
    # all-to-all of the final hidden states forward and one of their gradient backward.
    t.add("cp", "all-to-all", "loss rows: (batch, seq) flattened (fwd + bwd)", rows * D * lay.act_bytes, 2 * passes)


def head_tables(lay: Layout) -> tuple[dict, float]:
    """{role: group} of the embedding, head and final norm, and the head's (the embedding's, when tied)
    float32 bytes after the fsdp gather (split by tp)."""
    m = lay.cfg.model
    tables = {g.role: g for g in param_table(m) if g.role != "layer"}
    head = tables["embed" if m.tie_embeddings else "head"]
    return tables, head.size * PARAM_BYTES / lay.tp_shards(head)


def embedding_shard_bytes(lay: Layout, table) -> float:
    """The embedding table's float32 bytes on one device (its gradient, which the lookup keeps local)."""
    return table.size * PARAM_BYTES / lay.shards(table)
