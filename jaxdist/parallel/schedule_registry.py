"""Every `pipeline.schedule`, in one table: how it runs, how it is laid out, what it refuses.

Each entry (`Schedule`) bundles what used to be decided by comparing schedule names in several modules:
the engine (autodiff through `pipeline.run_schedule`'s scan, or a static table executed by
`pipeline_1f1b` with its own gradients), whether a stage holds `pipeline.repeats` virtual chunks, the
table builder (the per-stage orders of `schedule_orders.py`, placed on one or two lanes), which the planner's
model and the executor both read, and the one-line refusals of a (config, mesh). `get(name)` is the
entry; nothing else compares schedule names (`tests/test_pipeline_schedules.py::test_no_module_compares_schedule_names`).

Adding a schedule: its orders function in `schedule_orders.py` (or its engine module), one `Schedule` entry
in `SCHEDULES`, and its name among config/run_sections.py's `pipeline.schedule` values (CONTRIBUTING.md).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from jaxdist.config import Config
from jaxdist.errors import JaxdistError
from jaxdist.parallel import pipeline_1f1b, schedule_orders, schedules, zb_v

Refusal = Callable[[Config, int, int], None]  # (cfg, stages, micro-batches) -> raises JaxdistError or returns


def _refuses_nothing(cfg: Config, stages: int, micro: int) -> None:
    return None


def _refuses_zb_v(cfg: Config, stages: int, micro: int) -> None:
    if cfg.pipeline.repeats not in (1, 2):
        raise JaxdistError(
            f"pipeline.schedule=zb_v runs two chunks per stage (V placement); got pipeline.repeats="
            f"{cfg.pipeline.repeats}: set pipeline.repeats=2 (or leave it at 1)"
        )


def _refuses_interleaved(cfg: Config, stages: int, micro: int) -> None:
    if micro % stages:
        raise JaxdistError(
            f"pipeline.schedule={cfg.pipeline.schedule} needs pipeline.microbatches a multiple of pp={stages} "
            f"(got {micro}); use pipeline.microbatches={stages * max(1, micro // stages)}"
        )


@dataclasses.dataclass(frozen=True)
class Schedule:
    """What one `pipeline.schedule` brings. Only `name` and `orders` are required."""

    name: str
    # the table builder: (stages, micro-batches, repeats) -> per stage its actions. A table schedule's
    # engine executes it and the planner models its slots, buffers and collectives from it; for the scan
    # schedules it is the reference order (GPipe's all-forwards-then-all-backwards).
    orders: Callable[[int, int, int], schedules.Orders]
    # the engine. None: autodiff through pipeline.run_schedule's lax.scan (forward loop, backward by jax).
    # Else (graphdef, plan, positions_T) -> objective_sums(params, tokens, order_T) computing its own
    # gradients by the table (custom VJP); jaxdist.reduce.gradients uses it as it is.
    engine: Callable | None = None
    virtual: bool = False  # a stage holds pipeline.repeats chunks (the circular layout of pipeline.to_stages)
    lanes: int = 1  # table lanes: 2 places a forward and a backward in the same slot
    refuses: Refusal = _refuses_nothing  # one-line errors for what it cannot do (cfg, stages, micro-batches)
    # how chunks sit on stages: "ring" (chunk v of stage s is virtual stage v P + s) or "v" (stage s
    # holds virtual stages s and 2P-1-s: pipeline.to_stages' V layout)
    placement: str = "ring"
    chunks: int = 0  # a fixed chunk count per stage (zb_v: 2) whatever pipeline.repeats says; 0: pipeline.repeats

    def repeats(self, configured: int) -> int:
        """Chunks per stage under `pipeline.repeats=configured`: 1 without virtual stages, the fixed count
        where the schedule has one, else the configured one."""
        return self.chunks or (configured if self.virtual else 1)

    @property
    def tabled(self) -> bool:
        """Run by its table (engine set): the step's loop has the table's slots, the planner models the table."""
        return self.engine is not None

    def table(self, stages: int, microbatches: int, repeats: int = 1) -> schedules.Table:
        """The orders placed on lock-step slots (`schedules.simulate`); a fixed chunk count overrides `repeats`.
        Built once per (schedule, stages, micro-batches, repeats) in a process (read-only arrays): the
        planner asks for the same shapes across candidates and the step's Plan on every describe."""
        return _table(self, stages, microbatches, self.chunks or repeats)


@functools.lru_cache(maxsize=512)
def _table(entry: Schedule, stages: int, microbatches: int, repeats: int) -> schedules.Table:
    order = entry.orders(stages, microbatches, repeats)
    table = schedules.simulate(order, stages, microbatches, repeats, entry.lanes, entry.placement)
    for a in (table.kind, table.chunk, table.mb):
        a.setflags(write=False)
    return table


SCHEDULES: dict[str, Schedule] = {
    s.name: s
    for s in (
        Schedule("gpipe", schedule_orders.gpipe_orders),
        Schedule("circular", schedule_orders.gpipe_orders, virtual=True),
        Schedule("1f1b", schedule_orders.one_f_one_b_orders, pipeline_1f1b.schedule_objective),
        Schedule("1f1b_paired", schedule_orders.one_f_one_b_orders, pipeline_1f1b.schedule_objective, lanes=2),
        Schedule(
            "interleaved_1f1b",
            schedule_orders.interleaved_orders,
            pipeline_1f1b.schedule_objective,
            virtual=True,
            refuses=_refuses_interleaved,
        ),
        Schedule("zb_h1", schedule_orders.zb_h1_orders, pipeline_1f1b.schedule_objective),
        Schedule(
            "zb_v",
            zb_v.zb_v_orders,
            pipeline_1f1b.schedule_objective,
            virtual=True,
            refuses=_refuses_zb_v,
            placement="v",
            chunks=2,
        ),
    )
}


def get(name: str) -> Schedule:
    """The entry `pipeline.schedule=name` picks; an unknown name is a one-line error."""
    if name not in SCHEDULES:
        raise JaxdistError(f"pipeline.schedule={name!r} is not one of {', '.join(SCHEDULES)}; pick one")
    return SCHEDULES[name]


def virtual_names() -> str:
    """The schedules with a configurable chunk count, for error messages ("circular or interleaved_1f1b")."""
    return " or ".join(n for n, s in SCHEDULES.items() if s.virtual and not s.chunks)
