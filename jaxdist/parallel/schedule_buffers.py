"""Where a schedule table's data waits (what `jaxdist.parallel.pipeline_1f1b` executes and the planner sizes):
the buffer slot each stage's arriving activation and gradient is written to and each action reads
(`buffers`: an activation sent by F at slot t arrives at t + 1 and is kept until its receiver's last
action on it), and the micro-batches in flight per stage (`in_flight`). The tables themselves:
jaxdist/parallel/schedules.py.
"""

from __future__ import annotations

import dataclasses
import heapq

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
    t, s, lane = np.nonzero(table.kind != IDLE)
    keys = zip(
        table.kind[t, s, lane].tolist(), s.tolist(), table.chunk[t, s, lane].tolist(), table.mb[t, s, lane].tolist()
    )
    return dict(zip(keys, zip(t.tolist(), lane.tolist())))


def _intervals(table: Table, at: dict) -> dict[str, list[list[tuple]]]:
    """Per pool ("x" activations, "g" gradients) and receiving stage, its arrivals as (slot it arrives,
    slot of the receiver's last action on it, (chunk, micro-batch), source: "down" / "up" / "own")."""
    P, V, where = table.stages, table.repeats, table.placement
    last: dict[tuple, int] = {}  # (stage, chunk, micro-batch) -> the slot of its last action
    for (_, s, v, i), (t, _) in at.items():
        last[(s, v, i)] = max(t, last.get((s, v, i), -1))
    nxt = {(s, v): next_virtual(s, v, P, V, where) for s in range(P) for v in range(V)}
    prv = {(s, v): prev_virtual(s, v, P, where) for s in range(P) for v in range(V)}
    # where an output arrives from: the stage itself (V's turn), else down / up the ring (sends_down)
    source = {
        (k, s, v): "own" if d[0] == s else ("down" if sends_down(k, v, where) else "up")
        for (s, v) in nxt
        for k, d in ((FWD, nxt[(s, v)]), (BWD, prv[(s, v)]))
        if d is not None
    }
    out: dict[str, list[list[tuple]]] = {"x": [[] for _ in range(P)], "g": [[] for _ in range(P)]}
    for (k, s, v, i), (t, _) in at.items():
        if k == FWD and (dst := nxt[(s, v)]) is not None:
            out["x"][dst[0]].append((t + 1, last[(*dst, i)], (dst[1], i), source[(k, s, v)]))
        if k == BWD and (src := prv[(s, v)]) is not None:
            out["g"][src[0]].append((t + 1, last[(*src, i)], (src[1], i), source[(k, s, v)]))
    return out


def _first_fit(spans: list[tuple]) -> tuple[list[int], int]:
    """Per (start, end, ...) span, in start order, the lowest-numbered buffer free at its start (free
    from the slot after its holder's end); and how many buffers that took. A buffer freed stays free
    until taken (starts only grow), so two heaps do it: in use as (free again from, buffer), and free."""
    used: list[tuple[int, int]] = []
    free: list[int] = []
    out, count = [], 0
    for start, end, *_ in spans:
        while used and used[0][0] <= start:
            heapq.heappush(free, heapq.heappop(used)[1])
        slot = heapq.heappop(free) if free else count
        count = max(count, slot + 1)
        heapq.heappush(used, (end + 1, slot))
        out.append(slot)
    return out, count


def buffers(table: Table) -> Buffers:
    """Assign buffer slots. An activation sent by F at slot t arrives at t + 1 and is kept until the
    receiver's last action on it (B; W where the backward is split: the weight gradient needs the input);
    a gradient sent by B at t arrives at t + 1 and is kept until the receiver's B (and W). A buffer
    slot read in slot t is free from t + 1."""
    at = _where(table)
    arrive = {(n, src): np.full(table.kind.shape[:2], -1, np.int32) for n in "xg" for src in ("down", "up", "own")}
    x_read, g_read = (np.full(table.kind.shape, -1, np.int32) for _ in range(2))
    sizes = {}
    for name, per_stage in _intervals(table, at).items():
        arrivals: list[tuple[str, int, int, int]] = []  # (source, slot, stage, buffer)
        reads: list[tuple[int, int, int, int]] = []  # (slot, stage, lane, buffer)
        sizes[name] = 1
        for s, spans in enumerate(per_stage):
            spans.sort()
            slots, count = _first_fit(spans)
            sizes[name] = max(sizes[name], count)
            for (start, _, (v, i), src), slot in zip(spans, slots):
                arrivals.append((src, start, s, slot))
                for k in (FWD, BWD, WGT) if name == "x" else (BWD, WGT):  # F reads x; B and W x and g
                    if (k, s, v, i) in at:
                        reads.append((at[(k, s, v, i)][0], s, at[(k, s, v, i)][1], slot))
        for src, t, s, slot in arrivals:
            assert arrive[(name, src)][t, s] == -1, "two arrivals in one slot"
            arrive[(name, src)][t, s] = slot
        if reads:
            t, st, lane, slot = np.array(reads).T
            (x_read if name == "x" else g_read)[t, st, lane] = slot
    return Buffers(arrive, x_read, g_read, sizes["x"], sizes["g"])


@dataclasses.dataclass(frozen=True)
class Sizes:
    """`Buffers`' sizes alone: the most activations / gradients any stage holds at once."""

    x_size: int
    g_size: int


def sizes(table: Table) -> Sizes:
    """`buffers(table)`'s x_size and g_size without placing anything (what the planner reads; numpy over
    the table, no per-action Python): per stage the most arrivals live at once, each from the slot after
    its sender's action to its receiver's last action on it. `buffers` gives each arrival the
    lowest-numbered buffer free at its slot, in slot order, and on intervals that uses exactly this
    many (tests/test_pipeline_schedules.py checks both agree)."""
    P, V, M, where = table.stages, table.repeats, table.microbatches, table.placement
    t, s, lane = np.nonzero(table.kind != IDLE)
    k, v, i = table.kind[t, s, lane], table.chunk[t, s, lane], table.mb[t, s, lane]
    last = np.full((P, V, M), -1, np.int64)  # per (stage, chunk, micro-batch): its last action's slot
    np.maximum.at(last, (s, v, i), t)
    out = []
    for kind, link in ((FWD, next_virtual), (BWD, lambda s, v, P, V, w: prev_virtual(s, v, P, w))):
        to = np.full((P, V, 2), -1, np.int64)  # where (stage, chunk)'s output of this kind goes
        for a in range(P):
            for c in range(V):
                d = link(a, c, P, V, where)
                to[a, c] = d if d is not None else (-1, -1)
        sel = k == kind
        ds, dv = to[s[sel], v[sel], 0], to[s[sel], v[sel], 1]
        keep = ds >= 0
        start, ds, dv, mb = t[sel][keep] + 1, ds[keep], dv[keep], i[sel][keep]
        live = np.zeros((table.slots + 2, P), np.int64)  # +1 at arrival, -1 the slot after its last use
        np.add.at(live, (start, ds), 1)
        np.add.at(live, (last[ds, dv, mb] + 1, ds), -1)
        out.append(max(int(np.cumsum(live, axis=0).max()), 1))
    return Sizes(*out)


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
