"""Typed configuration: dataclass defaults <- YAML file <- `section.key=value` overrides.

Everything is validated here, up front, so a typo or a bad value fails before any JAX work with a
one-line `JaxdistError`. The resolved `Config` is passed down explicitly; nothing reads it globally.

  types.py    field types with their checks (Range, Literal)
  schema.py   the root Config and its sections; nested dicts -> a validated Config
  model_section.py, data_section.py, run_sections.py, reduce_section.py, tuning_sections.py
              the sections as dataclasses, one family of sections each
  coerce.py   one value checked against its field's type
  checks.py   value checks that relate fields
  files.py    YAML files, overrides, shipped configs by name
  keys.py     --help and docs/configuration.md's key reference, from the fields' comments
"""

from jaxdist.config.checks import parse_step_range, validate, validate_moe
from jaxdist.config.data_section import DataConfig
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
from jaxdist.config.schema import REGROUPED, RENAMED, Config, from_dict
from jaxdist.config.tuning_sections import LoraConfig, ObjectiveConfig
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
