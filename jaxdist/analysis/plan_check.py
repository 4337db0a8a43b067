"""The planner's inputs from a compiled train step: lower and compile (never run) one (config, mesh)
on this process's devices, and read what the planner predicts — memory_analysis() and the HLO's
collectives — and where the two part by more than docs/planner.md's bounds. Used by tests/test_plan.py
and scripts/memory/plan_check.py."""

from __future__ import annotations

import jax

from jaxdist.analysis import measure
from jaxdist.distributed import hlo
from jaxdist.distributed.mesh import mesh_from_string, parse_mesh
from jaxdist.planner import comms, hardware, memory, plans
from jaxdist.planner.layout import Layout
from jaxdist.planner.traffic import by_kind

DEFAULT_FUSION = {"xla_cpu_use_fusion_emitters": True}


def compile_pair(path: str | None, mesh: str, overrides: list[str], default_fusion: bool = True):
    """(Layout on the CPU hardware entry, memory_analysis(), hlo.summarize of the collectives); `path` as
    plan's --config (a YAML path or shipped name, or hf:DIR).
    default_fusion=False compiles with whatever XLA_FLAGS says (the tests' faster emitters): the same
    arguments and collectives (checked on test_plan's in-sample pairs), not the same temp bytes."""

    cfg = plans.load_config(path, ["train.steps=10", *overrides])  # a YAML, or a Hugging Face model (hf:DIR)
    # XLA:CPU's default fusion, whatever XLA_FLAGS says: the tests turn its fusion emitters off to
    # compile faster, and that changes buffer assignment (circular pp=2 temp 15.27 -> 14.88 MB).
    compiled = measure.compile_train_step(cfg, mesh_from_string(mesh), DEFAULT_FUSION if default_fusion else None)
    return (
        Layout(cfg, parse_mesh(mesh, len(jax.devices())), hardware.get("cpu")),
        compiled.memory_analysis(),
        hlo.summarize(hlo.collectives(compiled.as_text())),
    )


def bound_misses(lay: Layout, mem, measured: dict, temp_rel: float | None = 0.10, comm_rel: float = 0.05) -> list[str]:
    """Where the planner is off the compiled step by more than docs/planner.md's accuracy bounds, one line
    each (empty: within them): arguments within 1%; temp and total (arguments + temp + output - alias)
    within temp_rel (None: not checked, for the tests' faster emitters); each collective kind's bytes
    within comm_rel, a kind under 0.1% of the compiled bytes on both sides skipped (a few scalars: loss,
    norms). Shared by tests/test_plan.py and scripts/memory/plan_check.py --check."""

    def off(what: str, predicted: float, compiled: float, rel: float) -> list[str]:
        if abs(predicted - compiled) <= rel * abs(compiled):
            return []
        return [
            f"{what}: predicted {predicted:,.0f}, compiled {compiled:,.0f} ({predicted / compiled - 1:+.1%}, bound {rel:.0%})"
        ]

    predicted = memory.estimate(lay)
    out = off("arguments", predicted.arguments, mem.argument_size_in_bytes, 0.01)
    if temp_rel is not None:
        total = mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
        out += off("temp", predicted.compiled_temp, mem.temp_size_in_bytes, temp_rel)
        out += off("total", predicted.total, total, temp_rel)
    kinds = by_kind(comms.step_traffic(lay))
    everything = sum(v["bytes"] for v in measured.values())
    for kind in sorted(set(kinds) | set(measured)):
        got = measured.get(kind, {"bytes": 0.0})["bytes"]
        if got < 0.001 * everything and kinds.get(kind, 0.0) < 0.001 * everything:
            continue
        out += off(kind, kinds.get(kind, 0.0), got, comm_rel)
    return out
