"""Activations a training step saves for its backward pass, per device (`memory.estimate`'s activations
and the loss's side of them).

Activations saved for the backward pass, per layer and per token of a micro-batch (B·T·D rows are
replicated over tp; heads / mlp columns are split by tp). Dense layers: the residuals JAX saves for the
layer under its remat policy (jaxdist.planner.residuals traces one Block), the T x T scores replaced by
O(T) statistics where attention is fused or a ring; experts that see every token (registry
`dense_experts`) are traced with their Block, and the dense first layers (`dense_first`) as one.
Token-dispatched MoE layers: what the architecture's Block saves beyond its MLP (attention, norms,
residual; traced: _attention_per_token) plus these formulas for the experts, by remat policy:
  full          : the layer input only (D); the layer is recomputed in the backward pass.
  dots_saveable : the outputs of the expert matmuls (gate, up, down).
  none          : the down projection's output, gate, up, silu(gate) and their product.
With pipeline parallelism (jaxdist.parallel.pipeline) each stage keeps one stage input per pipeline
iteration (V·M + P - 1 micro-batches in flight) and recomputes its L/(P·V) layers during backward
(with one layer per group XLA inlines the group's scan, so no residual stack is kept: flat_group_bytes);
GPipe's backward also carries two (M, b, T, D) cotangent buffers (carried_cotangents), and the loss,
run once over the M micro-batches after the pipeline, has a peak of its own (loss_side_bytes).
With context parallelism (jaxdist.parallel.context) a device holds T/cp tokens of each sequence, so
every per-token term above divides by cp; the attention scores are (T/cp) x T per head for allgather
and ulysses, while the ring (like a fused attention) keeps only O(T/cp) statistics. allgather also holds
the gathered K and V (and their gradients) of one layer: 4·B·T·K·H/tp elements.
"""

from __future__ import annotations

import dataclasses

from jaxdist.adapters import quant
from jaxdist.models import registry
from jaxdist.parallel.moe import dropless_tiers
from jaxdist.planner import lora, residuals
from jaxdist.planner.layout import PARAM_BYTES, Layout
from jaxdist.planner.state_memory import gathered_per_layer, stored_bytes


def saved_per_token_layer(lay: Layout, policy: str, pairs: bool = True) -> float:
    """Bytes one layer keeps for backward per token of a micro-batch: for dense layers without cp, the
    residuals JAX itself saves (jaxdist.planner.residuals), with a fused attention's O(T) statistics in
    place of the T x T scores (pairs=False: without them); otherwise the formulas of the module docstring.
    Plus, averaged over the stack, what the architecture's other layer kinds save beyond the layer
    counted here (residuals.other_per_token: Qwen3-Next's gated DeltaNet chunk activations, float32)."""
    m, t = lay.cfg.model, lay.mesh["tp"]
    return _block_per_token(lay, policy, pairs) + residuals.other_per_token(m, t, policy)


def _block_per_token(lay: Layout, policy: str, pairs: bool) -> float:
    """saved_per_token_layer for a stack of the architecture's `Block` alone."""
    m = lay.cfg.model
    arch = registry.of(m)
    if m.moe_experts and not arch.dense_experts:  # dispatched experts, and the dense first layers traced
        dense = arch.dense_first(m) if arch.dense_first else 0
        moe = _moe_per_token(lay, policy, pairs) * (m.num_layers - dense)
        if dense:
            moe += _traced_per_token(lay, dataclasses.replace(m, moe_experts=0), policy, pairs) * dense
        return moe / m.num_layers
    return _traced_per_token(lay, m, policy, pairs)


