"""Step time, MFU and throughput of a layout; candidate meshes; scaling curves; the recommendation.

Step time (per optimizer step, every device in lock-step):
  compute   = hardware FLOPs per device / (peak x matmul efficiency); hardware FLOPs add the recompute of
              the remat policy (full: +1 forward of the layers; the pipeline always rematerialises
              its stages) to the model FLOPs of `jaxdist.models.flops.flops_per_token` (PaLM convention).
  bubble    = pipeline idle time: layer compute x (P-1)/(V M), i.e. a fraction (P-1)/(V M + P - 1) of the
              pipelined time (GPipe: (P-1)/(M+P-1); Huang et al. 2019). Table schedules (1f1b,
              1f1b_paired, interleaved_1f1b): the table's slots in lock-step, each costing the slowest
              action any stage runs in it (schedules.lockstep_time, a backward = 3 forwards: the
              recompute, then input and weight gradients; zb_h1's split backward: B = W = 2 forwards, each
              recomputing the chunk, so its extra recompute counts here), minus the layer compute.
  comm      = sum over collectives of bytes / link bandwidth + latency (jaxdist.planner.comms).
  host      = offload's host<->device transfers at the hardware's host bandwidth (jaxdist.planner.transfers):
              the layer scan's fetches overlappable, the rest (update streaming, gradient round trip) exposed.
  no overlap: compute + bubble + comm + host.   overlap: max(compute, weight gathers + gradient reductions,
              the layer scan's host transfers) + activation collectives (tp, pp, embedding) + exposed host
              transfers + bubble — the scaling book's "hide the FSDP
              collectives behind the matmuls", which is compute-bound when tokens per device
              exceed about 2 C / W (C peak FLOP/s, W link bytes/s; 2 because weights move in float32).
MFU = model FLOPs / (devices x peak x step time).
"""

from __future__ import annotations

import dataclasses
import math

from jaxdist.config import Config
from jaxdist.distributed.mesh import AXES
from jaxdist.errors import JaxdistError
from jaxdist.models import registry
from jaxdist.models.flops import flops_per_token
from jaxdist.parallel import schedule_registry, schedules
from jaxdist.planner import comms, memory, transfers
from jaxdist.planner.hardware import Hardware
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
    return model, layers / lay.devices, head / (mesh["dp"] * mesh["fsdp"] * mesh["ep"] * mesh["tp"] * lay.cp)


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


def estimate(lay: Layout, family: str = "") -> Estimate:
    lay.validate()
    hw = lay.hw
    peak = hw.flops(lay.compute_dtype)
    model_flops, layer_flops, head_flops = compute_flops(lay)
    rate = peak * hw.matmul_efficiency
    compute = (layer_flops + head_flops) / rate
    bubble = pipeline_bubble(lay, layer_flops / rate)
    traffic = comms.step_traffic(lay)
    times = [(t, traffic_time(lay, t)) for t in traffic]
    comm = sum(s for _, s in times)
    hidden = sum(s for t, s in times if t.overlappable)
    exposed_serial = comm - hidden
    host = transfers.host_traffic(lay)
    step = max(compute, hidden, host.hidden_s) + exposed_serial + host.exposed_s + bubble
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
        step_no_overlap_s=compute + bubble + comm + host.total_s,
        mfu=model_flops / (lay.devices * peak * step),
        tokens_per_s=tokens / step,
    )


def _powers_of_two(limit: int, start: int = 1) -> list[int]:
    out, n = [], start
    while n <= limit:
        out.append(n)
        n *= 2
    return out


