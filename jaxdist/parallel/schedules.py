"""Static pipeline schedule tables: per slot and per stage, forward / backward of which micro-batch, or idle.

Pure Python and numpy; `jaxdist.parallel.pipeline_1f1b` executes a table inside one SPMD program.

A schedule is first an *order* per stage (the actions stage s runs, in sequence: torch's
`_calculate_single_rank_operations`), then `simulate` places the orders on lock-step slots: in each
slot every stage runs its next action if that action's inputs were produced in an earlier slot, else
it idles. Actions are (kind, chunk v, micro-batch i). Stage s, chunk v is virtual stage v P + s
(the circular layout of `jaxdist.parallel.pipeline.to_stages`): F(v, i) at s needs F of the previous
virtual stage, B(v, i) needs its own F and B of the next virtual stage (the last one: the loss).

Each schedule's orders: `jaxdist.parallel.schedule_orders` (zb_v's: `jaxdist.parallel.zb_v`).

A slot is the unit of the table. In one SPMD program all stages advance slot by slot together, so a
slot costs the slowest thing any stage runs in it (`lockstep_time`): one lane, max(F, B) once forwards
and backwards mix; two lanes, F + B.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxdist.errors import JaxdistError

IDLE, FWD, BWD, WGT = 0, 1, 2, 3
LETTER = {FWD: "F", BWD: "B", WGT: "W"}
Orders = list[list[tuple[int, int, int]]]  # per stage, its actions (kind, chunk, micro-batch) in execution order


@dataclasses.dataclass(frozen=True)
class Table:
    """A placed schedule: arrays (slots, P, lanes). kind: IDLE/FWD/BWD/WGT; chunk, mb: of the action (0
    when idle). One lane, or two (lane 0 forwards, lane 1 backwards) for the paired schedules."""

    stages: int
    microbatches: int
    repeats: int
    kind: np.ndarray
    chunk: np.ndarray
    mb: np.ndarray
    placement: str = "ring"  # chunk v of stage s is virtual stage v P + s; "v": s (v = 0), 2P-1-s (v = 1)

    @property
    def last(self) -> tuple[int, int]:
        """(stage, chunk) of the last virtual stage (the one that computes the loss)."""
        return last_virtual(self.stages, self.repeats, self.placement)

    @property
    def slots(self) -> int:
        return self.kind.shape[0]

    @property
    def lanes(self) -> int:
        return self.kind.shape[2]

    @property
    def split_backward(self) -> bool:
        """B computes only the input gradient and W the weight gradient (zero bubble); else B does both."""
        return bool((self.kind == WGT).any())

    @property
    def loss_without_forward(self) -> bool:
        """The last virtual stage runs no F: its B recomputes the stage from the input (zb_h1)."""
        s, v = self.last
        return not bool((self.kind[:, s] == FWD)[self.chunk[:, s] == v].any())

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the busiest stage's time in lock-step with every action of equal cost: 1 - its
        actions / time (one lane: idle slots / slots; 1F1B: 1 - 2 V M / time)."""
        busiest = int((self.kind != IDLE).sum(axis=(0, 2)).max())
        return 1.0 - busiest / lockstep_time(self, 1.0, 1.0, 1.0)

    def render(self) -> str:
        """One row per stage: F3 = forward of micro-batch 3, B = backward, '.' idle; chunk as a suffix;
        two lanes print as forward+backward."""
        rows = []
        for s in range(self.stages):
            cells = []
            for t in range(self.slots):
                parts = []
                for lane in range(self.lanes):
                    k, v, i = self.kind[t, s, lane], self.chunk[t, s, lane], self.mb[t, s, lane]
                    if k != IDLE:
                        parts.append(LETTER[int(k)] + str(i) + (f"/{v}" if self.repeats > 1 else ""))
                cell = "+".join(parts) or "."
                cells.append(f"{cell:>{(4 + 2 * (self.repeats > 1)) * self.lanes}}")
            rows.append(f"s{s}" + "".join(cells))
        return "\n".join(rows)


def lockstep_time(table: Table, f: float, b: float, w: float | None = None) -> float:
    """Step time when every stage waits for the slowest at each slot's exchange: a slot costs f if any
    stage runs a forward there, b if any runs a backward, w (default b) a weight gradient (all on one
    lane: the largest; on two lanes, one after the other: the sum)."""
    cost = {FWD: f, BWD: b, WGT: b if w is None else w}
    anyk = {k: (table.kind == k).any(axis=1) for k in cost}  # (slots, lanes)
    if table.lanes == 1:
        return float(np.max([anyk[k][:, 0] * c for k, c in cost.items()], axis=0).sum())
    return float(sum((anyk[k].any(axis=1) * c).sum() for k, c in cost.items()))


