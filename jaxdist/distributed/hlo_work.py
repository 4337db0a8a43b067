"""Matmul FLOPs of a compiled program, read from its HLO text with loop bodies times their trip counts.

XLA's `cost_analysis()` counts a while body once; a scanned model runs its layer body L times and the
blockwise loss its block body V/vb times, so its figure is useless for a scanned step. Here every `dot`
counts 2·prod(result)·prod(contracting dims) per execution, with execution counts propagated from
ENTRY through calls (a while body times its `known_trip_count`, as `hlo.collectives` does).
"""

from __future__ import annotations

import math
import re

from jaxdist.distributed import hlo

_OPERAND_RE = re.compile(r"\b(pred|[suf]\d+|bf16|c64|c128|f8e4m3fn|f8e5m2)\[([\d,]*)\]")
_DIMS_RE = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")


def _dims(text: str) -> list[int]:
    return [int(d) for d in text.split(",") if d]


def _dot_flops(line: str, shapes: dict[str, str]) -> float:
    """2·prod(result dims)·prod(lhs contracting dims) of one `dot` instruction line, else 0. Operands
    are printed by name alone in optimized HLO: `shapes` maps instruction names to their result types."""
    m = hlo._INSTR_RE.match(line)
    if not m or m.group(3) != "dot":
        return 0.0
    result = _OPERAND_RE.search(m.group(2))
    first = m.group(4).split(",")[0].strip()
    lhs = _OPERAND_RE.search(first) or _OPERAND_RE.search(shapes.get(first.lstrip("%"), ""))
    contract = _DIMS_RE.search(line)
    if not (result and lhs and contract):
        raise ValueError(f"a dot whose shapes cannot be read: {line.strip()[:160]}")
    lhs_dims = _dims(lhs.group(2))
    k = math.prod(lhs_dims[i] for i in _dims(contract.group(1)))
    return 2.0 * math.prod(_dims(result.group(2))) * k


def matmul_flops(hlo_text: str, scope: str | None = None) -> float:
    """Per-device matmul FLOPs of one program run (loop bodies times their trip counts). `scope`: only
    the dots whose metadata (jax scope / op_name) contains it."""
    return sum(f for f, line in dots(hlo_text) if scope is None or scope in line)


def dots(hlo_text: str) -> list[tuple[float, str]]:
    """(FLOPs per program run, instruction line) of every dot."""
    comps, entry = hlo._computations(hlo_text)
    counts, _, _ = hlo._execution_counts(comps, entry)
    shapes = {}
    for lines in comps.values():
        for line in lines:
            if m := hlo._INSTR_RE.match(line):
                shapes[m.group(1)] = m.group(2)
    out = []
    for comp, lines in comps.items():
        n = counts.get(comp, 0)
        for line in lines:
            if n and (f := _dot_flops(line, shapes)):
                out.append((f * n, line.strip()))
    return out
