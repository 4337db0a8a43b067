"""One collective of a training step as the planner counts it (`Traffic`), and what it costs: the
axis's link bandwidth (inside a node or across), its time (alpha-beta), and the step's totals by kind and
by axis (comparable with `jaxdist.distributed.hlo.summarize` of a compiled program)."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from jaxdist.distributed.mesh import AXES
from jaxdist.planner.layout import Layout

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


def link_bandwidth(lay: Layout, axis: str) -> float:
    """Fast links if the axis's device groups stay inside one node / slice, else the slow network.
    Axes are laid out dp, pp, fsdp, ep, tp from slowest to fastest (jaxdist.distributed.mesh), so an axis's group spans
    its size times the sizes of the faster axes."""
    order = AXES
    span = lay.mesh[axis]
    for inner in order[order.index(axis) + 1 :]:
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
