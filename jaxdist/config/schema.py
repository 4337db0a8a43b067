"""The configuration's root: `Config`, the registry of its sections (one dataclass per section, each
family of sections in its own module), the renamed keys, and building a validated `Config` from nested
dicts."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from jaxdist.config.checks import validate
from jaxdist.config.coerce import coerce, unknown_key
from jaxdist.config.data_section import DataConfig
from jaxdist.config.model_section import ModelConfig
from jaxdist.config.reduce_section import ReduceConfig
from jaxdist.config.run_sections import (
    CheckpointConfig,
    MeshConfig,
    OffloadConfig,
    OptimConfig,
    PipelineConfig,
    TrainConfig,
)
from jaxdist.config.tuning_sections import LoraConfig, ObjectiveConfig
from jaxdist.config.types import _field_types
from jaxdist.errors import JaxdistError


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    pipeline: PipelineConfig = dataclasses.field(default_factory=PipelineConfig)
    reduce: ReduceConfig = dataclasses.field(default_factory=ReduceConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    offload: OffloadConfig = dataclasses.field(default_factory=OffloadConfig)
    objective: ObjectiveConfig = dataclasses.field(default_factory=ObjectiveConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **sections: Any) -> Config:
        """`cfg.replace(train=dict(steps=5))` -> a new, validated config."""
        raw = self.to_dict()
        for section, values in sections.items():
            _merge(raw[section], values)
        return from_dict(raw)


def _merge(into: dict, values: dict) -> None:
    """`values` written over `into`, nested sections key by key (`reduce=dict(topk=dict(dgc="off"))`
    keeps reduce.topk's other keys)."""
    for k, v in values.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict) and k in into:
            _merge(into[k], v)
        else:
            into[k] = v


def _section_types() -> dict[str, type]:
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config)}


def _not_a_section(name: str, values: Any, where: str = "") -> JaxdistError:
    return JaxdistError(
        f"config section '{name}'{where} must be a mapping of keys to values (e.g. "
        f"{name}: {{key: value}}), got {values!r}"
    )


# Keys renamed since an earlier release: old -> new. Using the old one is a one-line error naming the new.
RENAMED = {"train.microbatches": "train.grad_accum_steps", "optim.offload": "offload.optimizer"}
# reduce.* options that belong to one method, moved into that method's section (issue 43). Run names hash
# them under the old flat names (training/rundir.identity), so a run's default folder did not move.
REGROUPED = {
    "reduce.dgc": "reduce.topk.dgc",
    "reduce.warmup_density": "reduce.topk.warmup_density",
    "reduce.rank": "reduce.powersgd.rank",
    "reduce.block_size": "reduce.int8.block_size",
    "reduce.sync_every": "reduce.diloco.sync_every",
    "reduce.outer_lr": "reduce.diloco.outer_lr",
    "reduce.outer_momentum": "reduce.diloco.outer_momentum",
    "reduce.outer_codec": "reduce.diloco.outer_codec",
    "reduce.momentum_decay": "reduce.demo.momentum_decay",
    "reduce.chunk": "reduce.demo.chunk",
}
RENAMED.update(REGROUPED)


def from_dict(raw: dict[str, Any]) -> Config:
    """Build a validated Config from nested dicts (missing keys take defaults)."""
    sections = {}
    section_types = _section_types()
    for name, values in raw.items():
        if name not in section_types:
            raise unknown_key(str(name), list(section_types))
        sections[name] = _section(str(name), section_types[name], values)
    cfg = Config(**sections)
    validate(cfg)
    return cfg


def _section(name: str, cls: type, values: Any):
    """One section (or a section inside one, like reduce.topk) from its dict, every key checked."""
    if values is None:
        values = {}
    if isinstance(values, cls):
        values = dataclasses.asdict(values)
    if not isinstance(values, dict):
        raise _not_a_section(name, values)
    hints = _field_types(cls)
    kwargs = {}
    for key, value in values.items():
        if f"{name}.{key}" in RENAMED:
            new = RENAMED[f"{name}.{key}"]
            raise JaxdistError(f"config key {name}.{key} was renamed {new}; use {new}={value!r}")
        if key not in hints:
            raise unknown_key(f"{name}.{key}", [f"{name}.{k}" for k in hints])
        if _is_section(hints[key]):
            kwargs[key] = _section(f"{name}.{key}", hints[key], value)
        else:
            kwargs[key] = coerce(f"{name}.{key}", value, hints[key])
    return cls(**kwargs)


def inner_sections() -> frozenset[str]:
    """The sections inside sections ("reduce.topk", ...): their keys are three-part names."""
    return frozenset(
        f"{name}.{key}"
        for name, cls in _section_types().items()
        for key, tp in _field_types(cls).items()
        if _is_section(tp)
    )


def flatten(tree: dict) -> dict[str, Any]:
    """{"optim.lr": 0.003, "reduce.topk.dgc": "update", ...}: a config dict by its keys' full names. A
    saved config of an older jaxdist has reduce.* options flat (reduce.dgc); they read as their new names."""
    inner, out = inner_sections(), {}
    for s, d in tree.items():
        for k, v in d.items() if isinstance(d, dict) else ():
            if f"{s}.{k}" in inner and isinstance(v, dict):
                out.update({f"{s}.{k}.{kk}": vv for kk, vv in v.items()})
            else:
                out[REGROUPED.get(f"{s}.{k}", f"{s}.{k}")] = v
    return out


def _is_section(tp: Any) -> bool:
    """A field that is itself a section of keys (a dataclass type, not a list of records)."""
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)
