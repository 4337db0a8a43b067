"""Communication of one training step: bytes per device, per mesh axis and collective, and its time.

Cost per collective: the bytes each device *sends*, by `jaxdist.distributed.hlo.ring_bytes` (the one ring model:
the compiled program's collectives are costed by the same function, so predictions compare directly
with `hlo.summarize(hlo.collectives(compiled.as_text()))`), over the axis's link bandwidth (the JAX
scaling book, https://jax-ml.github.io/scaling-book/sharding/), plus a latency alpha per collective
(alpha-beta model).

What the compiler emits (read from jaxdist's compiled HLO on CPU; the SPMD partitioner is the same on
every backend):
- fsdp: each layer's weights are all-gathered in the compute dtype (cast on their shard first:
  jaxdist.parallel.matmul.weight_matmul) in the forward scan and again in the backward scan
  (one gather per layer per pass; with remat the recompute and the gradient share the backward's:
  jaxdist.parallel.matmul.gathered, an explicit gather whose copy is the recompute's residual; XLA
  never merges two all-gathers of one array, each having its own channel). The norm scales are
  replicated under the default `norm` rule and gathered by nobody; `mesh.rules.norm=[fsdp]` shards them.
- gradients: float32 (bf16 compute included; reduce.dtype=bfloat16 halves the layers' matrices and the
  head on GPU/TPU, not on XLA:CPU, which promotes a bf16 all-reduce to float32), per layer, inside the backward scan (so once per
  accumulation micro-batch unless reduce.method makes the dp reduction explicit). GPU/TPU:
  reduce-scatter over fsdp, then all-reduce of the shard over dp. **XLA:CPU emits an all-reduce over fsdp instead of the reduce-scatter** (then slices),
  twice the bytes; we model each backend as it compiles.
- LoRA (lora.rank > 0): no base, head, norm or embedding gradient is reduced; the adapters' gradients
  are all-reduced once per pass over every batch axis. The base matrices are gathered as stored under
  QLoRA (codes and scales, de-quantised locally), once per pass without remat (the de-quantised layer
  is saved), else twice; adapters with an fsdp-sharded dim are gathered forward and backward; the
  frozen embedding's lookup sends no gradient all-to-all back.
- tp (Megatron layout): per layer, all-reduce of the B·T·D activations after the attention and MLP output
  projections (2 forward); backward all-reduces the input gradient of each input projection separately
  (q, k, v and gate, up: 5); remat=full recomputes the attention all-reduce (+1).
- head (jaxdist.parallel.loss): naive — gathered over fsdp once per pass (the head of a tied table twice when
  tp > 1, observed), the input gradient all-reduced over tp; blockwise — every block gathered in the
  forward (in the compute dtype; model.loss_gather_mib of blocks per collective) and, only when the
  logits are recomputed (model.loss_keep_mib), again in the backward; the float32 input gradient and
  three per-token log-sum-exp statistics all-reduced over tp once. Its gradient is reduced like a layer's.
  The final norm, when its rule shards it, is gathered twice. Gathers of loop-invariant weights (the final norm, the naive head, a
  head of one vocab block) are hoisted out of the accumulation loop: once per step, not per pass.
- embedding lookup (jaxdist.parallel.embedding): the int32 tokens all-gathered over fsdp, the looked-up
  rows all-reduced over tp (B·T·D float32), an all-to-all over fsdp forward and one backward; the
  table's gradient is local (no fsdp reduction), then all-reduced over ep and over cp (they split the
  tokens, not the table: once per pass) and over dp.
- the loss under cp: flattening (batch, seq/cp) into rows re-shards them, an all-to-all over cp of the
  final hidden states forward and of their gradient backward.
- ep (jaxdist.parallel.moe): per MoE layer, an all-to-all of the E·C·D dispatch buffer to the experts
  and one back, forward and backward (4; +2 with remat=full), C = the capacity of the local tokens
  (dropless: all of them). Expert weights stay split over ep (gathered over fsdp only); the other
  weights are replicated over ep, so their gradients are also reduced over ep (ep is data-parallel
  for them: the batch is split over dp, fsdp and ep). Experts that see every token (registry
  `dense_experts`: gpt-oss) are gathered whole and reduced whole instead, and no tokens are exchanged
  (planner/expert_traffic.py); LoRA's adapters on routed experts (DeepSeek-V3) are added to the expert
  weights before their gather, never gathered themselves.
- pp (jaxdist.parallel.pipeline): per pipeline iteration one collective-permute of the micro-batch's
  B·T·D activations forward and one backward; per pass one permute of the whole pass's activations each
  way and an all-reduce over pp handing the last stage's output to every rank (fwd + bwd). Stages are
  rematerialised, so stage weights are gathered three times per iteration (forward, recompute,
  gradient) and the forward tp all-reduces happen twice. With one layer per stage application (no layer
  scan) the recompute skips w_down, and GPipe's forward gather is hoisted out of the loops (once a step).
  Table schedules (1f1b, 1f1b_paired, interleaved_1f1b) are counted per slot of their table instead,
  each lane at its largest branch (planner/schedule_traffic.py).
- cp (jaxdist.parallel.context), per layer: allgather all-gathers K and V of the whole sequence forward
  and reduce-scatters their gradients backward; ring sends 2(cp-1) K/V blocks (B·T/cp·K·H) forward and,
  backward, 2(cp-1) again plus 2cp float32 dK/dV blocks travelling home; ulysses all-to-alls q, k, v and
  the output each way. Weights are replicated over cp (unless mesh.rules.embed adds it), so gradients
  are reduced over fsdp x cp together: one all-reduce over that group on CPU. Activations (tp
  all-reduces, embedding) are per device, so they divide by cp.
"""

