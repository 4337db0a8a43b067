"""Each pipeline schedule's *order* per stage: the actions (kind, chunk v, micro-batch i) stage s runs, in
sequence (torch's `_calculate_single_rank_operations`); `jaxdist.parallel.schedules.simulate` places them
on lock-step slots, and `jaxdist.parallel.schedule_registry` names which order each schedule uses.

- 1f1b (PipeDream-Flush, Narayanan et al. 2021): stage s runs min(P-1-s, M) forwards, then alternates
  one forward and one backward, then drains the backwards. At most P - s micro-batches in flight.
- interleaved_1f1b (Narayanan et al. 2021, torch's ScheduleInterleaved1F1B with M a multiple of P):
  V chunks per stage; forwards visit chunks in rounds of P micro-batches; warm-up
  (V-1) P + 2 (P-1-s) forwards.
- 1f1b_paired: 1F1B's orders on two lanes: in each slot a stage may run one forward (lane 0) and
  one backward (lane 1), so the steady state runs F and B of different micro-batches in the same slot.
  A backward may use its own stage's forward of the same slot (it recomputes from the saved input).
- gpipe: all forwards, then all backwards (the reference the 1F1B family is compared with).
- zb_h1 (zero bubble H1, Qi et al. 2024): the backward split in two actions, B (the input gradient, sent
  on at once) and W (the weight gradient, from the kept input and the kept arrived gradient), so W's
  can wait and fill the slots where 1F1B waits for a gradient. The last stage runs no F (its B
  recomputes the stage and the loss from the input anyway). Orders from a lock-step list schedule
  (`zb_h1_orders`): B first, else F while at most P + 1 micro-batches are between their F and their W
  on the stage, else the oldest W.
"""

from __future__ import annotations

from jaxdist.errors import JaxdistError
from jaxdist.parallel.schedules import BWD, FWD, WGT, Orders


def _interleave(fwd: list, bwd: list, warm: int) -> list:
    """`warm` forwards, then one forward and one backward in turn, then the remaining backwards."""
    order = fwd[:warm]
    for k in range(len(fwd) - warm):
        order += [fwd[warm + k], bwd[k]]
    return order + bwd[len(fwd) - warm :]


def gpipe_orders(stages: int, microbatches: int, repeats: int = 1) -> Orders:
    """All forwards (chunk by chunk), then all backwards (the reference the 1F1B family is compared with)."""
    P, M, V = stages, microbatches, repeats
    fs = [(FWD, v, i) for v in range(V) for i in range(M)]
    return [fs + [(BWD, v, i) for v in reversed(range(V)) for i in range(M)] for _ in range(P)]


def one_f_one_b_orders(stages: int, microbatches: int, repeats: int = 1) -> Orders:
    """PipeDream-Flush: stage s runs min(P-1-s, M) forwards, then alternates, then drains (one chunk)."""
    P, M = stages, microbatches
    fwd = [(FWD, 0, i) for i in range(M)]
    bwd = [(BWD, 0, i) for i in range(M)]
    return [_interleave(fwd, bwd, min(P - 1 - s, M)) for s in range(P)]


def interleaved_orders(stages: int, microbatches: int, repeats: int = 1) -> Orders:
    """Megatron's interleaved 1F1B: V chunks per stage, forwards in rounds of P micro-batches."""
    P, M, V = stages, microbatches, repeats
    if M % P:
        raise JaxdistError(
            f"interleaved_1f1b needs pipeline.microbatches a multiple of pp={P} (got {M}); "
            f"use pipeline.microbatches={P * max(1, M // P)}"
        )
    # op k: micro-batch round k // (P V), chunk (k // P) % V (reversed for backwards)
    mb = lambda k: (k // (P * V)) * P + k % P
    fwd = [(FWD, (k // P) % V, mb(k)) for k in range(M * V)]
    bwd = [(BWD, V - 1 - (k // P) % V, mb(k)) for k in range(M * V)]
    return [_interleave(fwd, bwd, min((V - 1) * P + 2 * (P - 1 - s), M * V)) for s in range(P)]


def zb_h1_orders(stages: int, microbatches: int, repeats: int = 1) -> Orders:
    """Zero bubble H1: B (input gradient) and W (weight gradient) apart. Lock-step list scheduling: in
    each slot a stage runs its next B if its gradient has arrived, else its next F if its input has and
    fewer than P + 1 micro-batches are between their F and their W on it, else its oldest pending W.
    The last stage runs no F. At P=4, M=8: 26 slots (1F1B: 22 of F and B, 16 per stage; this 24 per
    stage), stage 0 idle 2 of 26 against 1F1B's 6 of 22 (tests/test_pipeline_schedules.py)."""
    P, M = stages, microbatches
    if repeats != 1:
        raise JaxdistError(f"zb_h1 runs one chunk per stage (got pipeline.repeats={repeats}); set pipeline.repeats=1")
    limit = P + 1
    never = 1 << 62
    slot_f, slot_b = [[never] * M for _ in range(P)], [[never] * M for _ in range(P)]  # per stage, mb: its slot
    nf, nb, nw = [0] * P, [0] * P, [0] * P
    orders: Orders = [[] for _ in range(P)]
    t = 0
    while any(n < M for n in nw):
        ran = []
        for s in range(P):
            i, j, k = nb[s], nf[s], nw[s]
            if i < M and (slot_f[s - 1][i] < t if s == P - 1 else slot_f[s][i] < t and slot_b[s + 1][i] < t):
                ran.append((BWD, s, i))
            elif s < P - 1 and j < M and j - k < limit and (s == 0 or slot_f[s - 1][j] < t):
                ran.append((FWD, s, j))
            elif k < i and slot_b[s][k] < t:
                ran.append((WGT, s, k))
        for kind, s, i in ran:
            orders[s].append((kind, 0, i))
            if kind == FWD:
                slot_f[s][i], nf[s] = t, nf[s] + 1
            elif kind == BWD:
                slot_b[s][i], nb[s] = t, nb[s] + 1
            else:
                nw[s] += 1
        if not ran:
            raise JaxdistError(f"zb_h1 list schedule stalls at slot {t} (P={P}, M={M})")
        t += 1
    return orders
