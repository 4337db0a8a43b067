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
  forward and again in the backward (in the compute dtype; model.loss_gather_mib of blocks per
  collective), the float32 input gradient and
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
  for them: the batch is split over dp, fsdp and ep).
- pp (jaxdist.parallel.pipeline): per pipeline iteration one collective-permute of the micro-batch's
  B·T·D activations forward and one backward; per pass one permute of the whole pass's activations each
  way and an all-reduce over pp handing the last stage's output to every rank (fwd + bwd). Stages are
  rematerialised, so stage weights are gathered three times per iteration (forward, recompute,
  gradient) and the forward tp all-reduces happen twice. With one layer per stage application (no layer
  scan) the recompute skips w_down, and GPipe's forward gather is hoisted out of the loops (once a step).
  Table schedules (1f1b, 1f1b_paired, interleaved_1f1b) are counted per slot of their table instead,
  each lane at its largest branch (_schedule_table_traffic).
- cp (jaxdist.parallel.context), per layer: allgather all-gathers K and V of the whole sequence forward
  and reduce-scatters their gradients backward; ring sends 2(cp-1) K/V blocks (B·T/cp·K·H) forward and,
  backward, 2(cp-1) again plus 2cp float32 dK/dV blocks travelling home; ulysses all-to-alls q, k, v and
  the output each way. Weights are replicated over cp (unless mesh.rules.embed adds it), so gradients
  are reduced over fsdp x cp together: one all-reduce over that group on CPU. Activations (tp
  all-reduces, embedding) are per device, so they divide by cp.
"""

from __future__ import annotations

from jaxdist.adapters.quant import KINDS
from jaxdist.distributed.hlo import ring_bytes
from jaxdist.parallel.loss import block_rows
from jaxdist.parallel.moe import dropless_tiers
from jaxdist.planner import lora
from jaxdist.planner.context_traffic import context_traffic
from jaxdist.planner.expert_traffic import expert_layer_bytes, expert_traffic
from jaxdist.planner.layout import PARAM_BYTES, Layout, param_table
from jaxdist.planner.optimizer_traffic import optimizer_traffic
from jaxdist.planner.state_memory import gathered_per_layer
from jaxdist.planner.temporaries import gathered_layer_bytes, loss_plan
from jaxdist.planner.traffic import Traffic
from jaxdist.reduce import registry


def step_traffic(lay: Layout) -> list[Traffic]:
    """Every collective of one optimizer step (see the module docstring for where each comes from)."""
    t = _Tally(lay)
    t.out += optimizer_traffic(lay)  # Muon's matrices moved whole (planner/optimizer_traffic.py)
    if lay.table is not None:  # 1f1b, 1f1b_paired, interleaved_1f1b: per slot of the table
        _schedule_table_traffic(t)
        return t.out
    _layer_traffic(t)
    _table_traffic(t)
    # One combined all-reduce of the step's scalar partial sums (each parameter array's squared-gradient
    # sum for the norm, the loss sums: 23 float32 for the 125m model's 11 arrays, read in its HLO).
    arrays = len(param_table(lay.cfg.model))
    t.add("fsdp", "all-reduce", "step scalars (gradient norm, loss sums)", 4 * (2 * arrays + 1), 1, n=lay.devices)
    if lay.cp > 1:
        t.out += context_traffic(lay, t.layer_steps)
    if lay.mesh["pp"] > 1:
        _pipeline_traffic(t)
    return t.out


class _Tally:
    """One step's collectives as they are added up, and the counts every term uses."""

    def __init__(self, lay: Layout):
        m, self.lay, self.mesh, self.out = lay.cfg.model, lay, lay.mesh, []
        pp, self.passes = self.mesh["pp"], lay.accum
        self.T = m.seq_len // lay.cp  # tokens of a sequence on one device
        implicit = not registry.method(lay.cfg).per_replica  # XLA reduces the gradients every pass
        self.dp_syncs = self.passes if implicit else 1
        self.every_pass = self.dp_syncs == self.passes  # dp reductions inside the accumulation loop
        # Layer applications per device per step: each pipeline iteration runs L / (P V) layers.
        per_pass = m.num_layers if pp == 1 else lay.pipe_iterations * m.num_layers // (pp * lay.repeats)
        self.layer_steps = self.passes * per_pass
        pass_batch = lay.cfg.train.global_batch // (lay.batch_shards * self.passes)  # rows per device per pass
        self.rows = pass_batch * self.T
        self.frozen = lora.enabled(lay)  # LoRA: only the adapters have gradients
        # reduce.dtype=bfloat16 on the implicit path halves the matrices' gradient reductions under bf16
        # compute; XLA:CPU's all-reduce promotion pass runs them in float32 again (read in its HLO)
        bf16 = lay.cfg.reduce.dtype == "bfloat16" and lay.compute_dtype == "bfloat16" and lay.hw.backend != "cpu"
        self.grad_scale = 0.5 if implicit and bf16 else 1.0

    def add(self, axis, kind, what, full_bytes, count, n=None, tensors=1):
        """`count` times a collective over `full_bytes` in all, launched as `tensors` collectives each
        time (one per array: the launches a GPU pays latency for), over `n` devices (the axis's size)."""
        n = self.mesh[axis] if n is None else n
        if n > 1 and count:
            self.out.append(Traffic(axis, kind, what, count * ring_bytes(kind, n, full_bytes), count * tensors, n))

    def reduce_grads(self, what, full_bytes, count_fsdp, count_dp, tensors=1):
        """Gradients are reduced over every axis that splits tokens, fsdp x cp (labelled fsdp, as the
        weights gathered over mesh.rules.embed: the ZeRO traffic that overlaps compute; its link spans
        fsdp x cp x tp devices, see link_bandwidth), then ep, then dp."""
        lay, ep, group = self.lay, self.mesh["ep"], self.mesh["fsdp"] * self.lay.cp
        if lay.hw.backend == "cpu":  # one all-reduce over the batch group (fsdp x cp, and ep)
            self.add(
                "fsdp" if ep == 1 else "ep", "all-reduce", what, full_bytes, count_fsdp, n=group * ep, tensors=tensors
            )
        else:
            self.add("fsdp", "reduce-scatter", what, full_bytes, count_fsdp, n=group, tensors=tensors)
            self.add("ep", "all-reduce", what, full_bytes / group, count_fsdp, tensors=tensors)
        self.add("dp", "all-reduce", what, full_bytes / lay.weight_shards, count_dp, tensors=tensors)


