"""Step time, MFU and throughput of one layout (`estimate`); candidate meshes: planner/candidates.py; the
recommendation and scaling curves: planner/recommend.py.

Step time (per optimizer step, every device in lock-step):
  compute   = hardware FLOPs per device / (peak x matmul efficiency), the attention's at the rate the
              entry measured for its query tile where it has one (attention_extra_s); hardware FLOPs add
              the recompute of the remat policy (full: +1 forward of the layers; the pipeline always
              rematerialises its stages) and the dropless experts' chunk padding (jaxdist.planner.work) to
              the model FLOPs of `jaxdist.models.flops.flops_per_token` (PaLM convention).
  bubble    = pipeline idle time: layer compute x (P-1)/(V M), i.e. a fraction (P-1)/(V M + P - 1) of the
              pipelined time (GPipe: (P-1)/(M+P-1); Huang et al. 2019). Table schedules (1f1b,
              1f1b_paired, interleaved_1f1b): the table's slots in lock-step, each costing the slowest
              action any stage runs in it (schedules.lockstep_time, a backward = 3 forwards: the
              recompute, then input and weight gradients; zb_h1's split backward: B = W = 2 forwards, each
              recomputing the chunk, so its extra recompute counts here), minus the layer compute.
  comm      = sum over collectives of bytes / link bandwidth + latency (jaxdist.planner.comms).
  work      = replicated work: the memory-bound bytes each device touches outside the matmuls (the
              training state's update over what the device stores, the gathered weights' reads), at the
              hardware's memory bandwidth (jaxdist.planner.work): what dp-replicated state costs every device.
  host      = offload's host<->device transfers at the hardware's host bandwidth (jaxdist.planner.transfers):
              the layer scan's fetches overlappable, the rest (update streaming, gradient round trip) exposed.
  no overlap: compute + work + bubble + comm + host.   overlap: max(compute, weight gathers + gradient reductions,
              the layer scan's host transfers) + activation collectives (tp, pp, embedding) + exposed host
              transfers + bubble + work — the scaling book's "hide the FSDP
              collectives behind the matmuls", which is compute-bound when tokens per device
              exceed about 2 C / W (C peak FLOP/s, W link bytes/s; 2 because weights move in float32).
MFU = model FLOPs / (devices x peak x step time).
"""

from __future__ import annotations

import dataclasses

from jaxdist.models import registry
from jaxdist.models.flops import flops_per_token
from jaxdist.parallel import schedules
from jaxdist.planner import comms, memory, transfers, work
from jaxdist.planner.layout import Layout, param_table
from jaxdist.planner.traffic import Traffic, by_axis, traffic_time


@dataclasses.dataclass(frozen=True)
class Estimate:
    layout: Layout
    family: str
    memory: memory.Memory
    traffic: tuple[Traffic, ...]
    compute_s: float
    bubble_s: float
    comm_s: float  # all collectives, serialised
    exposed_comm_s: float  # what overlap cannot hide
    host: transfers.HostTraffic  # offload's host<->device bytes and seconds
    step_s: float  # with overlap
    work_s: float  # replicated memory-bound work (jaxdist.planner.work), in step_s and step_no_overlap_s
    step_no_overlap_s: float
    mfu: float
    tokens_per_s: float

    @property
    def efficiency(self) -> float:
        """Fraction of the step doing model FLOPs at the achievable matmul rate (1.0 = compute-bound)."""
        return self.mfu / self.layout.hw.matmul_efficiency

    def as_dict(self) -> dict:
        lay = self.layout
        return {
            "mesh": lay.name,
            "family": self.family,
            "devices": lay.devices,
            "hardware": lay.hw.name,
            "global_batch": lay.cfg.train.global_batch,
            "grad_accum_steps": lay.accum,
            "pipeline_microbatches": lay.pipe_micro if lay.mesh["pp"] > 1 else 0,
            "pipeline_schedule": lay.cfg.pipeline.schedule if lay.mesh["pp"] > 1 else None,
            "pipeline_repeats": lay.repeats,
            "memory": self.memory.as_dict(),
            "communication": by_axis(lay, list(self.traffic)),
            "dropless_all_to_all": comms.dropless_a2a_tiers(lay),  # worst (reported) and balanced tiers
            "compute_s": self.compute_s,
            "bubble_s": self.bubble_s,
            "comm_s": self.comm_s,
            "exposed_comm_s": self.exposed_comm_s,
            "host_to_device_bytes": self.host.host_to_device,
            "device_to_host_bytes": self.host.device_to_host,
            "host_transfer_s": self.host.total_s,
            "host_exposed_s": self.host.exposed_s,
            "work_s": self.work_s,
            "step_s": self.step_s,
            "step_no_overlap_s": self.step_no_overlap_s,
            "mfu": self.mfu,
            "efficiency": self.efficiency,
            "tokens_per_s": self.tokens_per_s,
        }


