"""Static pipeline schedule tables: per slot and per stage, forward / backward of which micro-batch, or idle.

Pure Python and numpy; `jaxdist.parallel.pipeline_1f1b` executes a table inside one SPMD program.

A schedule is first an *order* per stage (the actions stage s runs, in sequence: torch's
`_calculate_single_rank_operations`), then `simulate` places the orders on lock-step slots: in each
slot every stage runs its next action if that action's inputs were produced in an earlier slot, else
it idles. Actions are (kind, chunk v, micro-batch i). Stage s, chunk v is virtual stage v P + s
(the circular layout of `jaxdist.parallel.pipeline.to_stages`): F(v, i) at s needs F of the previous
virtual stage, B(v, i) needs its own F and B of the next virtual stage (the last one: the loss).

- 1f1b (PipeDream-Flush, Narayanan et al. 2021): stage s runs min(P-1-s, M) forwards, then alternates
  one forward and one backward, then drains the backwards. At most P - s micro-batches in flight.
- interleaved_1f1b (Narayanan et al. 2021, torch's ScheduleInterleaved1F1B with M a multiple of P):
  V chunks per stage; forwards visit chunks in rounds of P micro-batches; warm-up
  (V-1) P + 2 (P-1-s) forwards.
- gpipe: all forwards, then all backwards (the reference the 1F1B family is compared with).

A slot is the unit of the table. In one SPMD program all stages advance slot by slot together, so a
slot costs the slowest action any stage runs in it (max(F, B) once forwards and backwards mix).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxdist.errors import JaxdistError

IDLE, FWD, BWD = 0, 1, 2
SCHEDULES = ("1f1b", "interleaved_1f1b")  # run by tables (the other names run by autodiff: pipeline.py)


def orders(schedule: str, stages: int, microbatches: int, repeats: int = 1) -> list[list[tuple[int, int, int]]]:
    """Per stage, its actions (kind, chunk, micro-batch) in execution order."""
    P, M, V = stages, microbatches, repeats
    out = []
    for s in range(P):
        if schedule == "gpipe":
            fs = [(FWD, v, i) for v in range(V) for i in range(M)]
            out.append(fs + [(BWD, v, i) for v in reversed(range(V)) for i in range(M)])
            continue
        if schedule == "1f1b":
            fwd = [(FWD, 0, i) for i in range(M)]
            bwd = [(BWD, 0, i) for i in range(M)]
            warm = min(P - 1 - s, M)
        elif schedule == "interleaved_1f1b":
            if M % P:
                raise JaxdistError(
                    f"interleaved_1f1b needs pipeline.microbatches a multiple of pp={P} (got {M}); "
                    f"use pipeline.microbatches={P * max(1, M // P)}"
                )
            # op k: micro-batch round k // (P V), chunk (k // P) % V (reversed for backwards)
            mb = lambda k: (k // (P * V)) * P + k % P
            fwd = [(FWD, (k // P) % V, mb(k)) for k in range(M * V)]
            bwd = [(BWD, V - 1 - (k // P) % V, mb(k)) for k in range(M * V)]
            warm = min((V - 1) * P + 2 * (P - 1 - s), M * V)
        else:
            raise JaxdistError(f"unknown pipeline schedule {schedule!r}; use one of gpipe, {', '.join(SCHEDULES)}")
        order = fwd[:warm]
        for k in range(len(fwd) - warm):
            order += [fwd[warm + k], bwd[k]]
        out.append(order + bwd[len(fwd) - warm :])
    return out


@dataclasses.dataclass(frozen=True)
class Table:
    """A placed schedule: arrays (slots, P). kind: IDLE/FWD/BWD; chunk, mb: of the action (0 when idle)."""

    stages: int
    microbatches: int
    repeats: int
    kind: np.ndarray
    chunk: np.ndarray
    mb: np.ndarray

    @property
    def slots(self) -> int:
        return self.kind.shape[0]

    @property
    def bubble_fraction(self) -> float:
        """Idle slots / all slots, per stage (the same on every stage for these schedules: max over them)."""
        return float((self.kind == IDLE).sum(axis=0).max() / self.slots)

    def render(self) -> str:
        """One row per stage: F3 = forward of micro-batch 3, b = backward, '.' idle; chunk as a suffix."""
        rows = []
        for s in range(self.stages):
            cells = []
            for t in range(self.slots):
                k, v, i = self.kind[t, s], self.chunk[t, s], self.mb[t, s]
                cell = "." if k == IDLE else ("F" if k == FWD else "B") + str(i) + (f"/{v}" if self.repeats > 1 else "")
                cells.append(f"{cell:>{4 + 2 * (self.repeats > 1)}}")
            rows.append(f"s{s}" + "".join(cells))
        return "\n".join(rows)


def prev_virtual(s: int, v: int, P: int):
    """The virtual stage feeding (s, v) (None: the first, fed by the embedding)."""
    if s > 0:
        return s - 1, v
    return (P - 1, v - 1) if v > 0 else None


def next_virtual(s: int, v: int, P: int, V: int):
    """The virtual stage (s, v) feeds (None: the last, which feeds the loss)."""
    if s < P - 1:
        return s + 1, v
    return (0, v + 1) if v < V - 1 else None


def simulate(order: list[list[tuple[int, int, int]]], stages: int, microbatches: int, repeats: int = 1) -> Table:
    """Place per-stage orders on lock-step slots (each stage in order; an action waits for its inputs)."""
    P, V = stages, repeats
    done: dict[tuple, int] = {}  # (kind, s, v, i) -> slot
    ptr = [0] * P
    rows = []
    while any(ptr[s] < len(order[s]) for s in range(P)):
        t = len(rows)
        row = [(IDLE, 0, 0)] * P
        for s in range(P):
            if ptr[s] == len(order[s]):
                continue
            k, v, i = order[s][ptr[s]]
            if k == FWD:
                src = prev_virtual(s, v, P)
                deps = [] if src is None else [(FWD, src[0], src[1], i)]
            else:
                dst = next_virtual(s, v, P, V)
                deps = [(FWD, s, v, i)] + ([] if dst is None else [(BWD, dst[0], dst[1], i)])
            if all(done.get(d, t) < t for d in deps):
                row[s] = (k, v, i)
        for s in range(P):
            if row[s][0] != IDLE:
                done[(row[s][0], s, row[s][1], row[s][2])] = t
                ptr[s] += 1
        if all(r[0] == IDLE for r in row):
            raise JaxdistError(f"pipeline schedule deadlocks at slot {t} (stage orders {order})")
        rows.append(row)
    a = np.array(rows, dtype=np.int32)  # (slots, P, 3)
    return Table(P, microbatches, V, a[..., 0], a[..., 1], a[..., 2])


def build(schedule: str, stages: int, microbatches: int, repeats: int = 1) -> Table:
    return simulate(orders(schedule, stages, microbatches, repeats), stages, microbatches, repeats)


# ---- what the executor needs: where each stage's inputs and gradients wait ----------------------------


@dataclasses.dataclass(frozen=True)
class Buffers:
    """Per (slot, stage): the buffer slot an arriving activation (x_in) / gradient (g_in) is written
    to (-1: nothing arrives), and the slots the stage's action reads (x_read, g_read). Sizes: the most
    activations / gradients any stage holds at once."""

    x_in: np.ndarray
    g_in: np.ndarray
    x_read: np.ndarray
    g_read: np.ndarray
    x_size: int
    g_size: int


def _where(table: Table) -> dict[tuple, int]:
    out = {}
    for t in range(table.slots):
        for s in range(table.stages):
            if table.kind[t, s] != IDLE:
                out[(int(table.kind[t, s]), s, int(table.chunk[t, s]), int(table.mb[t, s]))] = t
    return out


def buffers(table: Table) -> Buffers:
    """Assign buffer slots. An activation sent by F at slot t arrives at t + 1 and is kept until the
    receiver's B of it (the backward recomputes the stage from it); a gradient sent by B at t arrives
    at t + 1 and is kept until the receiver's B. A buffer slot read in slot t is free from t + 1."""
    P, V = table.stages, table.repeats
    at = _where(table)
    shape = table.kind.shape
    x_in, g_in, x_read, g_read = (np.full(shape, -1, np.int32) for _ in range(4))
    intervals = {"x": [[] for _ in range(P)], "g": [[] for _ in range(P)]}  # (arrive, last use, key)
    for (k, s, v, i), t in at.items():
        if k == FWD and (dst := next_virtual(s, v, P, V)) is not None:
            intervals["x"][dst[0]].append((t + 1, at[(BWD, dst[0], dst[1], i)], (dst[1], i)))
        if k == BWD and (src := prev_virtual(s, v, P)) is not None:
            intervals["g"][src[0]].append((t + 1, at[(BWD, src[0], src[1], i)], (src[1], i)))
    sizes = {}
    for name, arrive, read in (("x", x_in, x_read), ("g", g_in, g_read)):
        size = 0
        for s in range(P):
            free_from: list[int] = []  # per buffer slot: first slot it may be written again
            for start, end, (v, i) in sorted(intervals[name][s]):
                slot = next((j for j, f in enumerate(free_from) if f <= start), len(free_from))
                if slot == len(free_from):
                    free_from.append(0)
                free_from[slot] = end + 1
                arrive[start, s] = slot
                # every action of (s, v, i) that reads this buffer: F reads x, B reads x and g
                for (k2, s2, v2, i2), t2 in at.items():
                    if (s2, v2, i2) == (s, v, i) and (name == "x" or k2 == BWD):
                        read[t2, s] = slot
            size = max(size, len(free_from))
        sizes[name] = max(size, 1)
    return Buffers(x_in, g_in, x_read, g_read, sizes["x"], sizes["g"])


