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
    count: int  # executions (launches) per step
    devices: int = 0  # devices in one collective's group (its ring); 0: the whole axis

    @property
    def overlappable(self) -> bool:
        """Weight gathers and gradient reductions do not block the next matmul; activation collectives
        (tp all-reduces, pp permutes) sit on the critical path."""
        return self.axis in OVERLAPPED and self.kind != "all-to-all"


def link_bandwidth(lay: Layout, axis: str) -> float:
    """Fast links if the axis's device groups stay inside one node / slice, else the slow network.
    Axes are laid out dp, pp, fsdp, ep, tp from slowest to fastest (jaxdist.distributed.mesh), so an axis's group spans
    its size times the sizes of the faster axes."""
    return lay.hw.fast_bandwidth if _span(lay, axis) <= lay.hw.devices_per_node else lay.hw.slow_bandwidth


def _span(lay: Layout, axis: str) -> int:
    """Devices an axis's groups span: its size times the sizes of the faster axes (see link_bandwidth)."""
    span = lay.mesh[axis]
    for inner in AXES[AXES.index(axis) + 1 :]:
        span *= lay.mesh[inner]
    return span


def launch_latency(lay: Layout, t: Traffic) -> float:
    """Seconds one launch of `t` costs before its bytes: the hardware's per-collective latency plus one
    hop per ring step (n-1; all-reduce 2(n-1); a permute 1), the steps between nodes at the slow hop
    (NCCL's ring model: nodes - 1 of them, twice for an all-reduce)."""
    n = t.devices or lay.mesh[t.axis]
    if n <= 1:
        return 0.0
    twice = 2 if t.kind == "all-reduce" else 1
    steps = 1 if t.kind == "collective-permute" else twice * (n - 1)
    per_node = max(1, lay.hw.devices_per_node)
    nodes = min(n, max(1, _span(lay, t.axis) // per_node))
    slow = 0 if nodes == 1 else min(steps, twice * (nodes - 1))
    return lay.hw.latency_s + (steps - slow) * lay.hw.hop_fast_s + slow * lay.hw.hop_slow_s


def traffic_time(lay: Layout, t: Traffic) -> float:
    """Bytes over the axis's link bandwidth plus each launch's latency (`launch_latency`)."""
    return t.bytes / link_bandwidth(lay, t.axis) + t.count * launch_latency(lay, t)


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
