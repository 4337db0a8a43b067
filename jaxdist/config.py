"""Typed configuration: dataclass defaults <- YAML file <- `section.key=value` overrides.

Everything is validated here, up front, so a typo or a bad value fails before any JAX work with a
one-line `JaxdistError`. The resolved `Config` is passed down explicitly; nothing reads it globally.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Any

import yaml

from jaxdist.errors import JaxdistError

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    num_layers: int = 4
    d_model: int = 256
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    mlp_dim: int = 1024
    seq_len: int = 128
    vocab_size: int = 256
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    compute_dtype: str = "auto"  # auto: bfloat16 on GPU/TPU, float32 on CPU
    remat: str = "none"  # none | full | dots_saveable


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    shape: str = "fsdp=-1"  # --mesh overrides; e.g. "dp=2,fsdp=4"
    dcn: str = ""  # axes spanning hosts, e.g. "dp=2"; default: dp spans hosts when multi-process
    # Logical axis -> mesh axes. Empty list means replicated. Overrides merge into the defaults.
    rules: dict[str, list[str]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    source: str = "text"  # text | tokens
    path: str = ""  # glob; empty with source=text: the Python standard library of this interpreter
    token_dtype: str = "uint16"  # tokens source: uint16 | uint32
    eval_fraction: float = 0.02  # tail of the stream held out for eval
    separator: int = 0  # byte placed between documents (text source)
    prefetch: int = 2  # batches prepared ahead by background threads
    poison_step: int = -1  # testing aid: the batch of this step gets out-of-vocab tokens (NaN loss)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-3
    warmup_steps: int = 50
    schedule: str = "cosine"  # cosine | linear | constant
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip_norm: float = 1.0  # 0 disables clipping
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    lr_scaling: str = "none"  # none | linear | sqrt: scale lr by global_batch / reference_batch
    reference_batch: int = 8
    offload: str = "none"  # none | host: optimizer state in pinned host memory


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 300
    global_batch: int = 8  # sequences per optimizer step
    microbatches: int = 1  # gradient accumulation steps per optimizer step
    seed: int = 0
    eval_every: int = 100  # 0 disables eval
    eval_batches: int = 4
    log_every: int = 10
    peak_flops: float = 0.0  # per device; 0 = from the hardware table, or a CPU matmul probe
    max_skipped_steps: int = 10  # consecutive non-finite steps before the run stops
    profile_steps: str = ""  # "10:15" writes a profiler trace for those steps


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    schedule: str = "gpipe"  # gpipe | circular
    microbatches: int = 0  # 0 = pp (the minimum)
    repeats: int = 1  # circular: virtual stages per device


@dataclasses.dataclass(frozen=True)
class ReduceConfig:
    method: str = "implicit"  # implicit (XLA inserts it) | dense | topk | powersgd | int8 | diloco
    dtype: str = "float32"  # dense: float32 | bfloat16
    ratio: float = 0.01  # topk: fraction of entries kept per chunk of <= 65536
    rank: int = 4  # powersgd
    start_step: int = 0  # topk, powersgd: dense before this step (or warmup_fraction, the larger)
    error_feedback: bool = True
    block_size: int = 256  # int8: entries per scale
    axis: str = "dp"  # the mesh axis reduced explicitly
    warmup_fraction: float = 0.05  # topk, powersgd: dense for this fraction of train.steps (at least start_step)
    freeze_variance: bool = False  # topk, powersgd: freeze Adam's second moment after the warm-up (1-bit Adam)
    variance_floor: float = 0.01  # frozen second moments floored at this times their tensor's mean
    sync_every: int = 16  # diloco: local steps between outer steps (H)
    outer_lr: float = 0.7  # diloco: outer Nesterov SGD learning rate on the pseudo-gradient
    outer_momentum: float = 0.9  # diloco: outer Nesterov momentum (0: plain SGD)
    outer_codec: str = "dense"  # diloco: how the pseudo-gradient crosses dp: dense | int8 | topk


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = 100  # 0 disables periodic saves
    keep: int = 3
    params_only: bool = False  # with --restore: load parameters alone (fine-tuning)
    async_save: bool = True


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

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **sections: Any) -> "Config":
        """`cfg.replace(train=dict(steps=5))` -> a new, validated config."""
        raw = self.to_dict()
        for section, values in sections.items():
            raw[section].update(values)
        return from_dict(raw)


CHOICES = {
    "model.compute_dtype": ("auto", "float32", "bfloat16"),
    "model.remat": ("none", "full", "dots_saveable"),
    "data.source": ("text", "tokens"),
    "data.token_dtype": ("uint16", "uint32"),
    "optim.schedule": ("cosine", "linear", "constant"),
    "optim.lr_scaling": ("none", "linear", "sqrt"),
    "optim.offload": ("none", "host"),
    "pipeline.schedule": ("gpipe", "circular"),
    "reduce.method": ("implicit", "dense", "topk", "powersgd", "int8", "diloco"),
    "reduce.outer_codec": ("dense", "int8", "topk"),
    "reduce.dtype": ("float32", "bfloat16"),
}

POSITIVE = (
    "model.num_layers", "model.d_model", "model.num_heads", "model.num_kv_heads", "model.head_dim",
    "model.mlp_dim", "model.seq_len", "model.vocab_size", "train.steps", "train.global_batch",
    "train.microbatches", "train.log_every", "optim.reference_batch", "pipeline.repeats",
    "reduce.rank", "reduce.block_size", "checkpoint.keep", "data.prefetch", "reduce.sync_every",
)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check `value` against the field type; ints are accepted for floats."""
    origin = typing.get_origin(tp)
    if origin is dict:
        if not isinstance(value, dict):
            raise JaxdistError(f"{key} must be a mapping, got {value!r}; write it as {{name: [axes]}} in YAML")
        out = {}
        for k, v in value.items():
            v = [] if v is None else [v] if isinstance(v, str) else v
            if not isinstance(v, (list, tuple)) or not all(isinstance(a, str) for a in v):
                raise JaxdistError(f"{key}.{k} must be a list of mesh axis names, got {v!r}")
            out[str(k)] = list(v)
        return out
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float) and isinstance(value, str):
        try:  # YAML reads "1e-3" as a string
            return tp(value)
        except ValueError:
            pass
    if tp is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # e.g. mesh.dcn=2 is meaningless, but a path like 123 is fine
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise JaxdistError(
            f"{key} must be {_type_name(tp)}, got {value!r} ({type(value).__name__}); "
            f"fix the value in your config or override"
        )
    return value


