"""The Hugging Face architectures jaxdist imports and exports, gathered from the model registry
(`jaxdist.models.registry`: each architecture names its families, `models/hf_spec.Family`): which one
a config.json is, and whether a model can be written as its family.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jaxdist.config import ModelConfig
from jaxdist.errors import JaxdistError
from jaxdist.models import registry
from jaxdist.models.decoder_hf import DENSE
from jaxdist.models.hf_spec import Family

FAMILIES = {f.architecture: f for f in registry.FAMILIES.values()}  # HF architecture -> Family
BY_NAME = dict(registry.FAMILIES)
NAMES = tuple(BY_NAME)


def of(hf: dict, where: Path) -> Family:
    """The family of a config.json, from `architectures` (which must agree with `model_type`)."""
    model_type = hf.get("model_type")
    arch = hf.get("architectures") or [f.architecture for f in FAMILIES.values() if f.model_type == model_type][:1]
    supported = ", ".join(FAMILIES)
    if len(arch) != 1 or arch[0] not in FAMILIES:
        raise JaxdistError(f"{where}: architecture {arch} is not supported; jaxdist imports {supported}")
    family = FAMILIES[arch[0]]
    if model_type != family.model_type:
        raise JaxdistError(
            f"{where}: model_type {model_type!r} does not match architecture {arch[0]} "
            f"(model_type {family.model_type!r}); fix config.json"
        )
    return family


def exportable(m: ModelConfig) -> Family:
    """The family `m` is written as, or a one-line error naming the switch the architecture cannot
    hold (transformers would load such a model without error and compute something else)."""
    registry.of(m)
    f = BY_NAME[m.family]
    f.exportable(m)
    return f


def fields_of(m: ModelConfig) -> dict[str, Any]:
    """The family switches of `m` (what an import sets)."""
    keys = ("family", "qkv_bias", "qk_norm", "sliding_window", *DENSE, "moe_topk", "moe_router")
    return {k: getattr(m, k) for k in keys}
