"""The layout search behind `plan --search` and `train --mesh auto`, the pure part: every layout the
devices and the config allow, sized by the planner, ranked by predicted step time, and the choice made
from the compiler's memory and the measured step times (jaxdist/analysis/mesh_search.py compiles and
times; this module decides, so the decision is a function of its inputs and testable without a compile).

A layout is the mesh (every way to split the device count over dp, pp, fsdp, cp, ep, tp), the pipeline
schedule and micro-batches on pp > 1, the remat policy and the gradient accumulation that keeps
`train.global_batch`. Order, everywhere: predicted step time, then `order_key` (the mesh's axis sizes
in AXES order, largest dp first, then schedule name, remat policy's place in REMATS, accumulation and
pipeline micro-batches, smallest first), then predicted memory — so equal predictions never leave the
order to chance.
"""

from __future__ import annotations

import dataclasses
import math

from jaxdist.config import Config
from jaxdist.distributed.mesh import AXES, format_mesh
from jaxdist.errors import JaxdistError
from jaxdist.planner import memory
from jaxdist.planner.candidates import architecture_takes, powers_of_two, schedule_variants, with_batch
from jaxdist.planner.estimate import Estimate, estimate
from jaxdist.planner.hardware import Hardware
from jaxdist.planner.layout import Layout, param_table

# Remat policies searched, cheapest recompute first (offload_dots moves residuals to the host: a
# choice for a user with host memory to spare, not one the search makes for them).
REMATS = ("none", "dots_saveable", "full")
# Measured step times within this fraction of the fastest are a tie: the one ranked higher by the
# planner wins (a shared 2-core machine's timings move by a few percent from run to run).
MEASURED_TIE = 0.03
# Predicted step times within this factor of the fastest are ones the planner cannot order: on 8
# simulated CPU devices layouts it predicted within 5% of each other measured 2-3x apart, and the order
# did not follow (docs/planner.md's sweep: rank correlation -0.6 to 0.4). Within the band the shortlist
# spreads over axis families (see shortlist) instead of taking the K nearest.
PREDICTION_SPREAD = 2.0


def with_budget(hw: Hardware, budget_bytes: float | None) -> Hardware:
    """`hw` whose usable memory per device is `budget_bytes` (memory.USABLE_FRACTION of its HBM)."""
    if budget_bytes is None:
        return hw
    if budget_bytes <= 0:
        raise JaxdistError(f"--memory-budget must be positive, got {budget_bytes:g} bytes")
    return dataclasses.replace(hw, hbm_bytes=budget_bytes / memory.USABLE_FRACTION)


