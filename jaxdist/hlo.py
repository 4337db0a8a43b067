"""Collectives read from a compiled program's HLO text: kind, bytes, replica groups, loop trip counts.

This is how jaxdist makes communication claims: exact and repeatable on CPU. Bytes sent per device
use the standard ring model (N = group size, S = the full, gathered size in bytes):
all-reduce 2(N-1)/N·S; all-gather and reduce-scatter (N-1)/N·S; all-to-all (N-1)/N·S;
collective-permute S. A collective inside a `while` body counts once per iteration (XLA's
`known_trip_count`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
               "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}

_COMP_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")
_SHAPE_RE = re.compile(r"\b(pred|[suf]\d+|bf16|c64|c128|f8e4m3fn|f8e5m2)\[([\d,]*)\]")
_CALLS_RE = re.compile(r"\b(calls|to_apply|body|condition)=%?([\w.\-]+)|branch_computations=\{([^}]*)\}")
_TRIP_RE = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str
    result_bytes: int  # bytes of the (per-device) result buffer
    group_size: int
    groups: tuple[tuple[int, ...], ...]  # device ids per group; () if unknown
    count: int  # executions per program run (loop trip counts multiplied in)
    computation: str

    @property
    def full_bytes(self) -> int:
        """S of the ring model: the full (gathered / unscattered) size."""
        return self.result_bytes * self.group_size if self.kind == "reduce-scatter" else self.result_bytes

    @property
    def sent_bytes(self) -> float:
        """Bytes each device sends for one execution (ring model)."""
        n, s = self.group_size, self.full_bytes
        if self.kind == "collective-permute":
            return float(s)
        if n <= 1:
            return 0.0
        return (2.0 if self.kind == "all-reduce" else 1.0) * (n - 1) / n * s


def shape_bytes(text: str) -> list[int]:
    return [DTYPE_BYTES[dt] * math.prod(int(d) for d in dims.split(",") if d) for dt, dims in _SHAPE_RE.findall(text)]


def _iota(dims: list[int], perm: list[int] | None, reshape: list[int] | None = None) -> np.ndarray:
    ids = np.arange(math.prod(dims)).reshape(dims)
    if perm:
        ids = ids.transpose(perm)
    return ids.reshape(reshape) if reshape else ids


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_groups(attrs: str) -> tuple[tuple[int, ...], ...]:
    """replica_groups in any of XLA's three spellings: {{0,1},{2,3}}, [2,2]<=[4]T(1,0), mesh[...] {axes}."""
    if m := re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", attrs):
        return tuple(tuple(_ints(g)) for g in re.findall(r"\{([\d,]*)\}", m.group(1)))
    if m := re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs):
        shape, dims = _ints(m.group(1)), _ints(m.group(2))
        ids = _iota(dims, _ints(m.group(3)) if m.group(3) else None, shape)
        return tuple(tuple(int(x) for x in row) for row in ids.reshape(-1, shape[-1]))
    if m := re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?"
                      r"\s*\{([^}]*)\}", attrs):
        axes = re.findall(r"'(\w+)'=(\d+)", m.group(1))
        names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
        if m.group(2):
            ids = _iota(_ints(m.group(2)), _ints(m.group(3)) if m.group(3) else None, sizes)
        else:
            ids = np.arange(math.prod(sizes)).reshape(sizes)
        group_axes = [names.index(a) for a in re.findall(r"'(\w+)'", m.group(4))]
        rest = [i for i in range(len(names)) if i not in group_axes]
        size = math.prod(sizes[i] for i in group_axes)
        ids = ids.transpose(rest + group_axes).reshape(-1, size)
        return tuple(tuple(int(x) for x in row) for row in ids)
    if m := re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", attrs):
        return tuple(tuple(_ints(p)) for p in re.findall(r"\{(\d+,\d+)\}", m.group(1)))
    return ()


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective of the program with its execution count."""
    comps: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        if m := _COMP_RE.match(line):
            current = m.group(2)
            comps[current] = []
            if m.group(1):
                entry = current
        elif current is not None:
            comps[current].append(line)

    # Propagate execution counts from ENTRY through calls; while bodies multiply by their trip count.
    counts: dict[str, int] = defaultdict(int)
    def visit(name: str, mult: int, depth: int = 0):
        if name not in comps or depth > 64:
            return
        counts[name] += mult
        for line in comps[name]:
            trip = _TRIP_RE.search(line)
            for attr, callee, branches in _CALLS_RE.findall(line):
                times = int(trip.group(1)) if trip and attr == "body" else 1
                for name in [callee] if callee else [b.strip().lstrip("%") for b in branches.split(",")]:
                    visit(name, mult * times, depth + 1)
    if entry:
        visit(entry, 1)

    found = []
    for comp, lines in comps.items():
        for line in lines:
            m = _INSTR_RE.match(line)
            if not m:
                continue
            op = m.group(3)
            kind = op[:-6] if op.endswith("-start") else op
            if kind not in KINDS:
                continue
            sizes = shape_bytes(m.group(2))
            # Async starts return (operands..., results...): count the results only.
            result = sizes[-1] if op.endswith("-start") and len(sizes) > 1 else sum(sizes)
            groups = parse_groups(line)
            n = 2 if kind == "collective-permute" else (len(groups[0]) if groups else 1)
            found.append(Collective(kind, result, n, groups, counts.get(comp, 0) or 1, comp))
    return found


def summarize(colls: list[Collective]) -> dict[str, dict[str, float]]:
    """{kind: {"count": executions per run, "bytes": bytes sent per device per run}}."""
    out = {k: {"count": 0, "bytes": 0.0} for k in KINDS}
    for c in colls:
        out[c.kind]["count"] += c.count
        out[c.kind]["bytes"] += c.count * c.sent_bytes
    return {k: v for k, v in out.items() if v["count"]}


def spans_axis(c: Collective, mesh_shape: dict[str, int], axis_order: tuple[str, ...], axis: str) -> bool:
    """Whether a collective's groups communicate across `axis` (device ids laid out row-major
    over `axis_order`, as `jaxdist.mesh` builds single-host meshes)."""
    if not c.groups or mesh_shape.get(axis, 1) == 1:
        return False
    sizes = [mesh_shape[a] for a in axis_order]
    pos = axis_order.index(axis)
    for group in c.groups:
        coords = {np.unravel_index(d, sizes)[pos] for d in group}
        if len(coords) > 1:
            return True
    return False
