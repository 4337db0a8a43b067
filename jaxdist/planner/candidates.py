"""The layouts the planner compares: candidate meshes for a device count (the usual families: DP, FSDP,
HSDP, TP, PP, CP, EP), the architecture's refusals, every pipeline schedule on a pp mesh, and each mesh's
best batch split, each estimated by planner/estimate.py."""

from __future__ import annotations

import dataclasses
import math

from jaxdist.config import Config
from jaxdist.distributed.mesh import AXES
from jaxdist.errors import JaxdistError
from jaxdist.models import registry
from jaxdist.parallel import schedule_registry
from jaxdist.planner.estimate import Estimate, estimate
from jaxdist.planner.hardware import Hardware
from jaxdist.planner.layout import Layout


def powers_of_two(limit: int, start: int = 1) -> list[int]:
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
    tps = [t for t in powers_of_two(min(8, node), 2) if devices % t == 0]
    pps = [p for p in powers_of_two(min(16, devices), 2) if devices % p == 0 and cfg.model.num_layers % p == 0]
    out = [("DP", dict(dp=devices)), ("FSDP", dict(fsdp=devices))]
    out += [
        ("HSDP", dict(dp=devices // f, fsdp=f))
        for f in powers_of_two(devices // 2, 2)
        if devices % f == 0 and f >= node // 2
    ]
    out += [("TPxFSDP", dict(tp=t, fsdp=devices // t)) for t in tps]
    out += [("PPxFSDP", dict(pp=p, fsdp=devices // p)) for p in pps if devices // p > 1]
    out += [
        ("PPxTPxFSDP", dict(pp=p, tp=t, fsdp=devices // (p * t))) for p in pps for t in tps if devices % (p * t) == 0
    ]
    out += [
        ("CPxFSDP", dict(cp=c, fsdp=devices // c))
        for c in powers_of_two(node, 2)
        if devices % c == 0 and cfg.model.seq_len % (2 * c) == 0 and not cfg.model.sliding_window
    ]
    if cfg.model.moe_experts:  # expert parallelism: experts over ep (inside a node), fsdp or tp beside it
        eps = [
            e
            for e in powers_of_two(min(cfg.model.moe_experts, node), 2)
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
    pipe = powers_of_two(max(local, 1), mesh["pp"]) if mesh["pp"] > 1 else [0]
    for accum in powers_of_two(max(local, 1)):
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
        registry.of(cfg.model).validate(cfg, mesh)
    except JaxdistError:
        return False
    return True


def schedule_variants(cfg: Config, mesh: dict[str, int]) -> list[Config]:
    """With pp > 1, `cfg` under every schedule of the registry (parallel/schedule_registry.py), each sized
    by its own model: the scan schedules' bubble and stacked activations, the table schedules' slots and
    buffers (Layout.table). A schedule with virtual chunks gets pipeline.repeats (2 where the config says
    1: one chunk per stage is its non-virtual twin; zb_v always 2). What a schedule refuses, Layout.validate refuses."""
    if mesh["pp"] == 1:
        return [cfg]
    out = []
    for entry in schedule_registry.SCHEDULES.values():
        repeats = entry.repeats(max(2, cfg.pipeline.repeats))
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
        if architecture_takes(variant, mesh)  # gpt-oss / DeepSeek-V3 take gpipe and circular only
        if (e := best_for_mesh(variant, mesh, hw, name))
    ]
    return sorted(out, key=lambda e: (not e.memory.fits, e.step_s if e.memory.fits else e.memory.total))


# Step times closer than this are a tie: the model's seconds are a roofline (compute at the hardware
# table's peak x matmul efficiency, collectives at link bandwidth), not a measurement, so a 2% edge is
