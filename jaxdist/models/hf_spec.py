"""The Hugging Face side of an architecture, as data: a `Family` says which config.json fields it
reads into which `model.*` fields, which must hold one value, which it may ignore, the tensor names of
its MoE block, what it writes back, and what it refuses to export. Pure functions of dicts and
`ModelConfig`s: the models name their families here, `jaxdist.hf` reads and writes the files.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jaxdist.config import ModelConfig


def _no_rope(hf: dict, where) -> None:
    return None


def _exportable(m: ModelConfig) -> None:
    return None


@dataclasses.dataclass(frozen=True)
class Family:
    name: str  # model.family
    architecture: str
    model_type: str
    defaults: dict  # transformers' config defaults that differ from Llama's
    required: dict  # field -> the only value we compute (None in the file also accepted)
    mapped: frozenset  # fields `read` consumes
    ignored: frozenset  # fields that do not change the forward pass (here)
    read: Callable[[Callable, object], dict]  # (get, where) -> ModelConfig fields
    write: Callable[[ModelConfig, dict], dict]  # (model, source config) -> config.json fields
    experts: tuple = ()  # MoE: (router name, expert name pattern, (gate, up, down) names)
    # (config.json, where) -> the rotary fields, or None for jaxdist.hf.mapping's (rope_theta, llama3)
    rope: Callable[[dict, object], dict | None] = _no_rope
    exportable: Callable[[ModelConfig], None] = _exportable  # raises the one-line error of a model it cannot hold