from __future__ import annotations

from jaxdist.adapters.quant import KINDS
from jaxdist.models import registry
from jaxdist.parallel.moe import dropless_tiers
from jaxdist.planner import lora
from jaxdist.planner.context_traffic import context_traffic
from jaxdist.planner.expert_traffic import expert_layer_bytes, expert_traffic
from jaxdist.planner.head_traffic import table_traffic
from jaxdist.planner.layout import PARAM_BYTES, Layout, param_table
from jaxdist.planner.optimizer_traffic import optimizer_traffic
from jaxdist.planner.schedule_traffic import schedule_table_traffic
from jaxdist.planner.state_memory import gathered_per_layer
from jaxdist.planner.tally import Tally
from jaxdist.planner.temporaries import gathered_layer_bytes
from jaxdist.planner.traffic import Traffic


def step_traffic(lay: Layout) -> list[Traffic]:
    """Every collective of one optimizer step (see the module docstring for where each comes from)."""
    t = Tally(lay)
    t.out += optimizer_traffic(lay)  # Muon's matrices moved whole (planner/optimizer_traffic.py)
    if lay.table is not None:  # 1f1b, 1f1b_paired, interleaved_1f1b: per slot of the table
        schedule_table_traffic(t)
        return t.out
    _layer_traffic(t)
    table_traffic(t)
    # One combined all-reduce of the step's scalar partial sums (each parameter array's squared-gradient
    # sum for the norm, the loss sums: 23 float32 for the 125m model's 11 arrays, read in its HLO).
    arrays = len(param_table(lay.cfg.model))
    t.add("fsdp", "all-reduce", "step scalars (gradient norm, loss sums)", 4 * (2 * arrays + 1), 1, n=lay.devices)
    if lay.cp > 1:
        t.out += context_traffic(lay, t.layer_steps)
    if lay.mesh["pp"] > 1:
        _pipeline_traffic(t)
    return t.out


