"""Where a schedule table's data waits (what `jaxdist.parallel.pipeline_1f1b` executes and the planner sizes):
the buffer slot each stage's arriving activation and gradient is written to and each action reads
(`buffers`: an activation sent by F at slot t arrives at t + 1 and is kept until its receiver's last
action on it), and the micro-batches in flight per stage (`in_flight`). The tables themselves:
jaxdist/parallel/schedules.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxdist.parallel.schedules import BWD, FWD, IDLE, WGT, Table, next_virtual, prev_virtual, sends_down


@dataclasses.dataclass(frozen=True)
class Buffers:
    """Per (slot, stage): the buffer slot an arriving activation (x_in) / gradient (g_in) is written
    to (-1: nothing arrives); per (slot, stage, lane): the slots the lane's action reads (x_read,
    g_read). Sizes: the most activations / gradients any stage holds at once. `arrive`: every arrival by
    (pool "x" / "g", source): "down" came from stage s-1 (sent down the ring), "up" from s+1, "own" is
    the stage's own output of the previous slot (V placement's turn at stage P-1); x_in is ("x", "down")
    and g_in ("g", "up"), the only two a ring placement has."""

    arrive: dict
    x_read: np.ndarray
    g_read: np.ndarray
    x_size: int
    g_size: int

    @property
    def x_in(self) -> np.ndarray:
        return self.arrive[("x", "down")]

    @property
    def g_in(self) -> np.ndarray:
        return self.arrive[("g", "up")]


def _where(table: Table) -> dict[tuple, tuple[int, int]]:
    """(kind, stage, chunk, micro-batch) -> (slot, lane)."""
    out = {}
    for t, s, lane in zip(*np.nonzero(table.kind != IDLE)):
        key = (int(table.kind[t, s, lane]), int(s), int(table.chunk[t, s, lane]), int(table.mb[t, s, lane]))
        out[key] = (int(t), int(lane))
    return out


def buffers(table: Table) -> Buffers:
    """Assign buffer slots. An activation sent by F at slot t arrives at t + 1 and is kept until the
    receiver's last action on it (B; W where the backward is split: the weight gradient needs the input);
    a gradient sent by B at t arrives at t + 1 and is kept until the receiver's B (and W). A buffer
    slot read in slot t is free from t + 1."""
    P, V, where = table.stages, table.repeats, table.placement
    at = _where(table)
    arrive = {(n, src): np.full(table.kind.shape[:2], -1, np.int32) for n in "xg" for src in ("down", "up", "own")}
    x_read, g_read = (np.full(table.kind.shape, -1, np.int32) for _ in range(2))
    intervals = {"x": [[] for _ in range(P)], "g": [[] for _ in range(P)]}  # (arrive, last use, key, source)
    last_use = lambda s, v, i: max(at[(k, s, v, i)][0] for k in (FWD, BWD, WGT) if (k, s, v, i) in at)
    source = lambda k, s, v, d: "own" if d == s else ("down" if sends_down(k, v, where) else "up")
    for (k, s, v, i), (t, _) in at.items():
        if k == FWD and (dst := next_virtual(s, v, P, V, where)) is not None:
            intervals["x"][dst[0]].append((t + 1, last_use(dst[0], dst[1], i), (dst[1], i), source(k, s, v, dst[0])))
        if k == BWD and (src := prev_virtual(s, v, P, where)) is not None:
            intervals["g"][src[0]].append((t + 1, last_use(src[0], src[1], i), (src[1], i), source(k, s, v, src[0])))
    sizes = {}
    for name, read in (("x", x_read), ("g", g_read)):
        size = 0
        for s in range(P):
            free_from: list[int] = []  # per buffer slot: first slot it may be written again
            for start, end, (v, i), src in sorted(intervals[name][s]):
                slot = next((j for j, f in enumerate(free_from) if f <= start), len(free_from))
                if slot == len(free_from):
                    free_from.append(0)
                free_from[slot] = end + 1
                assert arrive[(name, src)][start, s] == -1, "two arrivals in one slot"
                arrive[(name, src)][start, s] = slot
                for k in (FWD, BWD, WGT) if name == "x" else (BWD, WGT):  # F reads x; B and W x and g
                    if (k, s, v, i) in at:
                        t2, lane = at[(k, s, v, i)]
                        read[t2, s, lane] = slot
            size = max(size, len(free_from))
        sizes[name] = max(size, 1)
    return Buffers(arrive, x_read, g_read, sizes["x"], sizes["g"])


def in_flight(table: Table) -> np.ndarray:
    """Per stage, the most micro-batches (of any chunk) at once between their first action there (F; B
    at a last stage without F) and their last (B; W where the backward is split)."""
    out = np.zeros(table.stages, np.int32)
    span: dict[tuple, list[int]] = {}  # (stage, chunk, micro-batch) -> [first slot, last slot]
    for (_, s, v, i), (t, _) in _where(table).items():
        first_last = span.setdefault((s, v, i), [t, t])
        first_last[0], first_last[1] = min(first_last[0], t), max(first_last[1], t)
    live = np.zeros((table.slots + 1, table.stages), np.int32)
    for (s, _, _), (a, b) in span.items():
        live[a, s] += 1
        live[b + 1, s] -= 1
    out[:] = np.cumsum(live, axis=0).max(axis=0)
    return out