def compute_flops(lay: Layout) -> tuple[float, float, float]:
    """(model FLOPs per step in all, hardware FLOPs per device for the layers, for the head). Layers split
    over every device; the head over dp, fsdp and tp only (each pp rank computes it, as in
    jaxdist.parallel.pipeline)."""
    m, mesh = lay.cfg.model, lay.mesh
    tokens = lay.cfg.train.global_batch * m.seq_len
    lora = lay.cfg.lora if lay.cfg.lora.rank else None  # frozen weights: 4 FLOPs per use, not 6
    model = flops_per_token(m, lora) * tokens
    head = (4 if lora else 6) * m.d_model * m.vocab_size * tokens
    counts = registry.of(m).count_params(m)  # MoE: the recompute runs the active parameters only
    layer_params = sum(g.size for g in param_table(m) if g.role == "layer") - (counts["total"] - counts["active"])
    recompute = m.remat == "full" or mesh["pp"] > 1
    layers = (model - head) + (2 * layer_params * tokens if recompute else 0)
    return (
        model,
        layers / lay.devices + work.padded_expert_flops(lay) + work.unchosen_expert_flops(lay),
        head / (mesh["dp"] * mesh["fsdp"] * mesh["ep"] * mesh["tp"] * lay.cp),
    )


def pipeline_bubble(lay: Layout, layer_s: float) -> float:
    """Seconds the pipelined layers idle, given their compute time `layer_s` (recompute included)."""
    if lay.mesh["pp"] == 1:
        return 0.0
    if lay.table is None:  # GPipe / circular: the layers take (V M + P - 1) / (V M) of their compute time
        return layer_s * (lay.mesh["pp"] - 1) / (lay.repeats * lay.pipe_micro)
    table, _ = lay.table
    # one chunk's forward f and backward 3 f (recompute 2, gradients 4 FLOPs per parameter and token,
    # forward 2): V M of each per stage make up layer_s
    f = layer_s / (4 * table.repeats * table.microbatches)
    if table.split_backward:  # B (input gradient) and W (weight gradient) each recompute the forward
        return schedules.lockstep_time(table, f, 2 * f, 2 * f) - layer_s
    return schedules.lockstep_time(table, f, 3 * f) - layer_s


def attention_extra_s(lay: Layout, rate: float) -> float:
    """Seconds the layers' attention takes beyond its FLOPs at the matmul `rate`, where the hardware entry
    measured attention (Hardware.attention_rates: materialised scores, plan --calibrate): the attention
    FLOPs per device at the rate measured for the query rows a sequence has on a device (seq_len / cp;
    ulysses attends the whole sequence on fewer heads), less the same FLOPs at `rate`; 0 where nothing was
    measured."""
    m = lay.cfg.model
    measured = lay.hw.attention_rate(m.seq_len if m.context_impl == "ulysses" else m.seq_len // lay.cp)
    if measured is None:
        return 0.0
    flops = registry.of(m).attention_flops(m) * lay.cfg.train.global_batch * m.seq_len / lay.devices
    return flops / measured - flops / rate


def estimate(lay: Layout, family: str = "") -> Estimate:
    lay.validate()
    hw = lay.hw
    peak = hw.flops(lay.compute_dtype)
    model_flops, layer_flops, head_flops = compute_flops(lay)
    rate = peak * hw.matmul_efficiency
    layer_s = layer_flops / rate + attention_extra_s(lay, rate)
    compute = layer_s + head_flops / rate
    bubble = pipeline_bubble(lay, layer_s)
    traffic = comms.step_traffic(lay)
    times = [(t, traffic_time(lay, t)) for t in traffic]
    comm = sum(s for _, s in times)
    hidden = sum(s for t, s in times if t.overlappable)
    exposed_serial = comm - hidden
    host = transfers.host_traffic(lay)
    work_s = work.work_seconds(lay)
    step = max(compute, hidden, host.hidden_s) + exposed_serial + host.exposed_s + bubble + work_s
    exposed = max(compute, hidden) - compute + exposed_serial  # collectives only: the host link is its own
    tokens = lay.cfg.train.global_batch * lay.cfg.model.seq_len
    return Estimate(
        layout=lay,
        family=family,
        memory=memory.estimate(lay),
        traffic=tuple(traffic),
        compute_s=compute,
        bubble_s=bubble,
        comm_s=comm,
        exposed_comm_s=exposed,
        host=host,
        step_s=step,
        work_s=work_s,
        step_no_overlap_s=compute + work_s + bubble + comm + host.total_s,
        mfu=model_flops / (lay.devices * peak * step),
        tokens_per_s=tokens / step,
    )