def mesh_shapes(devices: int) -> list[dict[str, int]]:
    """Every assignment of axis sizes (in AXES order) whose product is `devices`."""
    out: list[dict[str, int]] = []

    def fill(i: int, left: int, sizes: list[int]) -> None:
        if i == len(AXES) - 1:
            out.append(dict(zip(AXES, [*sizes, left])))
            return
        for d in range(1, left + 1):
            if left % d == 0:
                fill(i + 1, left // d, [*sizes, d])

    fill(0, devices, [])
    return out


def order_key(lay: Layout) -> tuple:
    """The stated tie order: dp-heavy meshes first (fewest collectives), then schedule, remat, accumulation."""
    return (
        tuple(-lay.mesh[a] for a in AXES),
        lay.cfg.pipeline.schedule if lay.mesh["pp"] > 1 else "",
        REMATS.index(lay.cfg.model.remat) if lay.cfg.model.remat in REMATS else len(REMATS),
        lay.accum,
        lay.pipe_micro,
    )


def rank_key(e: Estimate) -> tuple:
    """Predicted step time, then the stated order (on a tie the planner cannot tell recompute from none
    where collectives bound the step; the cheaper remat policy goes first), then memory."""
    return (e.step_s, order_key(e.layout), e.memory.total)


def describe(lay: Layout) -> str:
    """'fsdp=4,tp=2 remat=none accum=1' (+ ' 1f1b M=4' on pp > 1): a layout on one line."""
    text = f"{format_mesh(lay.mesh)} remat={lay.cfg.model.remat} accum={lay.accum}"
    return text + (f" {lay.schedule} M={lay.pipe_micro}" if lay.mesh["pp"] > 1 else "")


@dataclasses.dataclass
class Enumeration:
    """What the search looked at: every layout the planner sized (`sized`), of which `fitting` fit the
    planner's budget (ranked), and how many mesh shapes and settings were refused before sizing."""

    meshes: list[dict[str, int]]  # the mesh shapes the config allows (Layout.validate passed for some setting)
    sized: list[Estimate]
    fitting: list[Estimate]
    refused: int  # (mesh, schedule, remat, accumulation, micro-batches) settings the layout refuses


def settings(cfg: Config, mesh: dict[str, int]) -> list[Config]:
    """`cfg` under every remat policy, schedule (pp > 1), accumulation and pipeline micro-batch count the
    mesh could take; powers of two, global batch kept."""
    local = max(1, cfg.train.global_batch // math.prod(mesh[a] for a in ("dp", "fsdp", "ep")))
    out = []
    for remat in REMATS:
        base = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat=remat))
        for variant in schedule_variants(base, mesh):
            for accum in powers_of_two(local):
                pipes = powers_of_two(local // accum, mesh["pp"]) if mesh["pp"] > 1 else [0]
                out += [with_batch(variant, accum=accum, pipe_micro=pm) for pm in pipes]
    return out


def enumerate_layouts(cfg: Config, devices: int, hw: Hardware) -> Enumeration:
    """Every layout of `cfg` on `devices` that the planner can size, and those that fit, best first. Per
    (mesh, remat, schedule) accumulation stops at the smallest that fits (more only repeats collectives)."""
    meshes, sized, refused = [], [], 0
    for mesh in mesh_shapes(devices):
        if not architecture_takes(cfg, mesh):
            continue
        took, fit_at = False, {}  # (remat, schedule) -> the accumulation at which it first fits
        for variant in settings(cfg, mesh):
            key, accum = (variant.model.remat, variant.pipeline.schedule), variant.train.grad_accum_steps
            if fit_at.get(key, accum) < accum:
                continue  # more accumulation than fits only repeats the collectives: never faster
            try:
                est = estimate(Layout(variant, mesh, hw), "search")
            except JaxdistError:
                refused += 1
                continue
            sized.append(est)
            took = True
            if est.memory.fits:
                fit_at[key] = accum
        if took:
            meshes.append(mesh)
    fitting = sorted((e for e in sized if e.memory.fits), key=rank_key)
    return Enumeration(meshes, sized, fitting, refused)


def family(lay: Layout) -> tuple[str, ...]:
    """The model-parallel axes a layout splits over (tp, ep, cp, pp of size > 1; ep only for a model with
    expert weights: elsewhere it is one more batch axis): () is the data-parallel family (dp and fsdp)."""
    experts = any("expert" in g.names for g in param_table(lay.cfg.model))
    return tuple(a for a in ("tp", "ep", "cp", "pp") if lay.mesh[a] > 1 and (a != "ep" or experts))


def _mesh_key(e: Estimate) -> tuple:
    return tuple(e.layout.mesh.values()), e.layout.schedule


def per_mesh(fitting: list[Estimate]) -> list[Estimate]:
    """The ranking with one layout per (mesh, schedule), its best-ranked: the remat and accumulation
    settings of one mesh tie in the planner's seconds more often than meshes do."""
    seen, out = set(), []
    for e in fitting:
        key = _mesh_key(e)
        if key not in seen:
            seen.add(key)
            out.append(e)
    return out


def shortlist(fitting: list[Estimate], top_k: int) -> list[Estimate]:
    """The `top_k` layouts the search compiles, in rank order, one per (mesh, schedule): first the
    best-ranked layout of each axis family (see family) predicted within PREDICTION_SPREAD of the fastest,
    families in the order of their best, then the rest by rank. The planner's seconds do not order
    layouts that close (PREDICTION_SPREAD), so K nearest ones of one family would tell the search less
    than one of each; the timing phase orders them, and refine then looks deeper into the winner's family."""
    ranked = per_mesh(fitting)
    if not ranked:
        return []
    band = [e for e in ranked if e.step_s <= ranked[0].step_s * PREDICTION_SPREAD]
    heads: dict[tuple[str, ...], Estimate] = {}
    for e in band:
        heads.setdefault(family(e.layout), e)
    picked = list(heads.values())[:top_k]
    picked += [e for e in ranked if all(e is not p for p in picked)][: top_k - len(picked)]
    return sorted(picked, key=lambda e: next(i for i, r in enumerate(ranked) if r is e))


def refine(fitting: list[Estimate], rows: list[Row], lead: Row, n: int) -> list[Estimate]:
    """After the shortlist's timing: the next `n` layouts (one per mesh and schedule, in rank order) of the
    family of `lead`, the fastest measured, that the shortlist did not hold. A pure function of the
    ranking and the timings' winner, so every process given the same winner compiles the same ones."""
    fam, held = family(lead.est.layout), {_mesh_key(r.est) for r in rows}
    deeper = [e for e in per_mesh(fitting) if _mesh_key(e) not in held and family(e.layout) == fam]
    return deeper[:n]


@dataclasses.dataclass
class Row:
    """One candidate through the search: the planner's figures, then the compiler's and the clock's."""

    est: Estimate
    compiled_bytes: int | None = None  # compiled.memory_analysis() total per device; None: not compiled
    compile_s: float | None = None
    measured_s: float | None = None  # median measured step time; None: not timed
    dropped: str = ""  # why the compiler's count ruled it out
    not_reached: str = ""  # why the search's time budget left it uncompiled or untimed

    @property
    def name(self) -> str:
        return describe(self.est.layout)


def choose(rows: list[Row]) -> tuple[Row, str]:
    """The winner among the compiled rows that fit by the compiler's count (rows in planner rank order):
    with measured times, the fastest measured (rows within MEASURED_TIE of it: the planner's higher
    rank); without, the planner's best. A pure function of its inputs, so every process given the same
    rows chooses the same layout."""
    alive = [r for r in rows if r.compiled_bytes is not None and not r.dropped]
    if not alive:
        raise JaxdistError(
            "no candidate layout fits by the compiler's count; raise --memory-budget, add devices or lower "
            "train.global_batch"
        )
    timed = [(r, r.measured_s) for r in alive if r.measured_s is not None]
    if timed:
        fastest = min(s for _, s in timed)
        best, best_s = next((r, s) for r, s in timed if s <= fastest * (1 + MEASURED_TIE))
        ties = sum(s <= fastest * (1 + MEASURED_TIE) for _, s in timed)
        why = (
            f"the fastest measured of {len(timed)} timed ({best_s * 1e3:.1f} ms/step"
            + (f"; {ties} within {MEASURED_TIE:.0%}, the planner's higher rank breaks the tie" if ties > 1 else "")
            + f"; planner ranked it #{rows.index(best) + 1})"
        )
    else:
        best = alive[0]
        why = f"the planner's fastest that the compiler says fits (ranked #{rows.index(best) + 1}, not timed)"
    mem = (best.compiled_bytes or 0) / 1e6  # alive rows were compiled
    return best, f"chose {best.name}: {why}, {mem:.1f} MB per device compiled"


def table(rows: list[Row], budget_bytes: float) -> str:
    """The rows as the search decided from them: predicted vs compiled memory, predicted vs measured time."""
    head = f"{'#':>3}  {'layout':<44} {'plan MB':>9} {'compiled MB':>11} {'plan ms':>9} {'measured ms':>11}  note"
    lines = [head, "-" * len(head)]
    for i, r in enumerate(rows, 1):
        comp = "-" if r.compiled_bytes is None else f"{r.compiled_bytes / 1e6:.2f}"
        meas = "-" if r.measured_s is None else f"{r.measured_s * 1e3:.2f}"
        lines.append(
            f"{i:>3}  {r.name:<44} {r.est.memory.total / 1e6:>9.2f} {comp:>11} {r.est.step_s * 1e3:>9.2f} "
            f"{meas:>11}  {r.dropped or r.not_reached}"
        )
    lines.append(f"(budget {budget_bytes / 1e6:.2f} MB usable per device)")
    return "\n".join(lines)
