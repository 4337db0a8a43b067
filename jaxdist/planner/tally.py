"""One step's collectives as the planner's communication model adds them up (`Tally.add`, costed by the
one ring model, `jaxdist.distributed.hlo.ring_bytes`), the gradients' reduction over the batch axes, and
the per-step counts every term uses (passes, layer applications, rows per device)."""

from __future__ import annotations

from jaxdist.distributed.hlo import ring_bytes
from jaxdist.planner import lora
from jaxdist.planner.layout import Layout
from jaxdist.planner.traffic import Traffic
from jaxdist.reduce import registry


class Tally:
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
