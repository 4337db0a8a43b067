"""Per-device memory of one training step: parameters, gradients, AdamW moments, activations, temporaries.

Conventions (those of jaxdist.training.step): float32 master parameters, float32 gradients, AdamW's two float32
moments (mu, nu) — 4 + 4 + 8 = 16 bytes per parameter before sharding (so 70B parameters are 280 GB,
and AdamW adds 560 GB). Each array is divided by the devices that shard it under the logical rules.

Activations saved for the backward pass, per layer and per token of a micro-batch (B·T·D rows are
replicated over tp; heads / mlp columns are split by tp). Dense layers: the residuals JAX saves for the
layer under its remat policy (jaxdist.planner.residuals traces one Block), the T x T scores replaced by
O(T) statistics where attention is fused or a ring; MoE layers use these formulas, by remat policy:
  full          : the layer input only (D); the layer is recomputed in the backward pass.
  dots_saveable : the outputs of the weight matmuls (q, k, v, attention out, gate, up, down) and the input.
  none          : every intermediate, including the T x T attention probabilities unless the backend
                  uses a fused (flash) attention.
With pipeline parallelism (jaxdist.parallel.pipeline) each stage keeps one stage input per pipeline
iteration (V·M + P - 1 micro-batches in flight) and recomputes its L/(P·V) layers during backward
(with one layer per group XLA inlines the group's scan, so no residual stack is kept: flat_group_bytes);
GPipe's backward also carries two (M, b, T, D) cotangent buffers (carried_cotangents), and the loss,
run once over the M micro-batches after the pipeline, has a peak of its own (loss_side_bytes).
With context parallelism (jaxdist.parallel.context) a device holds T/cp tokens of each sequence, so
every per-token term above divides by cp; the attention scores are (T/cp) x T per head for allgather
and ulysses, while the ring (like a fused attention) keeps only O(T/cp) statistics. allgather also holds
the gathered K and V (and their gradients) of one layer: 4·B·T·K·H/tp elements.

Temporary bytes (memory_analysis().temp) are the backward pass's peak, read term by term from XLA:CPU's
buffer assignment: saved activations + one set of float32 gradients (+ the non-layer gradients'
accumulator under accumulation) + copies of the two AdamW moments + the larger of one layer's
activations (recomputed, or without remat sliced out of the saved stacks) and one layer's gradient
group being reduced — or, where larger, the loss's working set beside the moments' copies. The update writes the new parameters and moments into the donated state, but XLA:CPU
first copies the old moments (the non-finite guard's select still reads them), at the step's start.

These terms were revised against the compiled temp allocation. XLA's heap simulator packs it with
little waste (jaxdist.planner.heap replays its trace: the allocation is 0.0-1.8% above the bytes held at
its peak on most checked pairs, at most 8.7%), so a miss is a buffer the terms leave out or count
wrongly, not fragmentation — or a value XLA placed in a donated parameter buffer instead of temp
(heap.donated_live; 0-82% of the moment copies' bytes at the peak on 18 traced programs).
"""

from __future__ import annotations

import dataclasses

from jaxdist.adapters import quant
from jaxdist.objectives import registry as objectives
from jaxdist.optim import registry as optimizers
from jaxdist.parallel.loss import block_rows, plan_for
from jaxdist.parallel.moe import dropless_tiers
from jaxdist.planner import lora, residuals
from jaxdist.planner.layout import PARAM_BYTES, Layout, param_table

