"""Collectives read from a compiled program's HLO text: kind, bytes, replica groups, loop trip counts;
and the ring model that costs them (the one home of that formula: the planner and the codecs use it).

Bytes sent per device are ring-model costs of the compiled collectives (N = group size, S = the full,
gathered / unreduced size in bytes): all-reduce 2(N-1)/N·S; all-gather, reduce-scatter and
all-to-all (N-1)/N·S; collective-permute S. S is read from the collective's *operands*, so the
synchronous form, XLA's asynchronous `-start`/`-done` pairs (`all-gather-start` returns (operands,
results); `collective-permute-start` adds u32 contexts; reduce-scatter and all-to-all run wrapped in
`async-start(..., calls=%wrapped)`) and combined collectives over several arrays all count every array
once. `replica_groups={}` means one group of all devices (read from the module header). A collective
inside a `while` body counts once per iteration (XLA's `known_trip_count`); one in a loop without a
known trip count is flagged (`Collective.trips_known`), never silently counted once.

A `conditional` (lax.cond / lax.switch) runs one of its branches per execution. `collectives` lists
every branch's collectives (each tagged with its `branch` path, for callers that pick a branch by jax
scope, as `measure.dp_bytes_per_step` does); `per_step` and `summarize` keep only the largest branch of
each conditional (by bytes sent per device): the most one step can send, never the sum of branches.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

import jax.numpy as jnp
import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# Bytes per element by HLO type name; `dtype_bytes` also takes numpy / jax names ("bfloat16").
DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
}

_COMP_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")
_SHAPE_RE = re.compile(r"\b(pred|[suf]\d+|bf16|c64|c128|f8e4m3fn|f8e5m2)\[([\d,]*)\]")
_CALLS_RE = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)"
    r"|branch_computations=\{([^}]*)\}"
)
_TRIP_RE = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
# async-done / async-update repeat the start's `calls=`: following them would count its collective twice.
_NOT_A_CALL = ("async-done", "async-update")


def ring_bytes(kind: str, n: int, full_bytes: float) -> float:
    """Bytes one device sends in a ring collective over n devices on an array of `full_bytes` (S: the
    gathered / unreduced size): all-reduce 2(N-1)/N·S, all-gather / reduce-scatter / all-to-all
    (N-1)/N·S, collective-permute S."""
    if kind == "collective-permute":
        return float(full_bytes)
    if n <= 1:
        return 0.0
    return (2.0 if kind == "all-reduce" else 1.0) * (n - 1) / n * full_bytes


def dtype_bytes(name: str) -> int:
    """Bytes per element of an HLO type name (f32, bf16, s8, ...) or a numpy / jax dtype name."""
    if name in DTYPE_BYTES:
        return DTYPE_BYTES[name]

    return jnp.dtype(name).itemsize


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str
    full_bytes: int  # S of the ring model: the full (gathered / unscattered) size, all operands together
    group_size: int
    groups: tuple[tuple[int, ...], ...]  # device ids per group; () if unknown
    count: int  # executions per program run (loop trip counts multiplied in)
    computation: str
    trips_known: bool = True  # False: inside a while loop without a known trip count (count is a floor)
    line: str = ""  # the HLO instruction (its metadata names the jax scope it came from)
    # Conditional branches it lies in, outermost first: ((computation, conditional instruction), index).
    branch: tuple = ()

    @property
    def result_bytes(self) -> int:
        """Bytes of one device's result (a reduce-scatter's shard; all operands' results together)."""
        return self.full_bytes // self.group_size if self.kind == "reduce-scatter" else self.full_bytes

    @property
    def sent_bytes(self) -> float:
        """Bytes each device sends for one execution (ring model)."""
        return ring_bytes(self.kind, self.group_size, self.full_bytes)


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
    if m := re.search(
        r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?"
        r"\s*\{([^}]*)\}",
        attrs,
    ):
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


