"""The ZB-V schedule's per-stage orders (zero bubble V, Qi et al. 2024): two chunks per stage in a V.

Stage s holds chunks s and 2P-1-s of the 2P virtual stages (`schedules.Table.placement` "v"): the
forward runs down the stages on chunk 0, turns at stage P-1 (which feeds its own chunk 1) and runs
back up on chunk 1, so the loss is on stage 0. The backward is split as in zb_h1: B (the input
gradient, sent on at once) and W (the weight gradient, from the kept input and arrived gradient),
and the deferred W's fill the slots where a stage would wait. The last virtual stage (stage 0, chunk
1) runs no F: its B recomputes the chunk and the loss from the input.

Orders come from a lock-step list schedule: in each slot a stage runs, if its inputs arrived in an
earlier slot, its next B (chunk 1 first: it is the earlier one in the backward), else its next F
(chunk 1 first: it brings a micro-batch to the loss) while fewer than 2P chunk micro-batches are
between their first action and their W on it (the activations of P micro-batches of a whole stage:
1F1B's peak at stage 0), else its oldest pending W. Stage 0's loss chunk starts its micro-batches with
a B, which is never held back (the backward would stall), so stage 0's forwards leave one of the 2P
free for it: at most 2P chunk micro-batches in flight on every stage (without that reserve stage 0
reached 2P + 1 at M >= 2P, one stage input more; the reserve changes no slot count from P=2 to 16).
"""

from __future__ import annotations

from jaxdist.errors import JaxdistError
from jaxdist.parallel.schedules import BWD, FWD, WGT, Orders, _deps


def _pick(s: int, M: int, nxt: dict, ready, room: bool, pending_w: list, deps: dict) -> tuple[int, int, int] | None:
    """Stage s's action this slot: its next ready B (chunk 1 first), else its next ready F (chunk 1
    first) if `room`, else its oldest W whose B ran in an earlier slot; None: it idles. `deps`: per
    (kind, stage, chunk) the (kind, stage, chunk) of its inputs (the same micro-batch's)."""
    for kind in (BWD, FWD) if room else (BWD,):
        for v in (1, 0):
            i = nxt[(kind, s, v)]
            if i < M and all(ready((*d, i)) for d in deps[(kind, s, v)]):
                return kind, v, i
    if pending_w and ready((BWD, s, *pending_w[0])):
        return (WGT, *pending_w.pop(0))
    return None


def zb_v_orders(stages: int, microbatches: int, repeats: int = 2) -> Orders:
    """Per stage its actions (kind, chunk, micro-batch), placed by the list schedule above."""
    P, M = stages, microbatches
    if repeats != 2:
        raise JaxdistError(f"zb_v runs two chunks per stage (got pipeline.repeats={repeats}); set pipeline.repeats=2")
    deps = {
        (k, s, v): [d[:3] for d in _deps(k, s, v, 0, P, 2, True, "v")]
        for k in (FWD, BWD)
        for s in range(P)
        for v in (0, 1)
    }
    done: dict[tuple, int] = {}  # (kind, stage, chunk, micro-batch) -> slot
    nxt = {(k, s, v): 0 for k in (FWD, BWD) for s in range(P) for v in (0, 1)}  # next micro-batch to run
    nxt[(FWD, 0, 1)] = M  # the loss chunk runs no F
    pending_w: list[list[tuple[int, int]]] = [[] for _ in range(P)]  # per stage (chunk, mb) whose W waits
    live = [0] * P  # chunk micro-batches between their first action and their W
    room = [2 * P - (s == 0) for s in range(P)]  # forwards' limit: stage 0 keeps one for its loss chunk's B
    orders: Orders = [[] for _ in range(P)]
    t, left = 0, P * 2 * M * 3 - M  # actions: F, B, W of every chunk and micro-batch, less the loss chunk's F
    while left:
        ready = lambda key: done.get(key, t) < t  # noqa: B023 (t is the current slot)
        ran = [(s, a) for s in range(P) if (a := _pick(s, M, nxt, ready, live[s] < room[s], pending_w[s], deps))]
        if not ran:
            raise JaxdistError(f"zb_v list schedule stalls at slot {t} (P={P}, M={M})")
        for s, (k, v, i) in ran:
            done[(k, s, v, i)] = t
            orders[s].append((k, v, i))
            if k != WGT:
                nxt[(k, s, v)] += 1
            if k == BWD:
                pending_w[s].append((v, i))
            live[s] += 1 if k == FWD or (k == BWD and (s, v) == (0, 1)) else -1 if k == WGT else 0
        left -= len(ran)
        t += 1
    return orders