def _section_types() -> dict[str, type]:
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config)}


def _unknown(key: str, known: list[str]) -> JaxdistError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"did you mean '{close[0]}'?" if close else f"known keys: {', '.join(sorted(known))}"
    return JaxdistError(f"unknown config key '{key}': {hint}")


def from_dict(raw: dict[str, Any]) -> Config:
    """Build a validated Config from nested dicts (missing keys take defaults)."""
    sections = {}
    section_types = _section_types()
    for name, values in raw.items():
        if name not in section_types:
            raise _unknown(name, list(section_types))
        if values is None:
            values = {}
        if not isinstance(values, dict):
            raise JaxdistError(f"config section '{name}' must be a mapping of keys to values, got {values!r}")
        cls = section_types[name]
        hints = typing.get_type_hints(cls)
        kwargs = {}
        for key, value in values.items():
            if key not in hints:
                raise _unknown(f"{name}.{key}", [f"{name}.{k}" for k in hints])
            kwargs[key] = _coerce(f"{name}.{key}", value, hints[key])
        sections[name] = cls(**kwargs)
    cfg = Config(**sections)
    validate(cfg)
    return cfg


def parse_override(text: str) -> tuple[str, str, Any]:
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise JaxdistError(f"override '{text}' is not of the form section.key=value (e.g. optim.lr=1e-3)")
    key, value = text.split("=", 1)
    section, name = key.split(".", 1)
    try:
        parsed = yaml.safe_load(value) if value != "" else ""
    except yaml.YAMLError:
        parsed = value
    return section, name, parsed


