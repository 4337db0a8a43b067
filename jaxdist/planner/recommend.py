"""The recommendation among the candidates (the fastest that fits, ties broken by memory headroom) with
its one-paragraph reason, and the scaling curves: the recommendation at each device count."""

from __future__ import annotations

from jaxdist.config import Config
from jaxdist.planner.candidates import candidates, with_batch
from jaxdist.planner.estimate import Estimate
from jaxdist.planner.hardware import Hardware
from jaxdist.planner.traffic import traffic_time

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