def _type_tree(text: str):
    """An HLO result type -> nested lists of element counts x bytes: 'f32[4]' -> 16,
    '(f32[4], (s32[2], u32[]))' -> [16, [8, 4]]. Layouts and /*index=5*/ comments are dropped."""
    text = re.sub(r"/\*.*?\*/|\{[^{}]*\}", "", text)
    tokens = re.findall(r"\(|\)|\w+\[[\d,]*\]", text)
    pos = 0

    def item():
        nonlocal pos
        tok = tokens[pos]
        pos += 1
        if tok != "(":
            return sum(shape_bytes(tok)) if not tok.startswith("token[") else 0
        out = []
        while tokens[pos] != ")":
            out.append(item())
        pos += 1
        return out

    return item()


def _flat_sum(tree) -> int:
    return sum(map(_flat_sum, tree)) if isinstance(tree, list) else tree


def _result_bytes(op: str, type_text: str) -> int:
    """Bytes of a collective's results. all-gather-start and collective-permute-start return
    (operands, results, [u32 contexts]): the results are element 1; all-reduce-start and synchronous
    (possibly combined, tuple-shaped) collectives return their results."""
    tree = _type_tree(type_text)
    if op.endswith("-start") and op != "all-reduce-start":
        if not (isinstance(tree, list) and len(tree) >= 2):
            raise ValueError(f"{op} with result type {type_text!r}: expected (operands, results, ...)")
        return _flat_sum(tree[1])
    return _flat_sum(tree)