def _layer_traffic(t: _Tally) -> None:
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


def _staged_layer_gathers(t: _Tally, layer: float, gather: float) -> None:
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


def _adapter_traffic(t: _Tally) -> None:
    """LoRA: only the adapters have gradients, one all-reduce over every batch axis per pass."""
    lay, m, pp = t.lay, t.lay.cfg.model, t.mesh["pp"]
    adapters = sum(g.size * PARAM_BYTES / lay.tp_shards(g) for g in lora.adapter_groups(lay))
    axis = "fsdp" if t.mesh["fsdp"] > 1 else "dp"
    t.add(axis, "all-reduce", "adapter gradients", adapters, t.passes, n=lay.batch_shards)
    # adapters sharded over fsdp (A of q/k/v/gate/up, B of o/down: an embed dim) are gathered in the
    # forward and again in the backward, per layer, in the compute dtype (HLO: f32[256,8] x 10)
    split = [g for g in lora.adapter_groups(lay) if lay.shards(g) > lay.tp_shards(g) * (pp if pp > 1 else 1)]
    gathered = sum(g.size * lay.act_bytes / lay.tp_shards(g) for g in split) / m.num_layers
    t.add("fsdp", "all-gather", "adapters (fwd + bwd)", gathered, 2 * t.layer_steps, n=lay.weight_shards)


