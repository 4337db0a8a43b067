"""A compiled program's entry parameters and results by memory space, read from its HLO module header:
XLA writes each in `entry_computation_layout={(params)->(results)}`, a layout ending `:S(5)` in host
memory (pinned_host). What host offload's memory figures read (`observe/metrics.py`), since XLA:CPU's
memory_analysis() lumps host with device."""

from __future__ import annotations

import re

from jaxdist.distributed.hlo import shape_bytes

HOST_SPACE = "S(5)"
_ENTRY_SHAPE_RE = re.compile(r"\b(pred|[suf]\d+|bf16|c64|c128|f8e4m3fn|f8e5m2)\[([\d,]*)\](?:\{([^}]*)\})?")
_ALIAS_RE = re.compile(r"\{[\d,\s]*\}:\s*\((\d+),")


def _entry_layout(hlo_text: str) -> tuple[str, str]:
    """(parameters, results) text of the module header's entry_computation_layout."""
    header = hlo_text.split("\n", 1)[0]
    start = header.find("entry_computation_layout={")
    if start < 0:
        raise ValueError("no entry_computation_layout in the HLO module header")
    i, depth = start + len("entry_computation_layout="), 0
    for j in range(i, len(header)):  # to the brace that closes the layout
        depth += {"{": 1, "}": -1}.get(header[j], 0)
        if depth == 0:
            break
    params, _, results = header[i + 1 : j].partition(")->")
    return params, results


def _spaced_bytes(text: str) -> list[tuple[int, str]]:
    """(bytes, 'host' | 'device') of every array in a layout list, in order."""
    out = []
    for dtype, dims, layout in _ENTRY_SHAPE_RE.findall(text):
        space = "host" if (layout or "").endswith(":" + HOST_SPACE) else "device"
        out.append((shape_bytes(f"{dtype}[{dims}]")[0], space))
    return out


def entry_bytes(hlo_text: str) -> dict[str, dict[str, int]]:
    """Per-device bytes of a compiled program's entry by memory space: {"arguments" | "outputs" |
    "aliased": {"device": n, "host": n}} (aliased: donated parameters whose buffers the outputs reuse).
    Read from the layout, so it holds where memory_analysis() lumps host with device (XLA:CPU)."""
    params_text, results_text = _entry_layout(hlo_text)
    params = _spaced_bytes(params_text)
    out = {k: {"device": 0, "host": 0} for k in ("arguments", "outputs", "aliased")}
    for key, items in (("arguments", params), ("outputs", _spaced_bytes(results_text))):
        for n, space in items:
            out[key][space] += n
    header = hlo_text.split("\n", 1)[0]
    alias = header.partition("input_output_alias=")[2].partition("entry_computation_layout=")[0]
    for p in _ALIAS_RE.findall(alias):
        n, space = params[int(p)]
        out["aliased"][space] += n
    return out
