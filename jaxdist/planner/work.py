"""Replicated work: the memory-bound bytes each device touches per step that do not shrink with every
mesh axis, and their seconds at the hardware's memory bandwidth (`work_bytes`, `work_seconds`).

The step's compute term (planner/estimate.py) divides the model's matmul FLOPs over every device, as if
each device did 1/N of the step. Two parts of a step are not divided so:

- **the training state's update.** Every device writes its gradients, reduces and clips them, and runs
  the optimizer over the parameters, gradients and moments it stores (`state_memory`'s per-device bytes).
  A parameter replicated over dp (or over ep, for a dense model's weights; over tp and ep for what those
  axes do not split) is updated on every device that holds it: under dp=8 each device updates the whole
  model, under fsdp=8 an eighth of it. XLA's cost analysis of the compiled step counts about 6.5 bytes
  touched per byte of stored state (UPDATE_PASSES: tiny and tiny-moe at dp=8 against fsdp=8, whose
  gathered weights are the same; tests/test_moe.py::test_replicated_work_is_the_compilers_count).
- **the weights each device computes with**, read by the forward and again by the backward (WEIGHT_PASSES):
  after the fsdp all-gather they are whole on every device but for what tp (and, for expert weights, ep)
  splits, so replicated expert weights under dp cost every device the whole expert stack.

- **the dropless experts' padding.** jaxdist/parallel/moe.py runs each local expert over its received
  rows in chunks of two sources' balanced shares (grouped_ffn.chunk_rows: 2·N·K/E rows), so an expert's
  compute is its load rounded up to whole chunks. A local expert's balanced load is ep·N·K/E rows, half
  a chunk per ep rank: at ep=1 (experts replicated over dp or gathered by fsdp) every expert runs one
  whole chunk for half a chunk of rows, twice the routed FLOPs; at ep rounding adds half a chunk on
  average, a fraction 1/ep (`padded_expert_flops`, added to the compute term's FLOPs).

The first two are memory-bound (elementwise passes, no matmul to hide them), so they add to the step at
`Hardware.hbm_bandwidth`. On GPUs they are small beside the matmuls (an 8B model's AdamW update over
fsdp=8 is about 30 ms on H100 against seconds of compute); on simulated CPU devices, which share two
cores and one memory bus, they decide: tiny-moe measured 2.0x (3.4x on a more loaded machine) slower at dp=8 than at ep=8 with
nearly the same matmul FLOPs per device (docs/planner.md's sweeps).
"""

from __future__ import annotations

from jaxdist.models import registry
from jaxdist.planner.layout import Layout, param_table
from jaxdist.planner.state_memory import gathered_per_layer, grad_bytes, optimizer_bytes, param_bytes

# Bytes touched per byte of per-device training state (parameters, gradients, optimizer moments) in a
# step: the gradient written, reduced and clipped; the optimizer reading parameters, gradients and
# moments and writing parameters and moments; the moments' copies. Fitted to XLA's cost analysis
# ("bytes accessed") of the compiled step on 8 CPU devices: 6.4x (tiny) and 6.9x (tiny-moe) between dp=8
# and fsdp=8 (see the module doc).
UPDATE_PASSES = 6.5
# The gathered layer weights, read by the forward and by the backward's input gradient.
WEIGHT_PASSES = 2.0


def state_bytes(lay: Layout) -> float:
    """Per-device bytes of the training state the step updates in place (parameters, gradients, moments)."""
    return param_bytes(lay) + grad_bytes(lay) + optimizer_bytes(lay)


def weight_bytes(lay: Layout) -> float:
    """Per-device bytes of the layer weights the matmuls read once per pass: one layer gathered (split by
    tp, expert weights by ep) times the layers of one pipeline stage."""
    layers = lay.cfg.model.num_layers // lay.mesh["pp"]
    return gathered_per_layer(lay) * layers


def work_bytes(lay: Layout) -> float:
    """The memory-bound bytes one device touches per optimizer step outside the matmuls' FLOPs: the state's
    update and the weights' reads (each micro-batch of an accumulation reads the weights again)."""
    return UPDATE_PASSES * state_bytes(lay) + WEIGHT_PASSES * weight_bytes(lay) * lay.accum


def work_seconds(lay: Layout) -> float:
    """`work_bytes` at the hardware's memory bandwidth; 0 where the entry has none."""
    bw = lay.hw.hbm_bandwidth
    return work_bytes(lay) / bw if bw else 0.0


def padded_expert_flops(lay: Layout) -> float:
    """Hardware FLOPs per device per step that the dropless experts' chunk rounding adds (see the module
    doc): the routed experts' training FLOPs (6 per active parameter and token) times 1/ep, the expected
    rounding of a local expert's ep·N·K/E rows up to chunks of 2·N·K/E (exactly one whole extra share at
    ep=1). 0 for a dense model or the capacity dispatch, whose slots are fixed."""
    m = lay.cfg.model
    if not m.moe_experts or m.moe_dispatch != "dropless" or registry.of(m).dense_experts:
        return 0.0
    routed = sum(g.size for g in param_table(m) if g.role == "layer" and "expert" in g.names)
    tokens = lay.cfg.train.global_batch * m.seq_len
    return 6 * routed * m.moe_topk / m.moe_experts * tokens / lay.mesh["ep"] / lay.devices


def unchosen_expert_flops(lay: Layout) -> float:
    """Hardware FLOPs per device per step of the experts a token did not choose, where every token runs
    through every expert (registry `dense_experts`: gpt-oss, weighted 0): the routed experts' training
    FLOPs (6 per parameter and token, +2 recomputed) times (E - K) / E, beyond the model FLOPs' K / E."""
    m = lay.cfg.model
    if not m.moe_experts or not registry.of(m).dense_experts:
        return 0.0
    routed = sum(g.size for g in param_table(m) if g.role == "layer" and "expert" in g.names)
    passes = 8 if m.remat == "full" or lay.mesh["pp"] > 1 else 6
    tokens = lay.cfg.train.global_batch * m.seq_len
    return passes * routed * (m.moe_experts - m.moe_topk) / m.moe_experts * tokens / lay.devices