def load(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """defaults <- YAML at `path` (default configs/tiny.yaml) <- overrides like 'train.steps=10'."""
    path = Path(path) if path else DEFAULT_CONFIG
    if not path.is_file():
        raise JaxdistError(f"config file {path} not found; pass --config with an existing YAML (see configs/)")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise JaxdistError(f"config file {path} is not valid YAML ({str(e).splitlines()[0]}); fix its syntax")
    if not isinstance(raw, dict):
        raise JaxdistError(f"config file {path} must be a mapping of sections (model:, train:, ...)")
    for text in overrides:
        section, name, value = parse_override(text)
        raw.setdefault(section, {})
        if not isinstance(raw[section], dict):
            raise _unknown(section, list(_section_types()))
        raw[section][name] = value
    return from_dict(raw)


def dump(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def validate(cfg: Config) -> None:
    """Value checks that need no devices. Mesh/device checks live in mesh.py and train.py."""
    flat = {f"{s}.{k}": v for s, d in cfg.to_dict().items() for k, v in d.items()}
    for key, allowed in CHOICES.items():
        if flat[key] not in allowed:
            raise JaxdistError(f"{key}={flat[key]!r} is not one of {', '.join(allowed)}")
    for key in POSITIVE:
        if flat[key] <= 0:
            raise JaxdistError(f"{key} must be positive, got {flat[key]}")
    m = cfg.model
    if m.num_heads % m.num_kv_heads:
        raise JaxdistError(
            f"model.num_heads={m.num_heads} is not a multiple of model.num_kv_heads={m.num_kv_heads}; "
            "grouped-query attention needs whole groups"
        )
    if m.head_dim % 2:
        raise JaxdistError(f"model.head_dim={m.head_dim} must be even for rotary embeddings")
    if cfg.train.global_batch % cfg.train.microbatches:
        raise JaxdistError(
            f"train.global_batch={cfg.train.global_batch} is not divisible by "
            f"train.microbatches={cfg.train.microbatches}; pick a divisor"
        )
    if not 0 <= cfg.data.eval_fraction < 1:
        raise JaxdistError(f"data.eval_fraction must be in [0, 1), got {cfg.data.eval_fraction}")
    if not 0 < cfg.reduce.ratio <= 1:
        raise JaxdistError(f"reduce.ratio must be in (0, 1], got {cfg.reduce.ratio}")
    if not 0 <= cfg.reduce.warmup_fraction < 1 or not 0 <= cfg.reduce.outer_momentum < 1 or cfg.reduce.outer_lr <= 0:
        raise JaxdistError("reduce.warmup_fraction and reduce.outer_momentum must be in [0, 1), reduce.outer_lr > 0")
    if cfg.optim.lr <= 0 or cfg.optim.warmup_steps < 0 or not 0 <= cfg.optim.min_lr_ratio <= 1:
        raise JaxdistError("optim.lr must be > 0, optim.warmup_steps >= 0, optim.min_lr_ratio in [0, 1]")
    if cfg.train.profile_steps:
        parse_step_range(cfg.train.profile_steps)


def parse_step_range(text: str) -> tuple[int, int]:
    """'10:15' -> (10, 15)."""
    try:
        start, stop = (int(x) for x in text.split(":"))
    except ValueError:
        raise JaxdistError(f"train.profile_steps={text!r} must look like START:STOP, e.g. 10:15") from None
    if not 0 <= start < stop:
        raise JaxdistError(f"train.profile_steps={text!r} needs 0 <= START < STOP")
    return start, stop

