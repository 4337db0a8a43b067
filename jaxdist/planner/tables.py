"""What `python -m jaxdist.plan` prints: the memory, communication and scaling tables, the host-transfer
line, the offload options sized when nothing fits, and the scaling picture (the estimates are estimate.py's).
"""

from __future__ import annotations

import dataclasses

from jaxdist import config
from jaxdist.planner import comms, hardware
from jaxdist.planner.candidates import candidates
from jaxdist.planner.estimate import Estimate, estimate
from jaxdist.planner.layout import Layout
from jaxdist.planner.picture import scaling_png
from jaxdist.planner.recommend import recommend
from jaxdist.planner.traffic import by_axis, link_bandwidth

STEP_TIME_NOTE = (
    "step times are a roofline model (compute at the hardware table's peak x its matmul efficiency, collectives "
    "at its link bandwidths): its memory and collective bytes are checked against compiled programs "
    "(tests/test_plan.py), its seconds against no measured step yet, so rank layouts with them, do not budget with them"
)


def gb(x: float) -> str:
    return f"{x / 1e9:.1f}"


MEMORY_LEGEND = """columns: family = kind of mesh; mesh = axis sizes (>1); acc = gradient-accumulation micro-batches
  (train.grad_accum_steps); pipe = pipeline micro-batches per accumulation step (pipeline.microbatches; '-' without
  pp); schedule = pipeline.schedule (xV: pipeline.repeats chunks per stage); params, grads, optim (AdamW moments), activ (saved for backward), temp (largest scratch: the layers' or
  the loss's), total: GB per device; fits = total within 90% of the device's memory; step s / no-ovl s = predicted step time with / without
  communication overlapping compute; bubble = share of the step idle in the pipeline bubble; MFU = model FLOPs /
  peak; tok/s = predicted tokens per second (all devices)"""


def memory_table(ests: list[Estimate]) -> str:
    head = (
        f"{'family':<11} {'mesh':<22} {'acc':>4} {'pipe':>4} {'schedule':<19} {'params':>7} {'grads':>7} {'optim':>7} "
        f"{'activ':>7} {'temp':>7} {'total':>7} {'fits':>4} {'step s':>8} {'no-ovl s':>8} {'bubble':>6} "
        f"{'MFU':>5} {'tok/s':>9}"
    )
    rows = [head, "-" * len(head)]
    for e in ests:
        lay, mem = e.layout, e.memory
        rows.append(
            f"{e.family:<11} {lay.name:<22} {lay.accum:>4} {lay.pipe_micro if lay.mesh['pp'] > 1 else '-':>4} "
            f"{lay.schedule or '-':<19} {gb(mem.params):>7} {gb(mem.grads):>7} {gb(mem.optimizer):>7} {gb(mem.activations):>7} "
            f"{gb(max(mem.temporary, mem.loss)):>7} {gb(mem.total):>7} {'yes' if mem.fits else 'NO':>4} "
            f"{e.step_s:>8.3g} {e.step_no_overlap_s:>8.3g} {e.bubble_s / e.step_s:>6.1%} "
            f"{e.mfu:>5.0%} {e.tokens_per_s:>9.3g}"
        )
    return "\n".join(rows + [MEMORY_LEGEND])


def comm_table(e: Estimate) -> str:
    lay = e.layout
    rows = [
        f"communication per step per device, {lay.name} on {lay.hw.name}:",
        f"  {'axis':<5} {'collective':<19} {'count':>7} {'GB sent':>9} {'seconds':>9}  link",
    ]
    for axis, kinds in by_axis(lay, list(e.traffic)).items():
        bw = link_bandwidth(lay, axis)
        link = "fast" if bw == lay.hw.fast_bandwidth else "slow"
        for kind, v in kinds.items():
            rows.append(
                f"  {axis:<5} {kind:<19} {v['count']:>7} {gb(v['bytes']):>9} {v['seconds']:>9.3g}  "
                f"{link} {bw / 1e9:.0f} GB/s"
            )
    tiers = comms.dropless_a2a_tiers(lay)
    if tiers:
        rows.append(
            f"  ep all-to-all is dropless MoE's worst tier ({tiers['worst_slots']} slots per expert); a balanced "
            f"router runs the {tiers['balanced_slots']}-slot tier: {gb(tiers['balanced_bytes'])} GB"
        )
    rows.append(
        f"  compute {e.compute_s:.3g} s, replicated work {e.work_s:.3g} s, bubble {e.bubble_s:.3g} s, communication {e.comm_s:.3g} s "
        f"({e.exposed_comm_s:.3g} s exposed with overlap)"
    )
    host = host_line(e)
    if host:
        rows.append(host)
    return "\n".join(rows)