def prev_virtual(s: int, v: int, P: int, placement: str = "ring"):
    """The virtual stage feeding (s, v) (None: the first, fed by the embedding). V placement: chunk 0
    runs down the stages, chunk 1 back up (stage P-1's chunk 0 feeds its own chunk 1)."""
    if placement == "v" and v == 1:
        return (s + 1, 1) if s < P - 1 else (P - 1, 0)
    if s > 0:
        return s - 1, v
    return (P - 1, v - 1) if v > 0 else None


def next_virtual(s: int, v: int, P: int, V: int, placement: str = "ring"):
    """The virtual stage (s, v) feeds (None: the last, which feeds the loss)."""
    if placement == "v":
        if v == 1:
            return (s - 1, 1) if s > 0 else None
        return (s + 1, 0) if s < P - 1 else (P - 1, 1)
    if s < P - 1:
        return s + 1, v
    return (0, v + 1) if v < V - 1 else None


def last_virtual(P: int, V: int, placement: str = "ring") -> tuple[int, int]:
    """(stage, chunk) of the last virtual stage: stage P-1's last chunk; V placement: stage 0's chunk 1."""
    return (0, 1) if placement == "v" else (P - 1, V - 1)


def stage_groups(P: int, V: int, placement: str = "ring") -> np.ndarray:
    """(P, V): the virtual stage (layer group) stage s runs as its chunk v: v P + s; V placement: s and 2P-1-s."""
    s, v = np.arange(P)[:, None], np.arange(V)[None, :]
    return np.where(v == 0, s, 2 * P - 1 - s) if placement == "v" else v * P + s


def sends_down(kind, v, placement: str = "ring"):
    """Whether an action's output goes down the ring (to s+1 mod P), else up it (to s-1 mod P):
    forwards go down, backwards up, except V placement's chunk 1, which runs
    up the stages (its forwards go to s-1, its input gradients to s+1). (A stage feeding itself, V
    placement's turn at stage P-1, sends nothing: `buffers` keeps its own output.) Works elementwise on arrays."""
    return (kind == FWD) != ((placement == "v") & (np.asarray(v) == 1))


def _deps(
    k: int, s: int, v: int, i: int, P: int, V: int, loss_without_forward: bool = False, placement: str = "ring"
) -> list[tuple]:
    """(kind, stage, chunk, micro-batch) of what an action needs. F: the previous virtual stage's F.
    B: its own F (listed first) and the next virtual stage's B (none after the last: the loss); at a
    last virtual stage without F (`Table.loss_without_forward`), the previous virtual stage's F.
    W: its own B."""
    if k == WGT:
        return [(BWD, s, v, i)]
    src, dst = prev_virtual(s, v, P, placement), next_virtual(s, v, P, V, placement)
    if k == FWD:
        return [] if src is None else [(FWD, src[0], src[1], i)]
    if dst is None and loss_without_forward:
        return [] if src is None else [(FWD, src[0], src[1], i)]
    return [(FWD, s, v, i)] + ([] if dst is None else [(BWD, dst[0], dst[1], i)])


def _solve(streams: list, deps: dict, P: int, V: int, M: int) -> tuple[list[int], list[int], int | None]:
    """`simulate`'s slots: per action key ((kind * P + stage) * V + chunk) * M + mb its slot (-1: never
    placed), per stream its last slot, and the first slot of a stream left waiting (None: all placed).
    A stream runs on until an input is not placed yet, and resumes when that input is."""
    done = [-1] * (4 * P * V * M)
    waiting: dict[int, list[int]] = {}  # an unplaced input -> the streams stopped on it
    ptr, prev = [0] * len(streams), [-1] * len(streams)
    ready = list(range(len(streams)))
    while ready:
        n = ready.pop()
        s, _, acts = streams[n]
        while ptr[n] < len(acts):
            k, v, i = acts[ptr[n]]
            base = ((k * P + s) * V + v) * M
            t, missing = prev[n] + 1, -1
            for d, lag in deps[base]:
                if done[d + i] < 0:
                    missing = d + i
                    break
                t = max(t, done[d + i] + lag)
            if missing >= 0:
                waiting.setdefault(missing, []).append(n)
                break
            done[base + i] = prev[n] = t
            ptr[n] += 1
            ready.extend(waiting.pop(base + i, ()))
    left = [prev[n] + 1 for n, (_, _, acts) in enumerate(streams) if ptr[n] < len(acts)]
    return done, prev, min(left) if left else None