def in_flight(table: Table) -> np.ndarray:
    """Per stage, the most micro-batches (of any chunk) forwarded but not yet backwarded at once."""
    out = np.zeros(table.stages, np.int32)
    for s in range(table.stages):
        live = 0
        for t in range(table.slots):
            k = table.kind[t, s]
            live += int(k == FWD)
            out[s] = max(out[s], live)
            live -= int(k == BWD)
    return out


def check(table: Table) -> None:
    """The invariants every executed table must hold (raises AssertionError): each F and B of every
    (stage, chunk, micro-batch) exactly once; F after the previous virtual stage's F, B after its own
    F and the next virtual stage's B, each in a strictly earlier slot."""
    P, M, V = table.stages, table.microbatches, table.repeats
    seen: dict[tuple, int] = {}
    for t in range(table.slots):
        for s in range(P):
            if table.kind[t, s] != IDLE:
                key = (int(table.kind[t, s]), s, int(table.chunk[t, s]), int(table.mb[t, s]))
                assert key not in seen, f"{key} runs twice"
                seen[key] = t
    want = {(k, s, v, i) for k in (FWD, BWD) for s in range(P) for v in range(V) for i in range(M)}
    assert set(seen) == want, f"missing {sorted(want - set(seen))[:4]}, extra {sorted(set(seen) - want)[:4]}"
    for (k, s, v, i), t in seen.items():
        if k == FWD and (src := prev_virtual(s, v, P)) is not None:
            assert seen[(FWD, *src, i)] < t, f"F{i} at stage {s} chunk {v} before its input"
        if k == BWD:
            assert seen[(FWD, s, v, i)] < t, f"B{i} at stage {s} chunk {v} before its forward"
            if (dst := next_virtual(s, v, P, V)) is not None:
                assert seen[(BWD, *dst, i)] < t, f"B{i} at stage {s} chunk {v} before its gradient"
