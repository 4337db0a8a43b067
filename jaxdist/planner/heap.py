"""What XLA's temp bytes are made of, from its own heap simulation (compile with
`--xla_dump_to=DIR --xla_dump_hlo_as_proto`: `*after_optimizations.hlo.pb`, as
`scripts/memory/plan_check.py --dump` writes it).

`compiled.memory_analysis().temp_size_in_bytes` is one preallocated allocation into which XLA's heap
simulator places every temporary buffer. The dump's HloProto carries the simulator's trace: each
buffer's allocation, its sharing of another's chunk (an in-place update, a loop-carried value) and
its release, in schedule order. Replaying it gives the bytes live at each step and which buffers make
up the peak — the simulator's own live set, which the planner models. On the checked pairs the
allocation is 0.0-1.8% above the peak, at most 8.7% (the naive loss at V=8192): the packing wastes
little.

The text dumps' `*live-range.txt` is not this: its per-value ranges end where a value's last use is,
while the simulator holds a chunk until every value sharing it is dead (measured: a tp=4 pair whose
live-range union peaks at 21.6 MB has 26.9 MB live in the simulator, its whole allocation).

Not every temporary value is in temp: XLA's buffer assignment also places values in donated
parameter buffers while these hold nothing live (the old AdamW moments, once copied at the step's
start, until the update writes the new ones: jaxdist.planner.temporaries.moment_copy_bytes).
`donated_live` reads the text dumps (`--xla_dump_hlo_as_text`: the buffer assignment and the live
ranges) for the bytes of such values live at the simulator's peak.

The proto is read with a minimal wire-format decoder (no schema is installed with jaxlib); field
numbers are those of xla/service/hlo.proto.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

# xla/service/hlo.proto
HLO_PROTO_BUFFER_ASSIGNMENT = 3
BA_LOGICAL_BUFFERS, BA_HEAP_TRACES = 1, 4
LB_ID, LB_SIZE = 1, 2
TRACE_EVENTS = 1
EV_KIND, EV_BUFFER, EV_INSTRUCTION, EV_SHARE_WITH = 1, 2, 4, 5  # the event's instruction
ALLOC, FREE, SHARE_WITH = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Peak:
    live: int  # bytes the heap simulator holds at its peak
    buffers: tuple[tuple[str, int], ...]  # (defining instruction, bytes) of the chunks live there, largest first
    at: str = ""  # the instruction of the trace event that reached the peak


def fields(data: bytes) -> list[tuple[int, Any]]:
    """One protobuf message's (field number, value) pairs: ints for varints, bytes for the rest (the
    caller knows which from the schema: Any, not int | bytes, so no field read needs a check)."""
    out, i = [], 0
    while i < len(data):
        key, i = _varint(data, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(data, i)
        elif wire == 2:
            n, i = _varint(data, i)
            value, i = data[i : i + n], i + n
        elif wire in (1, 5):
            n = 8 if wire == 1 else 4
            value, i = data[i : i + n], i + n
        else:
            raise ValueError(f"protobuf wire type {wire} is not supported")
        out.append((number, value))
    return out


def simulator_peaks(hlo_proto: bytes) -> list[Peak]:
    """The peak of each heap-simulator trace in a dumped HloProto (one per simulated allocation)."""
    (assignment,) = [v for f, v in fields(hlo_proto) if f == HLO_PROTO_BUFFER_ASSIGNMENT]
    size: dict[int, int] = {}
    for f, v in fields(assignment):
        if f == BA_LOGICAL_BUFFERS:
            d = dict(fields(v))
            size[d.get(LB_ID, 0)] = d.get(LB_SIZE, 0)
    traces = [fields(v) for f, v in fields(assignment) if f == BA_HEAP_TRACES]
    return [_replay([dict(fields(v)) for f, v in t if f == TRACE_EVENTS], size) for t in traces]


def _replay(events: list[dict[int, Any]], size: dict[int, int]) -> Peak:
    """Bytes live after each event. A chunk is named by its canonical buffer (SHARE_WITH's
    share_with_canonical_id, which need not be live or allocated itself) and counts from the first
    buffer using it to the last one's FREE, at the canonical buffer's size."""
    chunk_of: dict[int, int] = {}  # buffer -> the canonical buffer of the chunk it uses
    members: dict[int, set] = {}  # live chunk -> buffers using it
    name: dict[int, str] = {}
    live = best = 0
    best_set: tuple = ()
    best_at = ""
    for e in events:
        kind, buf = e.get(EV_KIND, ALLOC), e.get(EV_BUFFER, 0)
        if kind in (ALLOC, SHARE_WITH):
            if kind == ALLOC:
                chunk = buf
            else:
                share: int = e[EV_SHARE_WITH]
                chunk = chunk_of.get(share, share)
            if chunk not in members:
                members[chunk] = set()
                live += size.get(chunk, 0)
                name.setdefault(chunk, e.get(EV_INSTRUCTION, b"?").decode())  # where it is defined
            chunk_of[buf] = chunk
            members[chunk].add(buf)
        elif kind == FREE and chunk_of.get(buf) in members:
            chunk = chunk_of.pop(buf)
            members[chunk].discard(buf)
            if not members[chunk]:
                del members[chunk]
                live -= size.get(chunk, 0)
        if live > best:
            best, best_set, best_at = live, tuple(members), e.get(EV_INSTRUCTION, b"?").decode()
    buffers = sorted(((name.get(c, "?"), size.get(c, 0)) for c in best_set), key=lambda x: -x[1])
    return Peak(best, tuple(buffers), best_at)


def donated_live(buffer_assignment: str, live_range: str, at: str) -> tuple[int, tuple[tuple[str, int], ...]]:
    """(bytes, (value, bytes) largest first) of the values live at instruction `at` that XLA placed in
    donated parameter buffers (allocations of a parameter that may be live out), from the text dumps
    `*buffer-assignment.txt` and `*live-range.txt` (a value's range: first to last schedule position)."""
    position = dict(re.findall(r"^\s+(\d+):(\S+)$", live_range, re.M))
    where = {name: int(p) for p, name in position.items()}[at]
    ranges = {n: (int(a), int(b)) for n, a, b in re.findall(r"^\s+(\S+):(\d+)-(\d+)$", live_range, re.M)}
    donated, found = False, []
    for line in buffer_assignment.splitlines():
        if line.startswith("allocation"):
            donated = ", parameter " in line and "maybe-live-out" in line
        elif donated and (m := re.match(r"\s*value: <\d+ (\S+)(?: \(phi\))? @\d+> \(size=(\d+)", line)):
            start, end = ranges.get(m.group(1), (-1, -1))
            if start <= where <= end:
                found.append((m.group(1), int(m.group(2))))
    return sum(b for _, b in found), tuple(sorted(found, key=lambda x: -x[1]))


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, i