def _traced_per_token(lay: Layout, m, policy: str, pairs: bool) -> float:
    """What one `Block` of `m` saves per token, traced by jaxdist.planner.residuals (experts that see
    every token, registry `dense_experts`, traced with it)."""
    c, t = lay.act_bytes, lay.mesh["tp"]
    # cp's attention (jaxdist.parallel.context) is not the Block's traced by residuals: the Block's
    # merged buffers do not describe it, so under cp every residual JAX lists is counted.
    saved = (residuals.listed_per_layer if lay.cp > 1 else residuals.saved_per_layer)(m, t, policy)
    # A query's scores span all T keys (cp: allgather and ulysses too); a fused attention and the
    # ring keep its output and log-sum-exp instead.
    scores = saved.per_token_pair * m.seq_len if pairs else 0.0
    if scores and (lay.hw.flash_attention or (lay.cp > 1 and m.context_impl == "ring")):
        scores = 4 * (m.num_heads * m.head_dim / t + m.num_heads / t)
    return (saved.per_token + scores) * c / 4


def _moe_per_token(lay: Layout, policy: str, pairs: bool) -> float:
    """What one dispatched MoE layer saves per token: the module docstring's formulas, their attention
    part (everything but the MLP's) the architecture's own, traced (`_attention_per_token`)."""
    m, c, t = lay.cfg.model, lay.act_bytes, lay.mesh["tp"]
    D, F = m.d_model, m.mlp_dim
    if policy == "full":
        return D * c
    attention = _attention_per_token(lay, policy, pairs)
    if policy == "dots_saveable":  # the down projection's output; gate, up: 2 F / t
        return attention + c * (D + 2 * F / t)
    # the down projection's output: D; gate, up, silu(gate), their product: 4 F / t
    return attention + c * (D + 4 * F / t)


def _attention_per_token(lay: Layout, policy: str, pairs: bool) -> float:
    """What the architecture's dense `Block` saves per token beyond its MLP (attention, norms, residual):
    the traced Block at mlp_dim F less its MLP's share, which is linear in the MLP's width (traced again
    at a narrower G)."""
    m, t = lay.cfg.model, lay.mesh["tp"]
    dense = dataclasses.replace(m, moe_experts=0)
    G = max(t, m.mlp_dim // (2 * t) * t)
    wide = _traced_per_token(lay, dense, policy, pairs)
    narrow = _traced_per_token(lay, dataclasses.replace(dense, mlp_dim=G), policy, pairs)
    return wide - (wide - narrow) * m.mlp_dim / (m.mlp_dim - G)


def activation_bytes(lay: Layout) -> float:
    m, tokens = lay.cfg.model, lay.micro_tokens
    if lay.mesh["pp"] == 1:
        tiers = dropless_tier_bytes(lay) * registry.of(m).moe_layers(m)
        saved = saved_per_token_layer(lay, m.remat) * m.num_layers * tokens + tiers
        return saved + dequantised_bytes(lay) * m.num_layers
    if lay.table is not None:  # the table's buffers (schedule_buffers.buffers), whatever M is
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
    stage inputs kept until their backward and the gradients waiting for it (schedule_buffers.buffers: for
    1f1b at most P inputs, 2P-3 paired, whatever M is), plus the slot's received activation and
    gradient in the scan's carry."""
    _, bufs = lay.tabled
    return bufs.x_size + bufs.g_size + 2


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


def dropless_tier_bytes(lay: Layout) -> float:
    """One dropless MoE layer's saved dispatch buffers (remat=none, no pipeline): every tier keeps its
    two all-to-all results (E x C x D each) for the backward, the tiers not taken too, because a
    lax.switch returns every branch's residuals (jaxdist.parallel.moe; read from the compiled step's
    heap trace: the layers' stacks of each tier's buffers are live at its peak). 0 otherwise: remat
    and the pipeline's stage recompute rebuild them in the backward."""
    m = lay.cfg.model
    if not m.moe_experts or m.moe_dispatch != "dropless" or m.remat != "none" or lay.mesh["pp"] > 1:
        return 0.0
    if registry.of(m).dense_experts:  # no dispatch
        return 0.0
    tiers = dropless_tiers(lay.micro_batch * m.seq_len, m.moe_experts, m.moe_topk)
    return 2 * m.moe_experts * sum(tiers) * m.d_model * lay.act_bytes if len(tiers) > 1 else 0.0


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
