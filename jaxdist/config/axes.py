"""Mesh axis names and the default logical-axis rules, as data, and the one check of the axes a config names.

They live in the config layer so that config validation (no devices) checks every axis name up front,
once; `jaxdist.distributed.mesh` and `jaxdist.distributed.sharding` read them from here. A mesh built by `jaxdist.distributed.mesh` has
every axis of `AXES` (size 1 where unused; `mesh.check_mesh` refuses another), so later code indexes
`mesh.shape` by these names without checking again.
"""

from __future__ import annotations

import difflib

from jaxdist.errors import JaxdistError

# Slowest to fastest (the device order of jaxdist.distributed.mesh): consecutive devices land on the fast axes.
AXES = ("dp", "pp", "fsdp", "cp", "ep", "tp")

DEFAULT_RULES: dict[str, tuple[str, ...]] = {
    "batch": ("dp", "fsdp", "ep"),  # ep ranks hold different tokens (dense parts: data parallel)
    "seq": ("cp",),  # context parallelism (jaxdist.parallel.context); a no-op while cp=1
    "embed": ("fsdp",),
    # RMSNorm scales (D floats a layer): replicated, as MaxText keeps them, so no pass gathers them; a
    # gather each would be two more launches per layer per pass for a few kilobytes (issue 42).
    "norm": (),
    "mlp": ("tp",),
    "heads": ("tp",),
    "kv_heads": ("tp",),
    "head_dim": (),
    "vocab": ("tp",),
    "layers": (),
    "stage": ("pp",),
    "expert": ("ep",),
    "lora_rank": (),  # LoRA adapters' rank dim (jaxdist.adapters): small, replicated
}


def check_axes(cfg) -> None:
    """Every axis name `cfg` uses is known: mesh.rules' logical names and their mesh axes, reduce.axis."""
    for name, axes in cfg.mesh.rules.items():
        if name not in DEFAULT_RULES:
            close = difflib.get_close_matches(name, list(DEFAULT_RULES), n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"known: {', '.join(DEFAULT_RULES)}"
            raise JaxdistError(f"mesh.rules names unknown logical axis '{name}'; {hint}")
        for axis in axes:
            if axis not in AXES:
                raise JaxdistError(f"mesh.rules.{name} names unknown mesh axis '{axis}'; use {', '.join(AXES)}")
    if cfg.reduce.axis not in AXES:
        raise JaxdistError(f"reduce.axis={cfg.reduce.axis!r} is not a mesh axis; use one of {', '.join(AXES)} (dp)")