def candidate_meshes(cfg: Config, devices: int, hw: Hardware) -> list[tuple[str, dict[str, int]]]:
    """The usual families: DP, FSDP, HSDP (fsdp inside a node or slice, dp across), TP x FSDP (tp inside a
    node), PP x FSDP, PP x TP x FSDP, and CP x FSDP (cp inside a node: the sequence split over devices,
    what fits when one sequence's activations do not). Sizes are powers of two that divide the device
    count."""
    node = min(hw.devices_per_node, devices)
    tps = [t for t in _powers_of_two(min(8, node), 2) if devices % t == 0]
    pps = [p for p in _powers_of_two(min(16, devices), 2) if devices % p == 0 and cfg.model.num_layers % p == 0]
    out = [("DP", dict(dp=devices)), ("FSDP", dict(fsdp=devices))]
    out += [
        ("HSDP", dict(dp=devices // f, fsdp=f))
        for f in _powers_of_two(devices // 2, 2)
        if devices % f == 0 and f >= node // 2
    ]
    out += [("TPxFSDP", dict(tp=t, fsdp=devices // t)) for t in tps]
    out += [("PPxFSDP", dict(pp=p, fsdp=devices // p)) for p in pps if devices // p > 1]
    out += [
        ("PPxTPxFSDP", dict(pp=p, tp=t, fsdp=devices // (p * t))) for p in pps for t in tps if devices % (p * t) == 0
    ]
    out += [
        ("CPxFSDP", dict(cp=c, fsdp=devices // c))
        for c in _powers_of_two(node, 2)
        if devices % c == 0 and cfg.model.seq_len % (2 * c) == 0 and not cfg.model.sliding_window
    ]
    if cfg.model.moe_experts:  # expert parallelism: experts over ep (inside a node), fsdp or tp beside it
        eps = [
            e
            for e in _powers_of_two(min(cfg.model.moe_experts, node), 2)
            if devices % e == 0 and cfg.model.moe_experts % e == 0
        ]
        out = [(n, m) for n, m in out if not m.get("pp")]  # MoE runs without a pipeline (parallel/moe.py)
        out += [("EP", dict(ep=e, dp=devices // e)) for e in eps]
        out += [("EPxFSDP", dict(ep=e, fsdp=devices // e)) for e in eps if devices // e > 1]
        out += [
            ("EPxTPxFSDP", dict(ep=e, tp=t, fsdp=devices // (e * t)))
            for e in eps
            for t in tps
            if devices % (e * t) == 0 and e * t <= node
        ]
    if devices == 1:
        out = [("single", {})]
    full = lambda m: {a: m.get(a, 1) for a in AXES}
    return [(name, full(m)) for name, m in out]


def with_batch(
    cfg: Config, global_batch: int | None = None, accum: int | None = None, pipe_micro: int | None = None
) -> Config:
    """`cfg` with other batch settings (no re-validation: Layout.validate checks what the planner needs)."""
    train = dataclasses.replace(
        cfg.train,
        global_batch=global_batch or cfg.train.global_batch,
        grad_accum_steps=accum or cfg.train.grad_accum_steps,
    )
    pipeline = cfg.pipeline if pipe_micro is None else dataclasses.replace(cfg.pipeline, microbatches=pipe_micro)
    return dataclasses.replace(cfg, train=train, pipeline=pipeline)


def best_for_mesh(cfg: Config, mesh: dict[str, int], hw: Hardware, family: str) -> Estimate | None:
    """The smallest gradient accumulation (power of two) that fits — more only repeats the collectives —
    with the fastest number of pipeline micro-batches; if nothing fits, the setting needing the least
    memory. None if the mesh cannot run this model and batch at all."""
    found = []
    local = cfg.train.global_batch // max(1, math.prod(mesh[a] for a in ("dp", "fsdp", "ep")))
    pipe = _powers_of_two(max(local, 1), mesh["pp"]) if mesh["pp"] > 1 else [0]
    for accum in _powers_of_two(max(local, 1)):
        trials = []
        for pm in pipe:
            try:
                trials.append(estimate(Layout(with_batch(cfg, accum=accum, pipe_micro=pm), mesh, hw), family))
            except JaxdistError:
                continue
        fitting = [e for e in trials if e.memory.fits]
        if fitting:
            return min(fitting, key=lambda e: e.step_s)
        found += trials
    return min(found, key=lambda e: e.memory.total) if found else None


def with_cp_weights(cfg: Config) -> Config:
    """Weights sharded over cp as well as fsdp (mesh.rules.embed=[fsdp, cp]) unless the config says
    otherwise: context parallelism splits activations, and this keeps every non-tp device holding a
    slice of the weights, as FSDP does."""
    if "embed" in cfg.mesh.rules:
        return cfg
    rules = {**cfg.mesh.rules, "embed": ["fsdp", "cp"]}
    return dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, rules=rules))


def architecture_takes(cfg: Config, mesh: dict) -> bool:
    """False for a mesh the model's architecture refuses (its registry entry's `check`: Gemma 3 on pp)."""
    try:
        registry.of(cfg.model).check(cfg, mesh)
    except JaxdistError:
        return False
    return True


def schedule_variants(cfg: Config, mesh: dict[str, int]) -> list[Config]:
    """With pp > 1, `cfg` under every schedule of the registry (parallel/schedule_registry.py), each sized
    by its own model: the scan schedules' bubble and stacked activations, the table schedules' slots and
    buffers (Layout.table). A schedule with virtual chunks gets pipeline.repeats (2 where the config says
    1: one chunk per stage is its non-virtual twin). What a schedule refuses, Layout.validate refuses."""
    if mesh["pp"] == 1:
        return [cfg]
    out = []
    for entry in schedule_registry.SCHEDULES.values():
        repeats = max(2, cfg.pipeline.repeats) if entry.virtual else 1
        pipeline = dataclasses.replace(cfg.pipeline, schedule=entry.name, repeats=repeats)
        out.append(dataclasses.replace(cfg, pipeline=pipeline))
    return out


def candidates(cfg: Config, devices: int, hw: Hardware) -> list[Estimate]:
    """Best setting of every candidate mesh and, on pp meshes, of every pipeline schedule: fitting ones
    fastest first, then the rest by memory."""
    out = [
        e
        for name, mesh in candidate_meshes(cfg, devices, hw)
        if architecture_takes(cfg, mesh)
        for variant in schedule_variants(with_cp_weights(cfg) if mesh["cp"] > 1 else cfg, mesh)
        if (e := best_for_mesh(variant, mesh, hw, name))
    ]
    return sorted(out, key=lambda e: (not e.memory.fits, e.step_s if e.memory.fits else e.memory.total))


# Step times closer than this are a tie: the model's seconds are a roofline (compute at the hardware
# table's peak x matmul efficiency, collectives at link bandwidth), not a measurement, so a 2% edge is
# not worth less memory headroom.
TIE = 0.02


def break_ties(fitting: list[Estimate]) -> list[Estimate]:
    """`fitting` (fastest first) with the candidates tied with the fastest reordered by memory headroom."""
    tied = [e for e in fitting if e.step_s <= fitting[0].step_s * (1 + TIE)]
    return sorted(tied, key=lambda e: e.memory.total) + fitting[len(tied) :]


def schedule_reason(best: Estimate, ests: list[Estimate]) -> str:
    """On a pp mesh: the recommended schedule, its activations and bubble (from its table for a table
    schedule: the stage inputs it keeps, whatever M is), against every other schedule sized on that mesh."""
    lay = best.layout
    if lay.mesh["pp"] == 1:
        return ""
    kept = (
        f"its table keeps {lay.table[1].x_size} stage inputs per stage whatever M is"
        if lay.table is not None
        else f"its scan keeps the stage inputs of all {lay.pipe_iterations} iterations"
    )
    text = (
        f"; schedule {lay.schedule} at M={lay.pipe_micro}: {best.memory.activations / 1e9:.3g} GB of activations "
        f"({kept}), bubble {best.bubble_s / best.step_s:.1%} of the step"
    )
    others = []
    for e in ests:
        if e is best or e.layout.mesh != lay.mesh:
            continue
        if not e.memory.fits:
            verdict = f"does not fit ({e.memory.total / 1e9:.3g} GB)"
        elif e.layout.accum > lay.accum:
            verdict = f"fits only at accumulation {e.layout.accum}, {e.step_s / best.step_s - 1:+.0%} step time"
        else:
            verdict = f"{e.step_s / best.step_s - 1:+.0%} step time"
        others.append(
            f"{e.layout.schedule} {verdict} (accumulation {e.layout.accum}, M={e.layout.pipe_micro}: "
            f"{e.memory.activations / 1e9:.3g} GB of activations)"
        )
    return text + (f"; on this mesh {'; '.join(others)}" if others else "")


def recommend(ests: list[Estimate]) -> tuple[Estimate | None, str]:
    """The fastest fitting candidate (of those within TIE of the fastest, the one with the most memory
    headroom) and a one-paragraph reason."""
    fitting = [e for e in ests if e.memory.fits]
    if not fitting:
        least = min(ests, key=lambda e: e.memory.total) if ests else None
        need = f" (the smallest needs {least.memory.total / 1e9:.0f} GB per device)" if least else ""
        return None, f"nothing fits{need}: add devices, use a larger-memory accelerator, or lower the batch"
    ties = sum(e.step_s <= fitting[0].step_s * (1 + TIE) for e in fitting)
    fitting = break_ties(fitting)
    best = fitting[0]
    lay = best.layout
    hw = lay.hw
    tokens_dev = lay.cfg.train.global_batch * lay.cfg.model.seq_len / lay.devices
    slowest = max(best.traffic, key=lambda t: traffic_time(lay, t), default=None)
    reason = (
        f"{best.family} {lay.name} (accumulation {lay.accum}"
        + (f", {lay.pipe_micro} pipeline micro-batches, schedule {lay.schedule}" if lay.mesh["pp"] > 1 else "")
        + f") {f'ties for the fastest ({ties} within {TIE:.0%})' if ties > 1 else 'is the fastest'} of "
        f"{len(fitting)} fitting candidates: {best.step_s:.3g} s/step, "
        f"MFU {best.mfu:.0%}, {best.memory.total / 1e9:.1f} of {best.memory.capacity / 1e9:.0f} GB usable"
    )
    if ties > 1:
        reason += f"; of the tied, it leaves the most memory free (the model's step times are not exact to {TIE:.0%})"
    if lay.cp > 1:
        reason += (
            f"; the sequence is split over cp={lay.cp} (model.context_impl={lay.cfg.model.context_impl}, "
            f"mesh.rules.embed={list(lay.rules['embed'])})"
        )
    if slowest:
        reason += (
            f"; slowest collective: {slowest.kind} of {slowest.what} over {slowest.axis} "
            f"({traffic_time(lay, slowest):.3g} s, {'overlappable with' if slowest.overlappable else 'added to'}"
            f" compute)"
        )
    hidden = sum(traffic_time(lay, t) for t in best.traffic if t.overlappable)
    bound = "compute-bound" if best.compute_s >= hidden else "communication-bound"
    reason += (
        f". Compute {best.compute_s:.3g} s vs {hidden:.3g} s of weight gathers and gradient reductions "
        f"that overlap it: {bound} ({tokens_dev:.0f} tokens per device per step; the scaling book's "
        f"FSDP threshold 2C/W is {2 * hw.flops(lay.compute_dtype) / hw.slow_bandwidth:.0f} tokens across "
        f"nodes, {2 * hw.flops(lay.compute_dtype) / hw.fast_bandwidth:.0f} inside one)"
    )
    reason += schedule_reason(best, ests)
    if len(fitting) > 1:
        nxt = fitting[1]
        sched = f" {nxt.layout.schedule}" if nxt.layout.schedule else ""
        reason += f"; next: {nxt.family} {nxt.layout.name}{sched} ({nxt.step_s / best.step_s - 1:+.0%} step time)"
    return best, reason + "."


def scaling(cfg: Config, hw: Hardware, device_counts: list[int], per_device_batch: float) -> dict[str, list[dict]]:
    """Strong scaling (the config's global batch) and weak scaling (global batch = per_device_batch x N):
    the best fitting candidate at each device count."""
    out: dict[str, list[dict]] = {"strong": [], "weak": []}
    for mode in out:
        base = None
        for n in device_counts:
            batch = cfg.train.global_batch if mode == "strong" else max(1, round(per_device_batch * n))
            trial = with_batch(cfg, global_batch=batch, accum=1)
            best, _ = recommend(candidates(trial, n, hw))
            if best is None:
                out[mode].append({"devices": n, "global_batch": batch, "fits": False})
                continue
            per_dev = best.tokens_per_s / n
            base = base or (n, per_dev)
            out[mode].append(
                {
                    "devices": n,
                    "global_batch": batch,
                    "fits": True,
                    "mesh": best.layout.name,
                    "family": best.family,
                    "grad_accum_steps": best.layout.accum,
                    "pipeline_microbatches": best.layout.pipe_micro if best.layout.mesh["pp"] > 1 else 0,
                    "tokens_per_s": best.tokens_per_s,
                    "step_s": best.step_s,
                    "mfu": best.mfu,
                    "efficiency": best.efficiency,
                    "scaling_efficiency": per_dev / base[1],
                    "relative_to_devices": base[0],
                }
            )
    return out
