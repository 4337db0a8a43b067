"""The compiling and timing half of the layout search (`plan --search`): the planner's ranked layouts
(jaxdist/planner/search.py) compiled ahead of time on the devices present, the top K, each one's memory
read from `compiled.memory_analysis()` and dropped, with a line naming the planner's miss, where it does
not fit the budget by the compiler's count; then `steps` measured steps of the first `timed` survivors
(the same compiled executable: nothing is compiled twice);
then planner/search.choose picks. Time-boxed by K, `steps` and, with `budget_s`, seconds: once the
compiling and timing have spent the budget, the candidates not reached are marked so (the first is always
compiled: training needs one). `train --mesh auto` keeps what it decided: jaxdist/analysis/mesh_auto.py."""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist.analysis import bench
from jaxdist.config import Config
from jaxdist.data import data_rules
from jaxdist.distributed import mesh as mesh_mod
from jaxdist.distributed.mesh import format_mesh
from jaxdist.errors import JaxdistError
from jaxdist.observe import metrics
from jaxdist.planner import search
from jaxdist.planner.hardware import Hardware
from jaxdist.training import step


@dataclasses.dataclass
class Result:
    rows: list[search.Row]  # the compiled top K, in the planner's rank order
    chosen: search.Row
    reason: str
    enumeration: search.Enumeration
    budget_bytes: float  # usable bytes per device the candidates were held to
    plan_s: float  # seconds enumerating and sizing
    compile_s: float  # seconds compiling the top K
    time_s: float  # seconds timing steps
    budget_s: float | None = None  # seconds the compiling and timing were held to; None: K and steps only

    @property
    def cfg(self) -> Config:
        """The chosen layout's config (mesh.shape, accumulation, pipeline, remat set)."""
        lay = self.chosen.est.layout
        return lay.cfg.replace(mesh=dict(shape=format_mesh(lay.mesh)))

    def as_dict(self) -> dict:
        rows = [
            dict(
                layout=r.name,
                mesh=format_mesh(r.est.layout.mesh),
                planned_bytes=r.est.memory.total,
                compiled_bytes=r.compiled_bytes,
                planned_step_s=r.est.step_s,
                measured_step_s=r.measured_s,
                compile_s=r.compile_s,
                dropped=r.dropped,
            )
            for r in self.rows
        ]
        return dict(
            rows=rows,
            chosen=self.chosen.name,
            mesh=format_mesh(self.chosen.est.layout.mesh),
            reason=self.reason,
            summary=self.summary(),
            budget_bytes=self.budget_bytes,
            mesh_shapes=len(self.enumeration.meshes),
            sized=len(self.enumeration.sized),
            fitting=len(self.enumeration.fitting),
            plan_s=self.plan_s,
            compile_s=self.compile_s,
            time_s=self.time_s,
            budget_s=self.budget_s,
            not_reached=[r.name for r in self.rows if r.not_reached],
        )

    def summary(self) -> str:
        e = self.enumeration
        skipped = sum(bool(r.not_reached) for r in self.rows)
        budget = "" if self.budget_s is None else f" (budget {self.budget_s:g} s"
        if budget:
            budget += f"; {skipped} candidates not reached)" if skipped else "; all reached)"
        return (
            f"searched {len(e.meshes)} mesh shapes, {len(e.sized)} layouts sized, {len(e.fitting)} fit the planner's "
            f"budget; compiled {sum(r.compiled_bytes is not None for r in self.rows)}, timed "
            f"{sum(r.measured_s is not None for r in self.rows)}; {self.plan_s:.1f} s planning, "
            f"{self.compile_s:.1f} s compiling, {self.time_s:.1f} s timing{budget}"
        )


def compile_row(row: search.Row, devices: list, capacity: float):
    """Compile `row`'s layout with abstract inputs (nothing allocated) and judge it against `capacity`;
    returns (program, compiled) for timing, or None where the layout is refused at compile."""
    lay = row.est.layout
    t0 = time.perf_counter()
    try:
        mesh = mesh_mod.mesh_from_string(format_mesh(lay.mesh), devices)
        prog = step.build_program(lay.cfg, mesh, eos_id=data_rules.mask_eos(lay.cfg))
        tokens = jax.ShapeDtypeStruct(
            (lay.cfg.train.global_batch, lay.cfg.model.seq_len + 1), jnp.int32, sharding=prog.batch_sharding
        )
        compiled = prog.train_step.lower(prog.abstract_state, tokens).compile()
    except JaxdistError as e:
        row.dropped = f"refused at compile: {e}"
        return None
    row.compile_s = time.perf_counter() - t0
    judge(row, (metrics.compiled_memory(compiled) or {}).get("total"), capacity)
    return prog, compiled