def simulate(
    order: list[list[tuple[int, int, int]]],
    stages: int,
    microbatches: int,
    repeats: int = 1,
    lanes: int = 1,
    placement: str = "ring",
) -> Table:
    """Place per-stage orders on lock-step slots: each stage runs its actions in order, an action waiting
    until its inputs were produced in an earlier slot. lanes=2: forwards and backwards are two streams
    (each in order), at most one of each per slot, and a backward may follow its own stage's forward of
    the same slot (lane 0 runs first).

    Each action's slot is the first after its stream's previous action and after its inputs' slots
    (the same slot for a two-lane backward's first input, its forward): slots are solved action by
    action, a stream waiting on an input resuming when that input is placed (linear in the actions; the
    planner builds tables of thousands of slots per candidate shape)."""
    P, V = stages, repeats
    ls, lv = last_virtual(P, V, placement)
    no_last_f = not any(a[0] == FWD and a[1] == lv for a in order[ls])
    streams = [
        (s, lane, acts)
        for s in range(P)
        for lane, acts in enumerate(
            [order[s]] if lanes == 1 else [[a for a in order[s] if a[0] == k] for k in (FWD, BWD)]
        )
    ]
    # an action (kind, stage, chunk, micro-batch) as one integer: ((kind * P + stage) * V + chunk) * M + mb
    M = max((i for acts in order for _, _, i in acts), default=-1) + 1
    key = lambda k, s, v: ((k * P + s) * V + v) * M
    # per (kind, stage, chunk): its inputs as (key of micro-batch 0, lag): slot >= the input's slot + lag
    deps: dict[int, list[tuple[int, int]]] = {}
    for s, _, acts in streams:
        for k, v, _ in acts:
            if key(k, s, v) not in deps:
                same_ok = lanes == 2 and k == BWD
                ds = _deps(k, s, v, 0, P, V, no_last_f, placement)
                deps[key(k, s, v)] = [(key(*d[:3]), 0 if same_ok and j == 0 else 1) for j, d in enumerate(ds)]
    done, prev, stuck = _solve(streams, deps, P, V, M)
    if stuck is not None:
        raise JaxdistError(f"pipeline schedule deadlocks at slot {stuck} (stage orders {order})")
    a = np.zeros((max(prev) + 1 if streams else 0, P, lanes, 3), np.int32)  # (slots, P, lanes, (kind, chunk, mb))
    slot_of = np.asarray(done)  # per action key: its slot
    for s, lane, acts in streams:
        if acts:
            act = np.array(acts, np.int64)
            a[slot_of[((act[:, 0] * P + s) * V + act[:, 1]) * M + act[:, 2]], s, lane] = act
    return Table(P, microbatches, V, a[..., 0], a[..., 1], a[..., 2], placement)


def check(table: Table) -> None:
    """The invariants every executed table must hold (raises AssertionError): each F, B (and W, where
    the backward is split) of every (stage, chunk, micro-batch) exactly once (no F at a last virtual
    stage whose B computes the loss from the input); F after the previous virtual stage's F, B after
    the next virtual stage's B, each in a strictly earlier slot (the data crosses devices between
    slots); B after its own F (in the same slot only on two lanes, where the forward lane runs first;
    without that F, after the previous virtual stage's F); W after its own B."""
    P, M, V, where = table.stages, table.microbatches, table.repeats, table.placement
    seen: dict[tuple, tuple[int, int]] = {}
    for t, s, lane in zip(*np.nonzero(table.kind != IDLE)):
        key = (int(table.kind[t, s, lane]), int(s), int(table.chunk[t, s, lane]), int(table.mb[t, s, lane]))
        assert key not in seen, f"{key} runs twice"
        seen[key] = (int(t), int(lane))
    split, no_last_f = table.split_backward, table.loss_without_forward
    kinds = (FWD, BWD, WGT) if split else (FWD, BWD)
    want = {(k, s, v, i) for k in kinds for s in range(P) for v in range(V) for i in range(M)}
    if no_last_f:
        want -= {(FWD, *table.last, i) for i in range(M)}
    assert set(seen) == want, f"missing {sorted(want - set(seen))[:4]}, extra {sorted(set(seen) - want)[:4]}"
    for (k, s, v, i), (t, lane) in seen.items():
        src = prev_virtual(s, v, P, where)
        if k == FWD and src is not None:
            assert seen[(FWD, *src, i)][0] < t, f"F{i} at stage {s} chunk {v} before its input"
        if k == WGT:
            tb, lb = seen[(BWD, s, v, i)]
            assert tb < t or (tb == t and lb < lane), f"W{i} at stage {s} chunk {v} before its B"
        if k == BWD:
            dst = next_virtual(s, v, P, V, where)
            if dst is None and no_last_f:
                assert src is None or seen[(FWD, *src, i)][0] < t, f"B{i} at stage {s} chunk {v} before its input"
            else:
                tf, lf = seen[(FWD, s, v, i)]
                assert tf < t or (tf == t and lf < lane), f"B{i} at stage {s} chunk {v} before its forward"
            if dst is not None:
                assert seen[(BWD, *dst, i)][0] < t, f"B{i} at stage {s} chunk {v} before its gradient"