def _num_devices(hlo_text: str) -> int | None:
    header = next((line for line in hlo_text.splitlines() if line.startswith("HloModule")), "")
    found = dict(re.findall(r"\b(replica_count|num_partitions)=(\d+)", header))
    if not found:
        return None
    return int(found.get("replica_count", 1)) * int(found.get("num_partitions", 1))


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective of the program with its execution count."""
    comps, entry = _computations(hlo_text)
    counts, unknown, paths = _execution_counts(comps, entry)
    devices = _num_devices(hlo_text)
    found = []
    for comp, lines in comps.items():
        for line in lines:
            c = _collective(line, comp, devices, counts.get(comp, 0) or 1, comp not in unknown, paths.get(comp, ()))
            if c is not None:
                found.append(c)
    return found


def _computations(hlo_text: str) -> tuple[dict[str, list[str]], str | None]:
    """(computation name -> its instruction lines, the ENTRY computation's name)."""
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
    return comps, entry


def _callees(name: str, line: str):
    """(callee, trip multiplier, whether its trip count is unknown, the branch step it adds or None) of
    each computation one instruction line calls."""
    m = _INSTR_RE.match(line)
    if m and m.group(3) in _NOT_A_CALL:
        return
    trip = _TRIP_RE.search(line)
    cond = (name, m.group(1) if m else line.strip())  # names this conditional
    for attr, callee, branches in _CALLS_RE.findall(line):
        lost = attr in ("body", "condition") and not trip
        if not callee:  # a conditional's branches, in index order
            for i, b in enumerate(branches.split(",")):
                yield b.strip().lstrip("%"), 1, lost, (cond, i)
        elif attr in ("true_computation", "false_computation"):
            yield callee, 1, lost, (cond, int(attr[0] == "f"))
        else:
            yield callee, int(trip.group(1)) if trip and attr == "body" else 1, lost, None


def _execution_counts(comps: dict[str, list[str]], entry: str | None):
    """Execution counts propagated from ENTRY through calls (while bodies multiply by their trip count):
    (counts, the computations run by a loop of unknown trip count, directly or not, and each
    computation's conditional branches, the first path seen)."""
    counts: dict[str, int] = defaultdict(int)
    unknown: set[str] = set()
    paths: dict[str, tuple] = {}

    def visit(name: str, mult: int, loose: bool, path: tuple, depth: int = 0):
        if name not in comps or depth > 64:
            return
        counts[name] += mult
        paths.setdefault(name, path)
        if loose:
            unknown.add(name)
        for line in comps[name]:
            for callee, times, lost, branch in _callees(name, line):
                visit(callee, mult * times, loose or lost, path if branch is None else (*path, branch), depth + 1)

    if entry:
        visit(entry, 1, False, ())
    return counts, unknown, paths


def _collective(line: str, comp: str, devices: int | None, count: int, trips_known: bool, branch: tuple):
    """The collective one instruction line of `comp` runs, or None."""
    m = _INSTR_RE.match(line)
    if not m:
        return None
    op = m.group(3)
    kind = op[:-6] if op.endswith("-start") else op
    if kind not in KINDS:
        return None
    groups = parse_groups(line)
    if not groups and kind != "collective-permute" and "replica_groups={}" in line:
        if devices is None:
            raise ValueError(
                f"replica_groups={{}} (all devices) but no replica_count / num_partitions in "
                f"the HloModule header: {line.strip()[:120]}"
            )
        groups = (tuple(range(devices)),)
    n = 2 if kind == "collective-permute" else (len(groups[0]) if groups else 1)
    result = _result_bytes(op, m.group(2))  # S: the gathered / unscattered size
    full = result * n if kind == "reduce-scatter" else result
    return Collective(kind, full, n, groups, count, comp, trips_known, line.strip(), branch)


def per_step(colls: list[Collective], depth: int = 0) -> list[Collective]:
    """The collectives one program run executes at most: outside conditionals all of them; of each
    conditional only its largest branch (bytes sent per device, its own nested conditionals reduced
    the same way first). A branch without collectives sends 0 and is never the largest unless all are."""
    chosen = [c for c in colls if len(c.branch) == depth]
    conds: dict = defaultdict(lambda: defaultdict(list))
    for c in colls:
        if len(c.branch) > depth:
            cond, index = c.branch[depth]
            conds[cond][index].append(c)
    for branches in conds.values():
        options = [per_step(b, depth + 1) for _, b in sorted(branches.items())]
        chosen += max(options, key=lambda cs: sum(c.count * c.sent_bytes for c in cs))
    return chosen


def summarize(colls: list[Collective]) -> dict[str, dict[str, float]]:
    """{kind: {"count": executions per run, "bytes": bytes sent per device per run}}, each conditional
    counted by its largest branch (`per_step`): one run takes one branch."""
    out = {k: {"count": 0, "bytes": 0.0} for k in KINDS}
    for c in per_step(colls):
        out[c.kind]["count"] += c.count
        out[c.kind]["bytes"] += c.count * c.sent_bytes
    return {k: v for k, v in out.items() if v["count"]}


def by_axes(colls: list[Collective], mesh_shape: dict[str, int], axis_order: tuple[str, ...]) -> dict[str, dict]:
    """`summarize` per group of mesh axes a collective spans: {"fsdp": {kind: {"count", "bytes"}},
    "dp+fsdp": {...}, ...} (axes in mesh order, joined by "+"; "none" for a collective over one device)."""
    out: dict[str, dict] = {}
    for c in per_step(colls):
        axes = "+".join(a for a in axis_order if spans_axis(c, mesh_shape, axis_order, a)) or "none"
        row = out.setdefault(axes, {}).setdefault(c.kind, {"count": 0, "bytes": 0.0})
        row["count"] += c.count
        row["bytes"] += c.count * c.sent_bytes
    return out


def spans_axis(c: Collective, mesh_shape: dict[str, int], axis_order: tuple[str, ...], axis: str) -> bool:
    """Whether a collective's groups communicate across `axis` (device ids laid out row-major
    over `axis_order`, as `jaxdist.distributed.mesh` builds single-host meshes)."""
    if not c.groups or mesh_shape.get(axis, 1) == 1:
        return False
    sizes = [mesh_shape[a] for a in axis_order]
    pos = axis_order.index(axis)
    for group in c.groups:
        coords = {np.unravel_index(d, sizes)[pos] for d in group}
        if len(coords) > 1:
            return True
    return False
