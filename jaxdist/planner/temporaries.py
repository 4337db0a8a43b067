"""The backward's working set beside the saved activations, per device: gathered layer weights, the
loss's blocks, the layer gradients being reduced, the AdamW moments' copies, the ring's blocks, and the
gradients a table pipeline schedule holds twice.

Temporary bytes (memory_analysis().temp) are the backward pass's peak, read term by term from XLA:CPU's
buffer assignment: saved activations + one set of float32 gradients (+ the non-layer gradients'
accumulator under accumulation) + copies of the two AdamW moments + the larger of one layer's
activations (recomputed, or without remat sliced out of the saved stacks) and one layer's gradient
group being reduced — or, where larger, the loss's working set beside the moments' copies. The update writes the new parameters and moments into the donated state, but XLA:CPU
first copies the old moments (the non-finite guard's select still reads them), at the step's start.
"""

from __future__ import annotations

from jaxdist.parallel.loss_blocks import block_rows, plan_for
from jaxdist.planner import lora, residuals
from jaxdist.planner.activations import dropless_tier_bytes, flattened_group, saved_per_token_layer
from jaxdist.planner.layout import PARAM_BYTES, Layout
from jaxdist.planner.state_memory import gathered_per_layer, grad_bytes, state_bytes


def schedule_gradient_bytes(lay: Layout) -> float:
    """A table schedule computes the gradients inside its forward (a custom VJP): the stage's
    accumulator in the slot scan's carry, and the backward's scaled result are two gradient sets."""
    return grad_bytes(lay) if lay.table is not None else 0.0


def flat_group_bytes(lay: Layout) -> float:
    """A flattened group's (flattened_group) backward iteration, beside the stacks: its recompute and its
    backward are one graph whose all-gathers depend on no activation, so XLA issues them together at the
    iteration's start and holds the layer's weights gathered twice (heap traces of tiny at circular pp=2
    repeats 2 and GPipe pp=2 with 2 layers: 7.6 and 7.3 MB of gathered weights at the peak, of 7.9; the
    residuals, each freed by its consumer, are about 0.3 MB there) — as many bytes as the layer's
    gradient unreduced and reduced. Under accumulation GPipe's one group is the same layer in every
    iteration, so XLA hoists the forward's gathers out of the accumulation loop (they sit in the entry
    computation) and holds them beside the backward's (GPipe 2 layers, accumulation 2: 3.3 MB of them at
    the peak). 0 otherwise."""
    if not flattened_group(lay):
        return 0.0
    m = lay.cfg.model
    unit = gathered_layer_bytes(lay) * m.num_layers / m.stack_depth  # one scanned unit's layers
    return (3 if lay.accum > 1 and lay.repeats == 1 else 2) * unit


def dropless_recompute_bytes(lay: Layout) -> float:
    """One dropless MoE layer's tier recomputed in the backward (its residuals other than the two
    all-to-all results are not kept): the experts' SwiGLU intermediates (gate, up, silu(gate), their
    product; E x C x F/tp each, as the dense MLP's 4 F per token) at the largest tier, C = every local
    token, which the compiled conditional's buffers are sized for. 0 where dropless_tier_bytes is."""
    m = lay.cfg.model
    if not dropless_tier_bytes(lay):
        return 0.0
    F = m.moe_mlp_dim or m.mlp_dim
    return 4 * m.moe_experts * lay.micro_batch * m.seq_len * F / lay.mesh["tp"] * lay.act_bytes


def gathered_layer_bytes(lay: Layout) -> float:
    """One layer's parameters after the fsdp all-gather (still split by tp), float32."""
    return gathered_per_layer(lay)


def gathered_kv_bytes(lay: Layout) -> float:
    """context_impl=allgather: one layer's all-gathered K and V, and their gradients before the
    reduce-scatter (float32 on CPU). The ring holds two blocks in flight instead (counted as noise)."""
    m = lay.cfg.model
    if lay.cp == 1 or m.context_impl != "allgather":
        return 0.0
    return 4 * lay.micro_batch * m.seq_len * m.num_kv_heads * m.head_dim / lay.mesh["tp"] * lay.act_bytes


