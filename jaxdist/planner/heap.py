"""What XLA's temp bytes are made of: its heap packing, read from the buffer-assignment dump.

`compiled.memory_analysis().temp_size_in_bytes` is one preallocated allocation (XLA:CPU; GPUs do the
same), into which the heap simulator packs every temporary buffer at a fixed offset for its whole live
range (best fit over buffers sorted by size or by live-range length: a heuristic). Its size is the
highest offset + size it used, which is above the bytes ever live at once whenever a buffer had to go
above a gap that was free only for part of its life. The planner models the bytes live at once (the
live set); this module measures both sides of the difference from XLA's own dump
(`--xla_dump_to=DIR`, files `*buffer-assignment.txt` and `*live-range.txt`, as
`scripts/plan_check.py --dump` writes them):

  heap      the preallocated temp allocation's size (= temp_size_in_bytes)
  occupied  the most bytes of it in use at one instruction: the union of the address ranges of the
            values live there (values that share a buffer in place, e.g. a loop-carried array and its
            dynamic-update-slice, occupy one range)

XLA's own live-range "peak" (the `Live ranges at N (peak)` list) sums every live value of the program,
arguments, outputs and values aliased into the donated parameters' buffers included, so it is not the
temp allocation's occupancy.
"""

from __future__ import annotations

import dataclasses
import re

_VALUE = re.compile(r"value: <\d+ ([\w.\-]+)(?:\{([\d,]*)\})? @\d+> \(size=(\d+),offset=(\d+)\)")
_RANGE = re.compile(r"^\s+([\w.\-]+)\{([\d,]*)\}:(\d+)-(\d+)$", re.M)


@dataclasses.dataclass(frozen=True)
class Packing:
    heap: int  # bytes of the preallocated temp allocation
    occupied: int  # most bytes of it in use at one instruction
    at: int  # that instruction's position in the schedule

    @property
    def waste(self) -> float:
        """heap / occupied - 1: what the packing adds above the live set."""
        return self.heap / self.occupied - 1


def temp_values(buffer_assignment: str) -> tuple[int, list[tuple[str, str, int, int]]]:
    """(size of the preallocated temp allocation, its values as (name, shape index, size, offset))."""
    head = re.search(r"^allocation \d+: size (\d+), preallocated-temp:$", buffer_assignment, re.M)
    if head is None:
        raise ValueError("no preallocated-temp allocation in this buffer assignment")
    block = buffer_assignment[head.end() :].split("\nallocation ")[0]
    values = [(m[1], m[2] or "", int(m[3]), int(m[4])) for m in _VALUE.finditer(block)]
    return int(head[1]), values


def live_ranges(live_range: str) -> dict[tuple[str, str], tuple[int, int]]:
    """{(value name, shape index): (first, last) instruction where it is live} from the BufferLiveRange list."""
    body = live_range.split("BufferLiveRange:")[1].split("Live ranges at")[0]
    return {(m[1], m[2]): (int(m[3]), int(m[4])) for m in _RANGE.finditer(body)}


def packing(buffer_assignment: str, live_range: str) -> Packing:
    heap, values = temp_values(buffer_assignment)
    ranges = live_ranges(live_range)
    spans = []
    for name, index, size, offset in values:
        if (name, index) not in ranges:
            raise ValueError(f"value {name}{{{index}}} of the temp allocation has no live range")
        spans.append((*ranges[name, index], offset, offset + size))
    events = sorted({t for a, b, _, _ in spans for t in (a, b)})
    best = (0, 0)
    for t in events:  # occupancy changes only where a range starts or ends
        chunks = sorted((lo, hi) for a, b, lo, hi in spans if a <= t <= b)
        used, end = 0, 0
        for lo, hi in chunks:
            if hi > end:
                used += hi - max(lo, end)
                end = hi
        best = max(best, (used, -t))
    return Packing(heap, best[0], -best[1])
