"""The planner's inputs from a compiled train step: lower and compile (never run) one (config, mesh)
on this process's devices, and read what the planner predicts — memory_analysis() and the HLO's
collectives. Used by tests/test_plan.py and scripts/memory/plan_check.py."""

from __future__ import annotations

import jax

from jaxdist import config
from jaxdist.analysis import measure
from jaxdist.distributed import hlo
from jaxdist.distributed.mesh import mesh_from_string, parse_mesh
from jaxdist.planner import hardware
from jaxdist.planner.layout import Layout

DEFAULT_FUSION = {"xla_cpu_use_fusion_emitters": True}


def compile_pair(path: str | None, mesh: str, overrides: list[str], default_fusion: bool = True):
    """(Layout on the CPU hardware entry, memory_analysis(), hlo.summarize of the collectives).
    default_fusion=False compiles with whatever XLA_FLAGS says (the tests' faster emitters): the same
    arguments and collectives (checked on test_plan's in-sample pairs), not the same temp bytes."""

    cfg = config.load(path, ["train.steps=10", *overrides])
    # XLA:CPU's default fusion, whatever XLA_FLAGS says: the tests turn its fusion emitters off to
    # compile faster, and that changes buffer assignment (circular pp=2 temp 15.27 -> 14.88 MB).
    compiled = measure.compile_train_step(cfg, mesh_from_string(mesh), DEFAULT_FUSION if default_fusion else None)
    return (
        Layout(cfg, parse_mesh(mesh, len(jax.devices())), hardware.get("cpu")),
        compiled.memory_analysis(),
        hlo.summarize(hlo.collectives(compiled.as_text())),
    )
