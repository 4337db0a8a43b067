"""Typed configuration: dataclass defaults <- YAML file <- `section.key=value` overrides.

Everything is validated here, up front, so a typo or a bad value fails before any JAX work with a
one-line `JaxdistError`. The resolved `Config` is passed down explicitly; nothing reads it globally.

  types.py    field types with their checks (Range, Literal)
  schema.py   the sections as dataclasses; nested dicts -> a validated Config
  checks.py   value checks that relate fields
  files.py    YAML files, overrides, shipped configs by name
  keys.py     --help and docs/configuration.md's key reference, from the fields' comments
"""

from jaxdist.config.checks import parse_step_range, validate, validate_moe
from jaxdist.config.files import (
    CONFIGS_DIR,
    DEFAULT_CONFIG,
    dump,
    find,
    load,
    parse_override,
    shipped_configs,
    yaml_load,
)
from jaxdist.config.keys import field_docs, iter_keys, keys_help, keys_markdown
from jaxdist.config.schema import (
    REGROUPED,
    RENAMED,
    CheckpointConfig,
    Config,
    DataConfig,
    LoraConfig,
    MeshConfig,
    ModelConfig,
    ObjectiveConfig,
    OffloadConfig,
    OptimConfig,
    PipelineConfig,
    ReduceConfig,
    TrainConfig,
    from_dict,
)
from jaxdist.config.types import Range

__all__ = [
    "CONFIGS_DIR",
    "DEFAULT_CONFIG",
    "REGROUPED",
    "RENAMED",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "LoraConfig",
    "ObjectiveConfig",
    "OffloadConfig",
    "MeshConfig",
    "ModelConfig",
    "OptimConfig",
    "PipelineConfig",
    "Range",
    "ReduceConfig",
    "TrainConfig",
    "dump",
    "field_docs",
    "find",
    "from_dict",
    "iter_keys",
    "keys_help",
    "keys_markdown",
    "load",
    "parse_override",
    "parse_step_range",
    "shipped_configs",
    "validate",
    "validate_moe",
    "yaml_load",
]