def _layer_traffic(t: Tally) -> None:
    """Layers: fsdp weight gathers, gradient reduction, tp activation all-reduces. Expert weights apart."""
    lay, m, pp = t.lay, t.lay.cfg.model, t.mesh["pp"]
    experts = expert_layer_bytes(lay)
    layer = gathered_layer_bytes(lay) - experts  # every dense array's gradient is reduced
    # only what the fsdp all-gather splits moves (the default `norm` rule replicates the norm scales)
    moved = layer - gathered_per_layer(lay, lambda g: "expert" not in g.names and not lay.gathered(g))
    # Matrices are cast to the compute dtype on their shard, so they are gathered in it (bf16 on GPUs;
    # XLA:CPU computes bf16 in float32, act_bytes 4); their gradients are reduced in float32.
    gather = lay.act_bytes / PARAM_BYTES
    if t.frozen:  # the base gathered as stored (QLoRA: codes and scales), then de-quantised locally
        gather = lora.gathered_entry_bytes(lay) / PARAM_BYTES
    if pp == 1:
        # QLoRA without remat saves the de-quantised layer for the backward: gathered once
        passes_ = 1 if t.frozen and lay.cfg.lora.base_dtype in KINDS and m.remat == "none" else 2
        # Without remat the norms' explicitly gathered scales (parallel/matmul.gathered) are the backward's
        # residuals: gathered once, in the forward
        gathered_norm = lambda g: "norm" in g.path and lay.gathered(g)
        norms = gathered_per_layer(lay, gathered_norm) if m.remat == "none" and not t.frozen else 0
        # one all-gather per array (parallel/matmul.gathered: XLA combines none of them)
        arrays = _gathered_arrays(lay, lambda g: not norms or "norm" not in g.path)
        t.add(
            "fsdp",
            "all-gather",
            "layer weights (fwd + bwd)",
            (moved - norms) * gather,
            passes_ * t.layer_steps,
            n=lay.weight_shards,
            tensors=arrays,
        )
        if norms:
            arrays = _gathered_arrays(lay, gathered_norm)
            t.add(
                "fsdp",
                "all-gather",
                "layer norm scales (fwd)",
                norms * gather,
                t.layer_steps,
                n=lay.weight_shards,
                tensors=arrays,
            )
    else:
        _staged_layer_gathers(t, moved, gather)
    if t.frozen:
        _adapter_traffic(t)
    else:  # gradients are reduced where they are produced, inside the scans
        norms = gathered_per_layer(lay, lambda g: "norm" in g.path)  # float32 whatever reduce.dtype
        grads = (layer - norms) * t.grad_scale + norms
        t.reduce_grads("layer gradients", grads, t.layer_steps, t.layer_steps if t.every_pass else m.num_layers // pp)
    per_layer_tp = 7 + (2 if pp > 1 else int(m.remat == "full"))  # + the recomputed forward ones
    activations = lay.micro_batch * t.T * m.d_model * lay.act_bytes
    # launched as 2 forward and 2 backward collectives per layer (XLA combines the backward's input
    # gradients of q, k, v and of gate, up into one all-reduce each), + the recomputed forward ones
    launches = 4 + (2 if pp > 1 else int(m.remat == "full"))
    t.add(
        "tp",
        "all-reduce",
        "layer activations",
        per_layer_tp * activations,
        t.layer_steps,
        tensors=launches,
    )
    if experts:
        expert_traffic(lay, t.add, experts, t.layer_steps, implicit=t.every_pass)


def _gathered_arrays(lay: Layout, keep) -> int:
    """Arrays of one (dense) layer that `keep` selects and that the fsdp all-gather splits: each is its
    own all-gather per pass."""
    return sum(
        1
        for g in param_table(lay.cfg.model)
        if g.role == "layer" and "expert" not in g.names and lay.gathered(g) and keep(g)
    )


def _staged_layer_gathers(t: Tally, layer: float, gather: float) -> None:
    """pp > 1: the pipeline rematerialises each stage, so its backward gathers again for the recompute:
    the forward, the recompute, the gradient."""
    lay, m, pp = t.lay, t.lay.cfg.model, t.mesh["pp"]
    fwd, remat = t.layer_steps, layer
    if m.num_layers == pp * lay.repeats:
        # One layer per stage application: no layer scan, so (XLA:CPU's HLO) the recompute does
        # not re-gather w_down (its output is not needed), and under GPipe, where the stage's
        # weights are loop-invariant, the forward gather is hoisted out of the pipeline and
        # accumulation loops (once per step)
        remat -= w_down_layer_bytes(lay)
        fwd = m.num_layers // pp if lay.repeats == 1 else fwd
    t.add("fsdp", "all-gather", "layer weights (fwd)", layer * gather, fwd, n=lay.weight_shards)
    t.add("fsdp", "all-gather", "layer weights (recompute)", remat * gather, t.layer_steps, n=lay.weight_shards)
    t.add("fsdp", "all-gather", "layer weights (gradient)", layer * gather, t.layer_steps, n=lay.weight_shards)


def _adapter_traffic(t: Tally) -> None:
    """LoRA: only the adapters have gradients, one all-reduce over every batch axis per pass."""
    lay, m, pp = t.lay, t.lay.cfg.model, t.mesh["pp"]
    groups = [g for g in lora.adapter_groups(lay) if "expert" not in g.names]
    adapters = sum(g.size * PARAM_BYTES / lay.tp_shards(g) for g in groups)
    axis = "fsdp" if t.mesh["fsdp"] > 1 else "dp"
    t.add(axis, "all-reduce", "adapter gradients", adapters, t.passes, n=lay.batch_shards)
    # routed experts' adapters (DeepSeek-V3): added to the expert weights before the dispatch gathers
    # them (adapters/lora.expert_weights), so never gathered themselves; their gradients come from the
    # merged weight's, reduce-scattered over fsdp (as `expert gradients`): one with an embed dim is
    # computed on its shard, one without sums that dim over fsdp, all-reduced there (HLO of the
    # fixture at fsdp=4,ep=2: gate/up's B and down's A, per layer)
    experts = [g for g in lora.adapter_groups(lay) if "expert" in g.names and "embed" not in g.names]
    expert_bytes = sum(g.size * PARAM_BYTES / lay.tp_shards(g) for g in experts)
    t.add("fsdp", "all-reduce", "expert adapter gradients", expert_bytes, t.passes)
    # adapters sharded over fsdp (A of q/k/v/gate/up, B of o/down: an embed dim) are gathered in the
    # forward and again in the backward, per layer, in the compute dtype (HLO: f32[256,8] x 10)
    split = [g for g in groups if lay.shards(g) > lay.tp_shards(g) * (pp if pp > 1 else 1)]
    gathered = sum(g.size * lay.act_bytes / lay.tp_shards(g) for g in split) / m.num_layers
    t.add("fsdp", "all-gather", "adapters (fwd + bwd)", gathered, 2 * t.layer_steps, n=lay.weight_shards)


def _pipeline_traffic(t: Tally) -> None:
    lay, D = t.lay, t.lay.cfg.model.d_model
    stage = lay.micro_batch * t.T * D * lay.act_bytes
    t.add("pp", "collective-permute", "stage activations (fwd + bwd)", stage, 2 * t.passes * lay.pipe_iterations)
    whole = t.rows * D * lay.act_bytes
    t.add("pp", "collective-permute", "micro-batches into / out of the pipeline (fwd + bwd)", whole, 2 * t.passes)
    t.add("pp", "all-reduce", "pipeline output to every stage (fwd + bwd)", whole, 2 * t.passes)


def w_down_layer_bytes(lay: Layout) -> float:
    """One layer's dense MLP down projection after the fsdp all-gather (split by tp), float32."""
    return gathered_per_layer(lay, lambda g: g.path.startswith("blocks/mlp/w_down"))


def dropless_a2a_tiers(lay: Layout) -> dict | None:
    """Dropless MoE over ep: the step's all-to-all bytes per device at the worst tier (C = every local
    token, what step_traffic and the compiled program's byte count report: the HLO holds every tier's
    branch) and at the smallest tier, the one a balanced router runs (C = 1.25 N K / E:
    jaxdist.parallel.moe.DROPLESS_TIERS). None unless dropless MoE runs over ep > 1."""
    m, ep = lay.cfg.model, lay.mesh["ep"]
    if not m.moe_experts or ep == 1 or m.moe_dispatch != "dropless" or registry.of(m).dense_experts:
        return None
    tokens = lay.micro_batch * m.seq_len
    slots = dropless_tiers(tokens, m.moe_experts, m.moe_topk)
    worst = sum(t.bytes for t in step_traffic(lay) if t.axis == "ep" and t.kind == "all-to-all")
    return {
        "worst_slots": slots[-1],
        "worst_bytes": worst,
        "balanced_slots": slots[0],
        "balanced_bytes": worst * slots[0] / slots[-1],
    }