USABLE_FRACTION = 0.9  # of HBM: runtime, allocator fragmentation and buffers the model does not see
STATE_SCALARS = 2 * 4  # TrainState.step and .skipped (int32)


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes per device."""

    params: float
    grads: float
    optimizer: float
    activations: float  # saved for the backward pass (all layers / in-flight micro-batches)
    temporary: float  # the layers' working set in the backward (temporary_bytes)
    batch: float  # the step's input tokens
    capacity: float  # usable HBM
    loss: float = 0.0  # the loss's working set (loss_bytes)
    moment_copies: float = 0.0  # the old AdamW moments' copies, held through the step (moment_copy_bytes)
    host: float = 0.0  # of params + optimizer, what lives in host memory between steps (offload.*=host)
    fetched: float = 0.0  # offload.params=host without remat: the fetched layer weights the backward keeps
    loss_activations: float = 0.0  # what is live beside the loss's working set at its peak (loss_side_bytes)
    reference: float = 0.0  # a frozen reference copy of the parameters in the gradient stage's state (reference_bytes)

    @property
    def arguments(self) -> float:
        """What the compiled step receives in device memory: params + optimizer state + tokens, less what
        offload keeps in host memory (metrics.compiled_memory's device arguments)."""
        return self.params + self.optimizer + self.reference + self.batch + STATE_SCALARS - self.host

    @property
    def compiled_temp(self) -> float:
        """Comparable with memory_analysis().temp_size_in_bytes (see compiled_temp_bytes)."""
        return compiled_temp_bytes(self)

    @property
    def total(self) -> float:
        return self.arguments + self.compiled_temp + self.fetched

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(total=self.total, fits=self.fits)
        return d


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


def saved_per_token_layer(lay: Layout, policy: str, pairs: bool = True) -> float:
    """Bytes one layer keeps for backward per token of a micro-batch: for dense layers without cp, the
    residuals JAX itself saves (jaxdist.planner.residuals), with a fused attention's O(T) statistics in
    place of the T x T scores (pairs=False: without them); otherwise the formulas of the module docstring."""
    m, c, t = lay.cfg.model, lay.act_bytes, lay.mesh["tp"]
    if not m.moe_experts:
        # cp's attention (jaxdist.parallel.context) is not the Block's traced by residuals: the Block's
        # merged buffers do not describe it, so under cp every residual JAX lists is counted.
        saved = (residuals.listed_per_layer if lay.cp > 1 else residuals.saved_per_layer)(m, t, policy)
        # A query's scores span all T keys (cp: allgather and ulysses too); a fused attention and the
        # ring keep its output and log-sum-exp instead.
        scores = saved.per_token_pair * m.seq_len if pairs else 0.0
        if scores and (lay.hw.flash_attention or (lay.cp > 1 and m.context_impl == "ring")):
            scores = 4 * (m.num_heads * m.head_dim / t + m.num_heads / t)
        return (saved.per_token + scores) * c / 4
    D, NH, KH, F = m.d_model, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim, m.mlp_dim
    if policy == "full":
        return D * c
    if policy == "dots_saveable":
        return c * (3 * D + (NH + 2 * KH) / t + 2 * F / t)
    blockwise = lay.hw.flash_attention or (lay.cp > 1 and m.context_impl == "ring")
    attention = (c * NH / t + 4 * m.num_heads / t) if blockwise else 4 * m.num_heads / t * m.seq_len
    # x, two norms, residual, attention out, down: 6 D; q, k, v before and after rotary, o: (3 NH + 3 KH) / t;
    # gate, up, silu(gate), their product: 4 F / t
    return c * (6 * D + (3 * NH + 3 * KH) / t + 4 * F / t) + attention


def activation_bytes(lay: Layout) -> float:
    m, tokens = lay.cfg.model, lay.micro_tokens
    if lay.mesh["pp"] == 1:
        tiers = dropless_tier_bytes(lay) * (m.num_layers // m.moe_every if m.moe_experts else 0)
        saved = saved_per_token_layer(lay, m.remat) * m.num_layers * tokens + tiers
        return saved + dequantised_bytes(lay) * m.num_layers
    if lay.table is not None:  # the table's buffers (schedules.buffers), whatever M is
        stage_inputs = table_buffers(lay) * tokens * m.d_model * lay.act_bytes
    else:
        stage_inputs = (lay.pipe_iterations + carried_cotangents(lay)) * tokens * m.d_model * lay.act_bytes
    if flattened_group(lay):  # no residual stack: the recompute feeds the backward directly
        return stage_inputs
    group_layers = m.num_layers // (lay.mesh["pp"] * lay.repeats)
    return stage_inputs + saved_per_token_layer(lay, m.remat) * group_layers * tokens


def carried_cotangents(lay: Layout) -> int:
    """GPipe's backward scan carries the cotangents of its forward carry's two (M, b, T, D) buffers, the
    micro-batch inputs and the last stage's outputs: 2 M micro-batches beside the stage inputs (heap trace
    of pp=4,fsdp=2, 8 layers, M=16: two 0.5 MB (16, 1, 64, 128) buffers at the backward's peak). Circular's
    backward holds such buffers too (six (M, ...) ones at M=4), but its other terms are already over at
    small M (+5.7% at M=4), so they are left out there: not modelled."""
    return 2 * lay.pipe_micro if lay.mesh["pp"] > 1 and lay.table is None and lay.repeats == 1 else 0


def loss_side_bytes(lay: Layout) -> float:
    """What is live beside the loss's working set (and the moment copies) at the loss's peak. Without a
    pipeline, or with a table schedule (whose loss runs per micro-batch inside the schedule), the saved
    activations. GPipe / circular run the head once over the pass's M micro-batches after the pipeline,
    and the heap traces of pp=4,fsdp=2 (8 layers, d_model 128, seq 64; gpipe M=32, circular V=2 M=16 and
    32) show at the loss's peak: the stage inputs (no recomputed residual stack: that is the backward's),
    the pipeline's (M, b, T, D) output buffer and its all-reduce over pp (the last stage's outputs sent to
    every stage), and two of the stage's three MLP gradient stacks (w_down's and one of w_gate / w_up's,
    in all four traces), zero-filled for the backward scan's carry before the loss runs."""
    m = lay.cfg.model
    if lay.mesh["pp"] == 1 or lay.table is not None:
        return activation_bytes(lay)
    one = lay.micro_tokens * m.d_model * lay.act_bytes
    mlp = lambda g: g.role == "layer" and len(g.shape) > 2 and ("/mlp/" in f"/{g.path}/" or "expert" in g.names)
    return (lay.pipe_iterations + 2 * lay.pipe_micro) * one + 2 / 3 * stored_bytes(lay, mlp)


def table_buffers(lay: Layout) -> int:
    """A table schedule's (jaxdist.parallel.pipeline_1f1b) activation-sized buffers per stage: the
    stage inputs kept until their backward and the gradients waiting for it (schedules.buffers: for
    1f1b at most P inputs, 2P-3 paired, whatever M is), plus the slot's received activation and
    gradient in the scan's carry."""
    _, bufs = lay.tabled
    return bufs.x_size + bufs.g_size + 2


def schedule_gradient_bytes(lay: Layout) -> float:
    """A table schedule computes the gradients inside its forward (a custom VJP): the stage's
    accumulator in the slot scan's carry, and the backward's scaled result are two gradient sets."""
    return grad_bytes(lay) if lay.table is not None else 0.0


def dequantised_bytes(lay: Layout) -> float:
    """QLoRA (int8 / NF4 base) without remat: one layer's de-quantised matrices (gathered, compute
    dtype), which the forward saves for the input gradient's matmul (a float base is a parameter the
    backward reads, or gathers, again). 0 otherwise. Read from the heap trace of tiny, fsdp=8, NF4:
    4 MB stacks of the 4 layers' de-quantised MLP matrices at the peak."""
    if not lora.enabled(lay) or lay.cfg.lora.base_dtype not in quant.KINDS or lay.cfg.model.remat != "none":
        return 0.0
    return gathered_per_layer(lay, lora.is_matrix) * lay.act_bytes / PARAM_BYTES


def flattened_group(lay: Layout) -> bool:
    """A pipeline whose layer groups hold one scanned unit each (L = P·V for dense layers): the group's
    scan runs once, and XLA inlines it into the pipeline loop's body (circular pp=2 repeats 2 compiles
    to two while loops, the pipeline's forward and backward; with two layers per group, to five)."""
    return lay.mesh["pp"] > 1 and lay.cfg.model.stack_depth == lay.mesh["pp"] * lay.repeats


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


def dropless_tier_bytes(lay: Layout) -> float:
    """One dropless MoE layer's saved dispatch buffers (remat=none, no pipeline): every tier keeps its
    two all-to-all results (E x C x D each) for the backward, the tiers not taken too, because a
    lax.switch returns every branch's residuals (jaxdist.parallel.moe; read from the compiled step's
    heap trace: the layers' stacks of each tier's buffers are live at its peak). 0 otherwise: remat
    and the pipeline's stage recompute rebuild them in the backward."""
    m = lay.cfg.model
    if not m.moe_experts or m.moe_dispatch != "dropless" or m.remat != "none" or lay.mesh["pp"] > 1:
        return 0.0
    tiers = dropless_tiers(lay.micro_batch * m.seq_len, m.moe_experts, m.moe_topk)
    return 2 * m.moe_experts * sum(tiers) * m.d_model * lay.act_bytes if len(tiers) > 1 else 0.0


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
    keeps them for the backward (loss.Plan), the gathered chunk of blocks twice (the forward's gather
    is still live when the backward gathers it again) and the input-gradient sum. The head weight's gradients are not live yet: the peak comes before them."""
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
    return logits + gathered + tokens * m.d_model * 4


def loss_plan(lay: Layout, tokens: int, rows: int):
    """The blockwise loss's jaxdist.parallel.loss.Plan for these per-device tokens and vocab rows per block."""
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
    sliced = not recompute and lay.cp == 1
    one_layer = saved_per_token_layer(lay, "none", pairs=recompute) * lay.micro_tokens if recompute or sliced else 0.0
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


def compiled_temp_bytes(mem: Memory) -> float:
    """What memory_analysis() calls temp: the peak of the backward pass — the saved activations, and
    either the loss's working set beside the moments' copies, taken at the step's start (before any
    layer gradient exists), or the gradients and the layers' working set (the copies included). The optimizer update adds no peak of its own: clip, AdamW and the non-finite guard fuse
    into elementwise passes that write the new parameters and moments into the donated state's buffers,
    reading the gradients and the old moments' copies, which the backward already holds."""
    return max(mem.activations + mem.grads + mem.temporary, mem.loss_activations + mem.loss + mem.moment_copies)


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


def estimate(lay: Layout) -> Memory:
    params = param_bytes(lay)
    grads = grad_bytes(lay) + (accumulator_bytes(lay) if lay.accum > 1 else 0) + schedule_gradient_bytes(lay)
    batch = batch_bytes(lay)
    return Memory(
        params=params,
        grads=grads,
        optimizer=optimizer_bytes(lay),
        activations=activation_bytes(lay),
        temporary=temporary_bytes(lay),
        batch=batch,
        capacity=lay.hw.hbm_bytes * USABLE_FRACTION,
        loss=loss_bytes(lay),
        moment_copies=moment_copy_bytes(lay),
        host=host_bytes(lay),
        fetched=fetched_bytes(lay),
        loss_activations=loss_side_bytes(lay),
        reference=reference_bytes(lay),
    )


def fetched_bytes(lay: Layout) -> float:
    """offload.params=host with model.remat=none: the backward keeps every layer's fetched device copy
    (JAX saves them as residuals; jaxdist.distributed.offload.host_transfers counts no second fetch), one layer
    stack beside what the model without offload holds, whose saved weights are its arguments' own
    buffers. A GPU's figure: XLA:CPU strips the moves, so there the copies are the host arguments
    themselves and its compiled temp does not show them. With a remat policy one layer is fetched at
    a time (within the layers' working set)."""
    o = lay.cfg.offload
    if o.params != "host" or o.activations == "host" or lay.cfg.model.remat != "none":
        return 0.0
    return stored_bytes(lay, lambda g: g.role == "layer")


def host_bytes(lay: Layout) -> float:
    """Bytes per device that offload keeps in pinned host memory between steps (the device's temp is
    not modelled lower: the transfers and the layer being computed still use it)."""
    o = lay.cfg.offload
    return (param_bytes(lay) if o.params == "host" else 0.0) + (optimizer_bytes(lay) if o.optimizer == "host" else 0.0)
