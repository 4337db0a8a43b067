"""Communication of one training step: bytes per device, per mesh axis and collective, and its time.

Cost per collective (the JAX scaling book, "Sharded matrices" / "Training" chapters,
https://jax-ml.github.io/scaling-book/sharding/): over an axis of N devices with link bandwidth W
(bytes/s out of one device), an all-gather or reduce-scatter of an array of V bytes takes about V/W
(exactly (N-1)/N·V/W on a ring), an all-reduce 2V/W (a reduce-scatter plus an all-gather), an all-to-all
(N-1)/N·V/W at best, a collective-permute V/W. We add a latency alpha per collective (alpha-beta model).
Bytes here are those each device *sends*, the ring model of `jaxdist.hlo`, so predictions compare
directly with `hlo.summarize(hlo.collectives(compiled.as_text()))`.

What the compiler emits (read from jaxdist's compiled HLO on CPU; the SPMD partitioner is the same on
every backend):
- fsdp: each layer's float32 weights are all-gathered in the forward scan and again in the backward scan
  (2 gathers per layer per pass; with remat=full the recompute and the gradient share one backward
  gather in this model — XLA:CPU was seen to re-gather some weights a third time).
- gradients: per layer, inside the backward scan (so once per accumulation micro-batch unless
  reduce.method makes the dp reduction explicit). GPU/TPU: reduce-scatter over fsdp, then all-reduce of
  the shard over dp. **XLA:CPU emits an all-reduce over fsdp instead of the reduce-scatter** (then slices),
  twice the bytes; we model each backend as it compiles.
- tp (Megatron layout): per layer, all-reduce of the B·T·D activations after the attention and MLP output
  projections (2 forward); backward all-reduces the input gradient of each input projection separately
  (q, k, v and gate, up: 5); remat=full recomputes the attention all-reduce (+1).
- head (jaxdist.loss): naive — gathered over fsdp once per pass (the head of a tied table twice when
  tp > 1, observed), the input gradient all-reduced over tp; blockwise — every block gathered in the
  forward and again in the backward's recompute (in the compute dtype), the float32 input gradient and
  three per-token log-sum-exp statistics all-reduced over tp once. Its gradient is reduced like a layer's.
  The final norm is gathered twice per pass.
- embedding lookup (jaxdist.parallel.embedding): the int32 tokens all-gathered over fsdp, the looked-up
  rows all-reduced over tp (B·T·D float32), an all-to-all over fsdp forward and one backward; the
  table's gradient is local (no fsdp reduction), then all-reduced over dp.
- pp (jaxdist.parallel.pipeline): per pipeline iteration one collective-permute of the micro-batch's
  B·T·D activations forward and one backward; per pass one permute of the whole pass's activations each
  way and an all-reduce over pp handing the last stage's output to every rank (fwd + bwd). Stages are
  rematerialised, so stage weights are gathered three times per iteration (forward, recompute,
  gradient) and the forward tp all-reduces happen twice.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from jaxdist.planner.layout import PARAM_BYTES, Layout, param_table
from jaxdist.planner.memory import gathered_layer_bytes

OVERLAPPED = ("fsdp", "dp")  # weight gathers and gradient reductions can run behind compute


@dataclasses.dataclass(frozen=True)
class Traffic:
    axis: str  # the mesh axis the collective runs over
    kind: str  # all-gather | reduce-scatter | all-reduce | all-to-all | collective-permute
    what: str
    bytes: float  # sent per device per step (ring model)
    count: int  # executions per step

    @property
    def overlappable(self) -> bool:
        """Weight gathers and gradient reductions do not block the next matmul; activation collectives
        (tp all-reduces, pp permutes) sit on the critical path."""
        return self.axis in OVERLAPPED and self.kind != "all-to-all"


def ring_bytes(kind: str, n: int, full_bytes: float) -> float:
    """Bytes one device sends in a ring collective over n devices on an array of `full_bytes` (the
    gathered / unreduced size)."""
    if kind == "collective-permute":
        return full_bytes
    if n <= 1:
        return 0.0
    return (2.0 if kind == "all-reduce" else 1.0) * (n - 1) / n * full_bytes


def step_traffic(lay: Layout) -> list[Traffic]:
    """Every collective of one optimizer step (see the module docstring for where each comes from)."""
    m, mesh, cfg = lay.cfg.model, lay.mesh, lay.cfg
    fsdp, tp, pp = mesh["fsdp"], mesh["tp"], mesh["pp"]
    T, D = m.seq_len, m.d_model
    passes = lay.accum
    dp_syncs = passes if cfg.reduce.method == "implicit" else 1
    # Layer applications per device per step: each pipeline iteration runs L / (P V) layers.
    layer_steps = passes * (m.num_layers if pp == 1 else lay.pipe_iterations * m.num_layers // (pp * lay.repeats))
    layer_grads = layer_steps  # gradients are reduced where they are produced, inside the scans
    pass_batch = cfg.train.global_batch // (lay.batch_shards * passes)  # rows per device per pass
    out: list[Traffic] = []

    def add(axis, kind, what, full_bytes, count, n=None):
        n = mesh[axis] if n is None else n
        if n > 1 and count:
            out.append(Traffic(axis, kind, what, count * ring_bytes(kind, n, full_bytes), count))

    def reduce_grads(what, full_bytes, count_fsdp, count_dp):
        if lay.hw.backend == "cpu":
            add("fsdp", "all-reduce", what, full_bytes, count_fsdp)
        else:
            add("fsdp", "reduce-scatter", what, full_bytes, count_fsdp)
        add("dp", "all-reduce", what, full_bytes / fsdp, count_dp)

    # Layers: fsdp weight gathers, gradient reduction, tp activation all-reduces.
    layer = gathered_layer_bytes(lay)
    # The pipeline rematerialises each stage: its backward gathers again for the recompute.
    add("fsdp", "all-gather", "layer weights (fwd + bwd)", layer, (3 if pp > 1 else 2) * layer_steps)
    reduce_grads("layer gradients", layer, layer_grads, layer_grads if dp_syncs == passes else m.num_layers // pp)
    per_layer_tp = 7 + (2 if pp > 1 else int(m.remat == "full"))  # + the recomputed forward ones
    add("tp", "all-reduce", "layer activations", lay.micro_batch * T * D * lay.act_bytes, per_layer_tp * layer_steps)

    # Embedding lookup, head, final norm: once per pass, on every pp rank. A tied table serves two uses,
    # each gathered and with its gradient reduced separately (as compiled).
    tables = {g.role: g for g in param_table(m) if g.role != "layer"}
    rows = pass_batch * T
    head = tables["embed" if m.tie_embeddings else "head"]
    head_full = head.size * PARAM_BYTES / lay.tp_shards(head)  # after the fsdp gather
    if m.loss_impl == "naive":
        gathers = 2 if m.tie_embeddings and tp > 1 else 1
        add("fsdp", "all-gather", "head weights", head_full, gathers * passes)
        add("tp", "all-reduce", "head input gradient", rows * D * lay.act_bytes, passes)
    else:  # jaxdist.loss: every block gathered forward and again for the backward's recompute
        add("fsdp", "all-gather", "head weight blocks (fwd + bwd)", head_full * lay.act_bytes / PARAM_BYTES,
            2 * passes)
        add("tp", "all-reduce", "head input gradient (float32)", rows * D * PARAM_BYTES, passes)
        add("tp", "all-reduce", "log-sum-exp statistics", rows * 3 * PARAM_BYTES, passes)
    reduce_grads("head gradient", head_full, passes, dp_syncs)
    norm = tables["norm"]
    add("fsdp", "all-gather", "final norm weights", norm.size * PARAM_BYTES, 2 * passes)
    reduce_grads("final norm gradient", norm.size * PARAM_BYTES, passes, dp_syncs)
    # Embedding lookup (jaxdist.parallel.embedding): tokens gathered over fsdp, rows summed over tp,
    # then an all-to-all over fsdp (and its transpose in the backward); the table's gradient stays local.
    table = tables["embed"]
    add("fsdp", "all-gather", "embedding lookup tokens (int32)", rows * fsdp * 4, passes)
    add("tp", "all-reduce", "embedding lookup rows (vocab-sharded)", rows * D * PARAM_BYTES, passes)
    add("fsdp", "all-to-all", "embedding rows to their tokens (fwd + bwd)", rows * D * lay.act_bytes, 2 * passes)
    add("dp", "all-reduce", "embedding gradient", table.size * PARAM_BYTES / lay.shards(table), dp_syncs)

    if pp > 1:
        iters = passes * lay.pipe_iterations
        add("pp", "collective-permute", "stage activations (fwd + bwd)",
            lay.micro_batch * T * D * lay.act_bytes, 2 * iters)
        add("pp", "collective-permute", "micro-batches into / out of the pipeline (fwd + bwd)",
            rows * D * lay.act_bytes, 2 * passes)
        add("pp", "all-reduce", "pipeline output to every stage (fwd + bwd)", rows * D * lay.act_bytes, 2 * passes)
    return out


def link_bandwidth(lay: Layout, axis: str) -> float:
    """Fast links if the axis's device groups stay inside one node / slice, else the slow network.
    Axes are laid out dp, pp, fsdp, tp from slowest to fastest (jaxdist.mesh), so an axis's group spans
    its size times the sizes of the faster axes."""
    order = ("dp", "pp", "fsdp", "tp")
    span = lay.mesh[axis]
    for inner in order[order.index(axis) + 1:]:
        span *= lay.mesh[inner]
    return lay.hw.fast_bandwidth if span <= lay.hw.devices_per_node else lay.hw.slow_bandwidth


def traffic_time(lay: Layout, t: Traffic) -> float:
    return t.bytes / link_bandwidth(lay, t.axis) + t.count * lay.hw.latency_s


def by_kind(traffic: list[Traffic]) -> dict[str, float]:
    """{kind: bytes sent per device per step}, comparable with hlo.summarize(...)[kind]['bytes']."""
    out: dict[str, float] = defaultdict(float)
    for t in traffic:
        out[t.kind] += t.bytes
    return dict(out)


def by_axis(lay: Layout, traffic: list[Traffic]) -> dict[str, dict]:
    """{axis: {kind: {'bytes', 'count', 'seconds'}}}."""
    out: dict[str, dict] = {}
    for t in traffic:
        row = out.setdefault(t.axis, {}).setdefault(t.kind, {"bytes": 0.0, "count": 0, "seconds": 0.0})
        row["bytes"] += t.bytes
        row["count"] += t.count
        row["seconds"] += traffic_time(lay, t)
    return out