def host_line(e: Estimate) -> str | None:
    """Offload's host<->device traffic per device per step and its time at the host link's bandwidth."""
    h, mem = e.host, e.memory
    if not (h.host_to_device or h.device_to_host):
        return None
    line = (
        f"  offload: {gb(mem.host)} GB per device in host memory; host<->device {gb(h.host_to_device)} GB in, "
        f"{gb(h.device_to_host)} GB out per step"
    )
    if mem.fetched:
        line += f" (without remat the backward keeps all {gb(mem.fetched)} GB of fetched layers on the device)"
    if not h.bandwidth:
        return line + f" (no host bandwidth for {e.layout.hw.name} in the hardware table: time not modelled)"
    return line + (
        f" at {h.bandwidth / 1e9:.0f} GB/s each way: {h.total_s:.3g} s, {h.exposed_s:.3g} s of it exposed "
        f"(the layer scan's {h.hidden_s:.3g} s overlap compute)"
    )


def scaling_table(curves: dict) -> str:
    rows = []
    for mode, pts in curves.items():
        rows.append(f"{mode} scaling (best fitting mesh per device count):")
        rows.append(
            f"  {'devices':>7} {'batch':>6} {'mesh':<22} {'acc':>4} {'pipe':>4} {'tok/s':>10} {'MFU':>5} "
            f"{'vs first':>8}"
        )
        for p in pts:
            if not p["fits"]:
                rows.append(f"  {p['devices']:>7} {p['global_batch']:>6} {'(does not fit)':<22}")
                continue
            rows.append(
                f"  {p['devices']:>7} {p['global_batch']:>6} {p['mesh']:<22} {p['grad_accum_steps']:>4} "
                f"{p['pipeline_microbatches'] or '-':>4} {p['tokens_per_s']:>10.3g} "
                f"{p['mfu']:>5.0%} {p['scaling_efficiency']:>8.0%}"
            )
    rows.append(
        "  (strong: the config's global batch at every size; weak: the batch per device kept; acc / pipe as "
        "above; 'vs first': tokens/s per device relative to the smallest device count that fits)"
    )
    return "\n".join(rows)


def plot(curves: dict, path: str, title: str) -> list[str]:

    return scaling_png(curves, path, title)


OFFLOADS = (("params",), ("params", "optimizer"))


def offload_options(cfg: config.Config, devices: int, hw: hardware.Hardware) -> list[dict]:
    """When nothing fits: the best layout with the parameters (then also the AdamW state) in host memory
    (jaxdist.distributed.offload), whether it fits, and its modelled step time against the same layout without."""
    out = []
    for kinds in OFFLOADS:
        if all(getattr(cfg.offload, k) == "host" for k in kinds):
            continue
        with_offload = cfg.replace(offload={k: "host" for k in kinds})
        ests = candidates(with_offload, devices, hw)
        if not ests:
            continue
        best, _ = recommend(ests)
        shown = best or min(ests, key=lambda e: e.memory.total)
        lay = shown.layout
        without = estimate(Layout(lay.cfg.replace(offload=dataclasses.asdict(cfg.offload)), lay.mesh, hw), shown.family)
        out.append(
            {
                "overrides": [f"offload.{k}=host" for k in kinds],
                "fits": best is not None,
                "estimate": shown,
                "step_s_without": without.step_s,
            }
        )
    return out


def offload_lines(options: list[dict]) -> list[str]:
    rows = []
    for o in options:
        e, lay = o["estimate"], o["estimate"].layout
        what = " ".join(o["overrides"])
        where = f"{e.family} {lay.name}, accumulation {lay.accum}"
        if not o["fits"]:
            rows.append(
                f"with {what}: nothing fits either (the smallest, {where}, needs {e.memory.total / 1e9:.1f} GB "
                f"per device of {e.memory.capacity / 1e9:.0f} usable)"
            )
            continue
        h = e.host
        rows.append(
            f"with {what}: {where} fits ({e.memory.total / 1e9:.1f} of {e.memory.capacity / 1e9:.0f} GB usable), "
            f"{e.step_s:.3g} s/step modelled vs {o['step_s_without']:.3g} s for the same layout without offload "
            f"({e.step_s / o['step_s_without'] - 1:+.1%}): {(h.host_to_device + h.device_to_host) / 1e9:.1f} GB "
            f"over the host link per device per step at {h.bandwidth / 1e9:.0f} GB/s each way, {h.exposed_s:.3g} s exposed"
        )
    return rows