def judge(row: search.Row, compiled_bytes: int | None, capacity: float) -> None:
    """Record the compiler's per-device total; over `capacity` the row is dropped with the planner's miss."""
    row.compiled_bytes = compiled_bytes
    if compiled_bytes is not None and compiled_bytes > capacity:
        miss = row.est.memory.total / compiled_bytes - 1
        row.dropped = (
            f"dropped: the compiler counts {compiled_bytes / 1e6:.2f} MB > {capacity / 1e6:.2f} MB budget; "
            f"the planner's {row.est.memory.total / 1e6:.2f} MB missed by {miss:+.1%}"
        )


def time_steps(prog, compiled, cfg: Config, steps: int) -> float:
    """Median seconds of `steps` synchronised steps (after one untimed) of the compiled program."""
    tokens = bench.random_batch(prog, cfg)
    state, m = compiled(prog.init_state(cfg.train.seed), tokens)
    jax.block_until_ready(m)
    return statistics.median(bench.step_times(compiled, state, tokens, steps)[2])


def run(
    cfg: Config,
    hw: Hardware,
    top_k: int = 3,
    steps: int = 0,
    timed: int = 3,
    devices=None,
    budget_s: float | None = None,
) -> Result:
    """Enumerate, rank, compile the shortlist's `top_k` (search.shortlist: one per axis family the planner
    cannot order, then by rank), time `steps` steps of the first `timed` that fit; with timings, compile and
    time up to `top_k` - 1 more of the fastest one's family (search.refine); choose. Compiling and timing
    stop once `budget_s` seconds are spent in all (see measure)."""
    devices = list(jax.devices() if devices is None else devices)
    if top_k < 1 or steps < 0:
        raise JaxdistError(f"--top-k {top_k} must be >= 1 and --mesh-search-steps {steps} >= 0")
    if budget_s is not None and budget_s <= 0:
        raise JaxdistError(f"--mesh-search-budget {budget_s:g}: give a positive number of seconds")
    t0 = time.perf_counter()
    found = search.enumerate_layouts(cfg, len(devices), hw)
    plan_s = time.perf_counter() - t0
    if not found.fitting:
        least = min((e.memory.total for e in found.sized), default=None)
        need = f" (the smallest needs {least / 1e6:.1f} MB per device)" if least is not None else ""
        raise JaxdistError(
            f"no layout of {len(devices)} devices fits the planner's budget{need}; raise the memory budget, "
            f"add devices or lower train.global_batch"
        )
    capacity = found.fitting[0].memory.capacity
    rows = [search.Row(e) for e in search.shortlist(found.fitting, top_k)]
    compile_s, time_s = measure(rows, devices, capacity, steps, timed, budget_s)
    lead = search.choose(rows)[0]
    if steps and lead.measured_s is not None and top_k > 1:
        lead = rows[agree(rows.index(lead))]  # several processes: all refine process 0's winner
        deeper = [search.Row(e) for e in search.refine(found.fitting, rows, lead, top_k - 1)]
        left = None if budget_s is None else budget_s - compile_s - time_s
        if deeper and (left is None or left > 0):
            more_c, more_t = measure(deeper, devices, capacity, steps, len(deeper), left, first_free=False)
            compile_s, time_s = compile_s + more_c, time_s + more_t
            rank = {id(e): i for i, e in enumerate(found.fitting)}
            rows = sorted(rows + deeper, key=lambda r: rank[id(r.est)])
    chosen, reason = search.choose(rows)
    return Result(rows, chosen, reason, found, capacity, plan_s, compile_s, time_s, budget_s)


def agree(index: int) -> int:
    """`index` as process 0 has it: the timings differ per process, the candidates compiled may not."""
    if jax.process_count() == 1:
        return index
    from jax.experimental import multihost_utils  # deferred: only multi-process runs broadcast

    return int(multihost_utils.broadcast_one_to_all(np.int32(index)))


def measure(
    rows: list[search.Row],
    devices: list,
    capacity: float,
    steps: int,
    timed: int,
    budget_s: float | None,
    first_free: bool = True,
) -> tuple[float, float]:
    """Compile `rows` in order, then time `steps` steps of the first `timed` that fit; (compile s, time s).
    With `budget_s`, a row is compiled or timed only while the seconds spent so far are under it (with
    `first_free` the first row is always compiled, so there is a layout to train); a row skipped for the
    budget says so in `not_reached`. A candidate's own compile or timing is not cut short, so the overrun
    is at most one."""
    start = time.perf_counter()

    def spent() -> bool:
        return budget_s is not None and time.perf_counter() - start >= budget_s

    programs = []
    for i, row in enumerate(rows):
        if (i or not first_free) and spent():
            row.not_reached = f"not reached: the {budget_s:g} s budget was spent before compiling it"
            programs.append(None)
            continue
        programs.append(compile_row(row, devices, capacity))
    compile_s = time.perf_counter() - start
    if steps:
        alive = [(r, p) for r, p in zip(rows, programs) if p is not None and not r.dropped]
        for row, (prog, compiled) in alive[:timed]:
            if spent():
                row.not_reached = f"not timed: the {budget_s:g} s budget was spent before timing it"
                continue
            row.measured_s = time_steps(prog, compiled, row.est.layout.cfg, steps)
    return compile_s, time.perf_counter() - start - compile_s