def loss_bytes(lay: Layout) -> float:
    """The loss's working set per device at its peak, over the tokens of one pass (the pipeline's
    micro-batches rejoin before the head), as the heap traces show it at V=8192 (fsdp=8, fsdp=4,tp=2):
    naive: float32 logits, their exponential and the softmax gradient over the vocab shard
    (3 x tokens x V/tp) and the gathered head weight; blockwise (jaxdist.parallel.loss): a block of logits (the
    probabilities and their gradient are fused into its consumers), or all of them where the forward
    keeps them for the backward (loss_blocks.Plan), the gathered chunk of blocks twice (the forward's gather
    is still live when the backward gathers it again; with the logits kept the backward gathers nothing,
    yet the compiled temp stayed within 0.01% at V=8192 on fsdp=8 and fsdp=4,tp=2, so the term stays:
    what holds those bytes at the peak instead was not traced) and the input-gradient sum. The head weight's gradients are not live yet: the peak comes before them."""
    m = lay.cfg.model
    tokens = lay.cfg.train.global_batch // (lay.batch_shards * lay.accum) * m.seq_len // lay.cp
    shards = lay.mesh["tp"]
    if m.loss_impl == "naive":
        rows = m.vocab_size // shards
        return 3 * tokens * rows * 4 + m.d_model * rows * lay.act_bytes
    rows = block_rows(m.vocab_size, shards, tokens, m.d_model, m.loss_block)
    plan = loss_plan(lay, tokens, rows)
    # After a GPipe / circular pipeline XLA schedules the backward's recomputed logits early: the
    # forward's block, its target select and the recomputed block are live together at the peak (heap
    # traces of gpipe M=32, circular M=16 and 32; one vocab block there). Not seen without a pipeline.
    blocks = 3 if lay.mesh["pp"] > 1 and lay.table is None else 1
    logits = blocks * tokens * rows * 4
    if plan.keep_logits:  # the forward's logits of every block, kept for the backward (the block among them)
        logits = max(logits, tokens * m.vocab_size // shards * lay.act_bytes)  # kept in the compute dtype
    gathered = 2 * m.d_model * rows * plan.chunk * lay.act_bytes  # a chunk of blocks (one per pass)
    # The input-gradient sum (tokens x d_model float32); after a circular pipeline three are live at the
    # peak (circular M=16, d_model 128: +1.08 MB over one, 2.06 sums; not traced buffer by buffer; the
    # GPipe pairs stay within their bound with one)
    sums = 3 if lay.mesh["pp"] > 1 and lay.table is None and lay.repeats > 1 else 1
    return logits + gathered + sums * tokens * m.d_model * 4


def loss_plan(lay: Layout, tokens: int, rows: int):
    """The blockwise loss's jaxdist.parallel.loss_blocks.Plan for these per-device tokens and vocab rows per block."""
    m = lay.cfg.model
    nb = m.vocab_size // (lay.mesh["tp"] * rows)
    return plan_for(tokens, rows, nb, m.d_model, lay.compute_dtype, m.loss_gather_mib, m.loss_keep_mib)


def layer_gradient_bytes(lay: Layout) -> float:
    """One layer's weight gradient while the backward scan reduces it to its parameter's sharding: its
    unreduced float32 gradients at the gathered (tp-split) size and the reduction's result —
    all-reduced in full on CPU (XLA emits all-reduce for the batch axes' gradient sum),
    reduce-scattered to the shard on GPU/TPU. With one replica nothing is reduced. XLA combines the
    layer's gradient all-reduces into one (every traced program has one all-reduce of the layer's nine
    gradients), so the whole layer's gradient is held twice; but XLA places part of it in the donated
    moment buffers the copies free, outside temp (heap.donated_live: the attention's gradients, at
    remat=full), in amounts its assignment order sets, not the shapes. The term counts the larger
    group (the MLP's or the attention's matrices): right where the attention's gradients go there,
    0.8 MB (10%) low for the d_model 128 pair, where none do."""
    if lora.enabled(lay):  # no base gradient: the backward gathers the layer's (float or code) matrices
        return gathered_per_layer(lay, lora.is_matrix) * lora.gathered_entry_bytes(lay) / PARAM_BYTES
    matrix = lambda g: len(g.shape) > 2  # norm scales are a few bytes
    mlp = lambda g: "/mlp/" in f"/{g.path}/" or "expert" in g.names
    full = max(
        gathered_per_layer(lay, lambda g: matrix(g) and mlp(g)),
        gathered_per_layer(lay, lambda g: matrix(g) and not mlp(g)),
    )
    if lay.batch_shards == 1:
        return full
    return full + (full if lay.hw.backend == "cpu" else full / lay.weight_shards)


def temporary_bytes(lay: Layout) -> float:
    """The backward scan's working set beside the saved activations and the gradients: copies of the
    AdamW mu and nu (moment_copy_bytes), allgather's gathered K and V, and the larger of one layer's
    full activations when its forward is recomputed (remat, or a pipeline stage) — without remat its
    per-token residuals sliced out of the stacks — one layer's gradient being reduced
    (layer_gradient_bytes): the layer's activations are dead by the time its gradient is complete —
    and a one-layer pipeline group's twice-gathered weights (flat_group_bytes)."""
    m = lay.cfg.model
    recompute = m.remat != "none" or lay.mesh["pp"] > 1
    # Not recomputed, the backward scan slices the layer's residuals out of the saved stacks into
    # buffers of their own, beside the gradients computed from them (heap trace of fsdp=2,tp=4: 5.5 MB
    # of dynamic-slice fusions and 2.4 MB of backward work at its peak; the traced per-token residuals
    # are 7.0 MB; the T x T scores, one of whose two copies is sliced, are left out). Not under cp:
    # with it the prediction is 23% over the compiled gradient programs of tests/test_context.py
    # (ring; their heap traces were not read).
    # A one-iteration scan is no loop (XLA's while-loop simplifier removes it): nothing is sliced (Qwen3-Next's
    # 2-layer fixture, one group, fsdp=4,ep=2: 2.51 MB compiled, 3.13 predicted with the slice).
    sliced = not recompute and lay.cp == 1 and m.stack_depth > 1
    # The scanned unit's layers (Qwen3-Next: a group of DeltaNet layers and one full attention layer; 1 for
    # the decoder) are recomputed or sliced together: 4 layers in 2 groups, 6.52 MB compiled, 6.23 predicted,
    # 5.29 with one layer's slice (scripts/memory/plan_check.py, docs/planner.md).
    unit = m.num_layers / m.stack_depth
    per_unit = saved_per_token_layer(lay, "none", pairs=recompute) * lay.micro_tokens * unit
    one_layer = per_unit if recompute or sliced else 0.0
    if lora.enabled(lay):
        # No base gradient to reduce; the layer's matrices, gathered at its backward iteration's start
        # (the gathers depend on no activation), are read by the input gradients throughout, beside
        # the layer's activations (heap trace of tiny, fsdp=8, float32 base: the gathered MLP
        # matrices beside the sliced residual stacks at the peak).
        one_layer += layer_gradient_bytes(lay)
    working = max(one_layer, layer_gradient_bytes(lay), dropless_recompute_bytes(lay), flat_group_bytes(lay))
    return moment_copy_bytes(lay) + working + gathered_kv_bytes(lay) + ring_block_bytes(lay)


def moment_copy_bytes(lay: Layout) -> float:
    """The old AdamW moments XLA:CPU copies at the step's start and holds until the update: the update
    fusions write the new mu and nu into their donated buffers while the non-finite guard's select (and
    the parameter's fusion, which recomputes the moments) still read the old ones (copy insertion; none
    without the guard). Read from the buffer assignments and heap traces: every mu copy and most nu
    copies sit in the temp allocation (a few go into a donated buffer already copied out), the
    embedding's and head's too (at V=8192: 3-4 MB of the 7.0-7.4 MB of copies at the loss's peak), so
    both moments of every parameter are counted, in both of compiled_temp_bytes's branches (another
    optim.name: its state, state_bytes)."""
    return state_bytes(lay)


def ring_block_bytes(lay: Layout) -> float:
    """context_impl=ring: one step's (T/cp) x (T/cp) block of scores and their intermediates (the
    traced per-pair residuals of full attention), live while a block is merged or differentiated."""
    m = lay.cfg.model
    if lay.cp == 1 or m.context_impl != "ring" or lay.hw.flash_attention:
        return 0.0
    pairs = residuals.listed_per_layer(m, lay.mesh["tp"], m.remat).per_token_pair or (
        residuals.listed_per_layer(m, lay.mesh["tp"], "none").per_token_pair
    )
    return pairs * lay.micro_batch * (m.seq_len // lay.cp) ** 2 * lay.act_bytes / 4