def _table_traffic(t: _Tally) -> None:
    """Embedding lookup, head, final norm: once per pass, on every pp rank. A tied table serves two
    uses, each gathered and with its gradient reduced separately (as compiled)."""
    lay, m, passes, rows = t.lay, t.lay.cfg.model, t.passes, t.rows
    D, tp = m.d_model, t.mesh["tp"]
    tables, head_full = _tables(lay)
    # A gather of a loop-invariant weight (not sliced by a block index) is hoisted out of the
    # accumulation loop (XLA:CPU's HLO): the final norm, the naive head and a one-block head, once a step.
    one_block = m.vocab_size // tp == block_rows(m.vocab_size, tp, rows, D, m.loss_block)
    head_passes = 1 if m.loss_impl == "naive" or one_block else passes
    if m.loss_impl == "naive":
        gathers = 2 if m.tie_embeddings and tp > 1 else 1
        t.add("fsdp", "all-gather", "head weights", head_full, gathers * head_passes, n=lay.weight_shards)
        t.add("tp", "all-reduce", "head input gradient", rows * D * lay.act_bytes, passes)
    else:  # jaxdist.parallel.loss: every chunk of blocks gathered forward and again for the backward
        blocks = head_full * lay.act_bytes / PARAM_BYTES
        rows_per_block = block_rows(m.vocab_size, tp, rows, D, m.loss_block)
        nb = m.vocab_size // (tp * rows_per_block)
        chunks = nb // loss_plan(lay, rows, rows_per_block).chunk
        t.add(
            "fsdp",
            "all-gather",
            "head weight chunks (fwd + bwd)",
            blocks,
            2 * head_passes,
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


def _embedding_traffic(t: _Tally, table) -> None:
    """The lookup (jaxdist.parallel.embedding): tokens gathered over fsdp, rows summed over tp, then an
    all-to-all over fsdp (and its transpose in the backward); the table's gradient stays local."""
    lay, passes, rows, D = t.lay, t.passes, t.rows, t.lay.cfg.model.d_model
    t.add("fsdp", "all-gather", "embedding lookup tokens (int32)", rows * t.mesh["fsdp"] * 4, passes)
    t.add("tp", "all-reduce", "embedding lookup rows (vocab-sharded)", rows * D * PARAM_BYTES, passes)
    a2a = 1 if t.frozen else 2  # a frozen table (LoRA) sends no gradient back
    t.add("fsdp", "all-to-all", "embedding rows to their tokens (fwd + bwd)", rows * D * lay.act_bytes, a2a * passes)
    table_shard = _table_shard(lay, table)
    if not t.frozen:
        t.add("dp", "all-reduce", "embedding gradient", table_shard, t.dp_syncs)
    # The lookup's shard_map is manual over the token axes too: ep and cp split the tokens, not the
    # table, so the table's local gradient is summed over each of them (a psum, once per pass).
    t.add("ep", "all-reduce", "embedding gradient (tokens split over ep)", table_shard, passes)
    t.add("cp", "all-reduce", "embedding gradient (sequence split over cp)", table_shard, passes)
    # The loss flattens (batch, seq) into rows; with seq split over cp that re-shards the rows: one
    # all-to-all of the final hidden states forward and one of their gradient backward.
    t.add("cp", "all-to-all", "loss rows: (batch, seq) flattened (fwd + bwd)", rows * D * lay.act_bytes, 2 * passes)


def _pipeline_traffic(t: _Tally) -> None:
    lay, D = t.lay, t.lay.cfg.model.d_model
    stage = lay.micro_batch * t.T * D * lay.act_bytes
    t.add("pp", "collective-permute", "stage activations (fwd + bwd)", stage, 2 * t.passes * lay.pipe_iterations)
    whole = t.rows * D * lay.act_bytes
    t.add("pp", "collective-permute", "micro-batches into / out of the pipeline (fwd + bwd)", whole, 2 * t.passes)
    t.add("pp", "all-reduce", "pipeline output to every stage (fwd + bwd)", whole, 2 * t.passes)


def _schedule_table_traffic(t: _Tally) -> None:
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
    tables, head_full = _tables(lay)
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
    t.add("dp", "all-reduce", "embedding gradient", _table_shard(lay, tables["embed"]), t.dp_syncs)


def _tables(lay: Layout) -> tuple[dict, float]:
    """{role: group} of the embedding, head and final norm, and the head's (the embedding's, when tied)
    float32 bytes after the fsdp gather (split by tp)."""
    m = lay.cfg.model
    tables = {g.role: g for g in param_table(m) if g.role != "layer"}
    head = tables["embed" if m.tie_embeddings else "head"]
    return tables, head.size * PARAM_BYTES / lay.tp_shards(head)


def _table_shard(lay: Layout, table) -> float:
    """The embedding table's float32 bytes on one device (its gradient, which the lookup keeps local)."""
    return table.size * PARAM_BYTES / lay.shards(table)


def w_down_layer_bytes(lay: Layout) -> float:
    """One layer's dense MLP down projection after the fsdp all-gather (split by tp), float32."""
    return gathered_per_layer(lay, lambda g: g.path.startswith("blocks/mlp/w_down"))


def dropless_a2a_tiers(lay: Layout) -> dict | None:
    """Dropless MoE over ep: the step's all-to-all bytes per device at the worst tier (C = every local
    token, what step_traffic and the compiled program's byte count report: the HLO holds every tier's
    branch) and at the smallest tier, the one a balanced router runs (C = 1.25 N K / E:
    jaxdist.parallel.moe.DROPLESS_TIERS). None unless dropless MoE runs over ep > 1."""
    m, ep = lay.cfg.model, lay.mesh["ep"]
    if not m.moe_experts or ep == 1 or m.moe_dispatch != "dropless":
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
