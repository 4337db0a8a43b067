"""Typed configuration: dataclass defaults <- YAML file <- `section.key=value` overrides.

Everything is validated here, up front, so a typo or a bad value fails before any JAX work with a
one-line `JaxdistError`. The resolved `Config` is passed down explicitly; nothing reads it globally.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml

from jaxdist.errors import JaxdistError


class _Loader(yaml.SafeLoader):
    """YAML without 1.1's base-60 numbers (`10:15` stays the string it looks like, not 615), and with
    `1e-3` read as the float it looks like (PyYAML wants `1.0e-3`)."""


_NUMBER_TAGS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
_Loader.yaml_implicit_resolvers = {
    ch: [(tag, rx) for tag, rx in resolvers if tag not in _NUMBER_TAGS]
    for ch, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:int",
    re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"),
    list("-+0123456789"),
)
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^(?:[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)?|[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)


def yaml_load(text: str):
    return yaml.load(text, Loader=_Loader)


_SOURCE_ROOT = Path(__file__).resolve().parent.parent
# The shipped configs: configs/ of a source checkout, else the copy installed as jaxdist/configs.
CONFIGS_DIR = (
    _SOURCE_ROOT / "configs"
    if (_SOURCE_ROOT / "pyproject.toml").is_file()
    else Path(__file__).resolve().parent / "configs"
)
DEFAULT_CONFIG = "tiny"


@dataclasses.dataclass(frozen=True)
class Range:
    """A field's allowed interval, checked by `validate` (floats must also be finite)."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def holds(self, v) -> bool:
        return (self.lo is None or (v > self.lo if self.lo_open else v >= self.lo)) and (
            self.hi is None or (v < self.hi if self.hi_open else v <= self.hi)
        )

    def __str__(self) -> str:
        lo = "" if self.lo is None else f"{'>' if self.lo_open else '>='} {self.lo:g}"
        hi = "" if self.hi is None else f"{'<' if self.hi_open else '<='} {self.hi:g}"
        return " and ".join(x for x in (lo, hi) if x)


Positive = Annotated[int, Range(1)]
NonNegative = Annotated[int, Range(0)]
PositiveFloat = Annotated[float, Range(0, lo_open=True)]
NonNegativeFloat = Annotated[float, Range(0)]
Fraction = Annotated[float, Range(0, 1)]  # [0, 1]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    num_layers: Positive = 4  # decoder blocks
    d_model: Positive = 256  # residual stream width
    num_heads: Positive = 4  # query heads
    num_kv_heads: Positive = 2  # key/value heads (grouped-query attention; divides num_heads)
    head_dim: Positive = 64  # per-head width (even: rotary embeddings)
    mlp_dim: Positive = 1024  # SwiGLU hidden width
    seq_len: Positive = 128  # training window in tokens
    vocab_size: Positive = 256  # 256 = bytes
    tie_embeddings: bool = False  # the output head reuses the embedding table
    rope_theta: PositiveFloat = 10000.0  # rotary base frequency
    rope_scaling: Literal["none", "llama3"] = "none"  # llama3: Llama 3.1/3.2 frequency rescale (factors below)
    rope_factor: PositiveFloat = 8.0  # llama3: slow-down of long wavelengths
    rope_low_freq_factor: PositiveFloat = 1.0  # llama3: low_freq_factor
    rope_high_freq_factor: PositiveFloat = 4.0  # llama3: high_freq_factor
    rope_original_max_len: Positive = 8192  # llama3: original_max_position_embeddings
    norm_eps: PositiveFloat = 1e-5  # RMSNorm epsilon
    init_std: PositiveFloat = 0.02  # normal init of weights
    compute_dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bfloat16 on GPU/TPU, float32 on CPU
    remat: Literal["none", "full", "dots_saveable"] = "none"  # activation recomputation per block
    moe_experts: NonNegative = 0  # mixture of experts (models/moe.py): experts per sparse layer; 0 = dense
    moe_topk: Positive = 2  # experts each token is routed to
    moe_every: Positive = 1  # every n-th layer's MLP is sparse (n divides num_layers)
    moe_shared_experts: NonNegative = 0  # always-on experts (DeepSeek), each of inner dim moe_mlp_dim
    moe_mlp_dim: NonNegative = 0  # expert SwiGLU inner dim; 0 = mlp_dim
    moe_router: Literal["softmax", "sigmoid"] = "softmax"  # gate scores before top-k; kept weights renormalised
    moe_dispatch: Literal["dropless", "capacity"] = "dropless"  # capacity: overflow tokens dropped (counted)
    moe_capacity_factor: PositiveFloat = 1.25  # capacity dispatch: slots per expert / (tokens x topk / experts)
    moe_aux_weight: NonNegativeFloat = 0.01  # Switch/GShard load-balancing loss weight
    moe_z_weight: NonNegativeFloat = 0.001  # router z-loss weight
    context_impl: Literal["allgather", "ring", "ulysses"] = (
        "allgather"  # cp > 1: attention across sequence shards (parallel/context.py)
    )
    loss_impl: Literal["blockwise", "naive"] = (
        "blockwise"  # blockwise never materialises B·T·V logits; naive: full logits, one-hot
    )
    loss_block: NonNegative = 0  # blockwise: vocab rows per block on each device (divides V / tp); 0 = from the shapes


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    shape: str = "fsdp=-1"  # mesh axis sizes, e.g. "dp=2,fsdp=4"; one -1 fills (--mesh)
    dcn: str = ""  # axes spanning hosts, e.g. "dp=2"; default: dp spans hosts when multi-process (--dcn-mesh)
    rules: dict[str, list[str]] = dataclasses.field(
        default_factory=dict
    )  # logical axis -> mesh axes ([] = replicated); merged into the defaults


@dataclasses.dataclass(frozen=True)
class DataConfig:
    source: Literal["text", "tokens"] = (
        "text"  # text: UTF-8 files as bytes (or data.tokenizer); tokens: flat token-id files
    )
    path: str = ""  # glob or folder (a prepare output: train/ + val/); empty with source=text: the stdlib
    token_dtype: Literal["uint16", "uint32"] = "uint16"  # dtype of token-id files (source=tokens)
    eval_fraction: Annotated[float, Range(0, 1, hi_open=True)] = 0.02  # tail of the stream held out for eval
    separator: Annotated[int, Range(0, 255)] = 0  # byte placed between documents (text source)
    prefetch: Positive = 2  # batches prepared ahead by background threads
    tokenizer: str = ""  # tokenizer.json or HF model folder (text source); empty: byte tokens
    document_mask: bool = False  # attention stays inside each EOS-ended document; positions restart


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: PositiveFloat = 3e-3  # peak learning rate
    warmup_steps: NonNegative = 50  # linear warm-up from 0
    schedule: Literal["cosine", "linear", "constant"] = "cosine"  # decay after warm-up
    min_lr_ratio: Fraction = 0.1  # final lr / peak lr
    weight_decay: NonNegativeFloat = 0.1  # AdamW decoupled decay (not on norms)
    clip_norm: NonNegativeFloat = 1.0  # global gradient-norm clip; 0 disables clipping
    b1: Annotated[float, Range(0, 1, hi_open=True)] = 0.9  # AdamW first-moment decay
    b2: Annotated[float, Range(0, 1, hi_open=True)] = 0.95  # AdamW second-moment decay
    eps: PositiveFloat = 1e-8  # AdamW epsilon
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"  # scale lr by global_batch / reference_batch
    reference_batch: Positive = 8  # the batch the lr was tuned for (lr_scaling)
    offload: Literal["none", "host"] = "none"  # host: optimizer state in pinned host memory
    schedule_steps: NonNegative = 0  # steps the LR schedule spans; 0 = train.steps (pin it to extend a run unchanged)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: Positive = 300  # optimizer steps (--steps)
    global_batch: Positive = 8  # sequences per optimizer step
    grad_accum_steps: Positive = 1  # gradient accumulation: micro-batches summed per optimizer step
    seed: Annotated[int, Range(0, 2**32 - 1)] = 0  # parameter init and data order
    eval_every: NonNegative = 100  # steps between evals; 0 disables eval
    eval_batches: NonNegative = 4  # held-out batches per eval (0: no eval, with a warning at start-up)
    log_every: Positive = 10  # steps between metric lines
    peak_flops: NonNegativeFloat = 0.0  # per device; 0 = from the hardware table, or a CPU matmul probe
    max_skipped_steps: Positive = 10  # consecutive non-finite steps before the run stops
    profile_steps: str = ""  # "10:15" writes a profiler trace for those steps
    trackers: list[str] = dataclasses.field(
        default_factory=lambda: ["tensorboard"]
    )  # several at once: tensorboard, wandb, mlflow (extras)


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    schedule: Literal["gpipe", "circular"] = "gpipe"  # pipeline schedule (with pp > 1)
    microbatches: NonNegative = 0  # pipeline micro-batches per step; 0 = pp (the minimum)
    repeats: Positive = 1  # circular: virtual stages per device


@dataclasses.dataclass(frozen=True)
class ReduceConfig:
    method: Literal["implicit", "dense", "topk", "powersgd", "int8", "diloco"] = "implicit"  # implicit: XLA inserts it
    dtype: Literal["float32", "bfloat16"] = "float32"  # dense: the all-reduce's dtype
    ratio: Annotated[float, Range(0, 1, lo_open=True)] = 0.01  # topk: fraction of entries kept per chunk of <= 65536
    rank: Positive = 4  # powersgd: rank of the low-rank factors
    start_step: NonNegative = 0  # topk, powersgd: dense before this step (or warmup_fraction, the larger)
    error_feedback: bool = True  # keep what was not sent and add it next step
    block_size: Positive = 256  # int8: entries per scale
    axis: str = "dp"  # the mesh axis reduced explicitly
    warmup_fraction: Annotated[float, Range(0, 1, hi_open=True)] = (
        0.05  # topk, powersgd: dense for this fraction of train.steps (at least start_step)
    )
    freeze_variance: bool = False  # topk, powersgd: freeze Adam's second moment after the warm-up (1-bit Adam)
    variance_floor: NonNegativeFloat = 0.01  # frozen second moments floored at this times their tensor's mean
    sync_every: Positive = 16  # diloco: local steps between outer steps (H)
    outer_lr: PositiveFloat = 0.7  # diloco: outer Nesterov SGD learning rate on the pseudo-gradient
    outer_momentum: Annotated[float, Range(0, 1, hi_open=True)] = 0.9  # diloco: outer Nesterov momentum (0: plain SGD)
    outer_codec: Literal["dense", "int8", "topk"] = "dense"  # diloco: how the pseudo-gradient crosses dp


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: NonNegative = 100  # steps between saves; 0 disables periodic saves
    keep: Positive = 3  # newest checkpoints kept
    params_only: bool = False  # with --restore: load parameters alone (fine-tuning)
    async_save: bool = True  # write in the background while training goes on


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

    def replace(self, **sections: Any) -> Config:
        """`cfg.replace(train=dict(steps=5))` -> a new, validated config."""
        raw = self.to_dict()
        for section, values in sections.items():
            raw[section].update(values)
        return from_dict(raw)


def _base(tp: Any) -> tuple[Any, Range | None]:
    """(underlying type, its Range) of a field type: Annotated[int, Range(1)] -> (int, Range(1))."""
    if typing.get_origin(tp) is Annotated:
        base, *meta = typing.get_args(tp)
        return base, next((m for m in meta if isinstance(m, Range)), None)
    return tp, None


def _type_name(tp: Any) -> str:
    tp = _base(tp)[0]
    if typing.get_origin(tp) is Literal:
        return " | ".join(map(str, typing.get_args(tp)))
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check `value` against the field type; ints are accepted for floats."""
    tp, _ = _base(tp)
    origin = typing.get_origin(tp)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise JaxdistError(f"{key}={value!r} is not one of {', '.join(map(str, allowed))}{hint}")
        return value
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
    if origin is list:
        value = [value] if isinstance(value, str) else [] if value is None else value
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise JaxdistError(f"{key} must be a list of names, got {value!r}; write it as [a, b]")
        return list(value)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float) and isinstance(value, str):
        try:  # YAML reads "1e-3" as a string
            return tp(value)
        except ValueError:
            pass
    if tp is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # e.g. a path like 123 is fine
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise JaxdistError(
            f"{key} must be {_type_name(tp)}, got {value!r} ({type(value).__name__}); "
            f"fix the value in your config or override"
        )
    return value


def _section_types() -> dict[str, type]:
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config)}


def _field_types(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)


def _unknown(key: str, known: list[str]) -> JaxdistError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"did you mean '{close[0]}'?" if close else f"known keys: {', '.join(sorted(known))}"
    return JaxdistError(f"unknown config key '{key}': {hint}")


def _not_a_section(name: str, values: Any, where: str = "") -> JaxdistError:
    return JaxdistError(
        f"config section '{name}'{where} must be a mapping of keys to values (e.g. "
        f"{name}: {{key: value}}), got {values!r}"
    )


# Keys renamed since an earlier release: old -> new. Using the old one is a one-line error naming the new.
RENAMED = {"train.microbatches": "train.grad_accum_steps"}


def from_dict(raw: dict[str, Any]) -> Config:
    """Build a validated Config from nested dicts (missing keys take defaults)."""
    sections = {}
    section_types = _section_types()
    for name, values in raw.items():
        if name not in section_types:
            raise _unknown(str(name), list(section_types))
        if values is None:
            values = {}
        if not isinstance(values, dict):
            raise _not_a_section(name, values)
        cls = section_types[name]
        hints = _field_types(cls)
        kwargs = {}
        for key, value in values.items():
            if f"{name}.{key}" in RENAMED:
                new = RENAMED[f"{name}.{key}"]
                raise JaxdistError(f"config key {name}.{key} was renamed {new}; use {new}={value!r}")
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
        parsed = yaml_load(value) if value != "" else ""
    except yaml.YAMLError:
        parsed = value
    return section, name, parsed


def find(name_or_path: str | Path | None) -> Path:
    """A config file: an existing path, or the name of a shipped config (`llama3-8b`), from anywhere."""
    if name_or_path is None or name_or_path == "":
        name_or_path = DEFAULT_CONFIG
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = CONFIGS_DIR / f"{path.stem if path.suffix in ('.yaml', '.yml') else path.name}.yaml"
    if path.parent == Path(".") or path.parts[:1] == ("configs",):
        if shipped.is_file():
            return shipped
    names = ", ".join(shipped_configs())
    raise JaxdistError(
        f"config file {name_or_path} not found; pass --config with an existing YAML path or "
        f"a shipped config name ({names})"
    )


def shipped_configs() -> list[str]:
    return sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml"))


def load(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """defaults <- YAML at `path` (a path or a shipped config name; default tiny) <- overrides like
    'train.steps=10'."""
    path = find(path)
    try:
        raw = yaml_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as e:
        raise JaxdistError(f"config file {path} is not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    except yaml.YAMLError as e:
        raise JaxdistError(f"config file {path} is not valid YAML ({str(e).splitlines()[0]}); fix its syntax")
    if not isinstance(raw, dict):
        raise JaxdistError(f"config file {path} must be a mapping of sections (model:, train:, ...)")
    for name, values in raw.items():
        if name in _section_types() and values is not None and not isinstance(values, dict):
            raise _not_a_section(name, values, f" in {path}")
    for text in overrides:
        section, name, value = parse_override(text)
        if section not in _section_types():
            raise _unknown(f"{section}.{name}", [k for k, _ in iter_keys()])
        raw.setdefault(section, {})
        if raw[section] is None:
            raw[section] = {}
        raw[section][name] = value
    return from_dict(raw)


def dump(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def validate(cfg: Config) -> None:
    """Value checks that need no devices, in one place: each field's Literal choices and Range (at
    the field), finiteness of every float, then the checks that relate fields. Mesh/device checks
    live in mesh.py and train.py."""
    for section in dataclasses.fields(cfg):
        values = getattr(cfg, section.name)
        for key, tp in _field_types(type(values)).items():
            v, (base, rng) = getattr(values, key), _base(tp)
            if base is float and not math.isfinite(v):
                raise JaxdistError(f"{section.name}.{key}={v} must be a finite number")
            if rng is not None and not rng.holds(v):
                raise JaxdistError(f"{section.name}.{key}={v} is out of range: it must be {rng}")
    from jaxdist.trackers import TRACKERS

    for name in cfg.train.trackers:
        if name not in TRACKERS:
            raise JaxdistError(f"train.trackers: {name!r} is not one of {', '.join(TRACKERS)}")
    m = cfg.model
    if m.num_heads % m.num_kv_heads:
        raise JaxdistError(
            f"model.num_heads={m.num_heads} is not a multiple of model.num_kv_heads={m.num_kv_heads}; "
            "grouped-query attention needs whole groups"
        )
    if m.rope_scaling == "llama3" and not (
        m.rope_factor > 0 and 0 < m.rope_low_freq_factor < m.rope_high_freq_factor and m.rope_original_max_len > 0
    ):
        raise JaxdistError(
            "model.rope_scaling=llama3 needs rope_factor > 0, 0 < rope_low_freq_factor < "
            "rope_high_freq_factor and rope_original_max_len > 0"
        )
    if m.loss_block and m.vocab_size % m.loss_block:
        raise JaxdistError(
            f"model.loss_block={m.loss_block} must be 0 (automatic) or divide model.vocab_size={m.vocab_size}"
        )
    if m.head_dim % 2:
        raise JaxdistError(f"model.head_dim={m.head_dim} must be even for rotary embeddings")
    if cfg.train.global_batch % cfg.train.grad_accum_steps:
        raise JaxdistError(
            f"train.global_batch={cfg.train.global_batch} is not divisible by "
            f"train.grad_accum_steps={cfg.train.grad_accum_steps}; pick a divisor"
        )
    _validate_rules(cfg.mesh.rules)
    if cfg.train.profile_steps:
        parse_step_range(cfg.train.profile_steps)
    validate_moe(m)


def validate_moe(m: ModelConfig) -> None:
    if m.moe_experts < 0 or m.moe_shared_experts < 0 or m.moe_mlp_dim < 0:
        raise JaxdistError("model.moe_experts, model.moe_shared_experts and model.moe_mlp_dim must be >= 0")
    if not m.moe_experts:
        return
    if not 1 <= m.moe_topk <= m.moe_experts:
        raise JaxdistError(f"model.moe_topk={m.moe_topk} must be between 1 and model.moe_experts={m.moe_experts}")
    if m.moe_every < 1 or m.num_layers % m.moe_every:
        raise JaxdistError(
            f"model.moe_every={m.moe_every} must be >= 1 and divide model.num_layers="
            f"{m.num_layers} (every n-th layer is sparse)"
        )
    if m.moe_capacity_factor <= 0 or m.moe_aux_weight < 0 or m.moe_z_weight < 0:
        raise JaxdistError("model.moe_capacity_factor must be > 0, model.moe_aux_weight and model.moe_z_weight >= 0")


def _validate_rules(rules: dict[str, list[str]]) -> None:
    from jaxdist.mesh import AXES
    from jaxdist.sharding import DEFAULT_RULES

    for name, axes in rules.items():
        if name not in DEFAULT_RULES:
            close = difflib.get_close_matches(name, list(DEFAULT_RULES), n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"known: {', '.join(DEFAULT_RULES)}"
            raise JaxdistError(f"mesh.rules names unknown logical axis '{name}'; {hint}")
        for axis in axes:
            if axis not in AXES:
                raise JaxdistError(f"mesh.rules.{name} names unknown mesh axis '{axis}'; use {', '.join(AXES)}")


def parse_step_range(text: str) -> tuple[int, int]:
    """'10:15' -> (10, 15). YAML 1.1 reads an unquoted 10:15 as the base-60 integer 615, which
    arrives here as '615': read it back as the START:STOP the user wrote (YAML's base 60 needs a first
    part of 1 or more, so 0:5 stays a string and a bare number below 60 is not one of these)."""
    if text.isdigit() and int(text) >= 60:
        text = "{}:{}".format(*divmod(int(text), 60))
    try:
        start, stop = (int(x) for x in text.split(":"))
    except ValueError:
        raise JaxdistError(f"train.profile_steps={text!r} must look like START:STOP, e.g. 10:15") from None
    if not 0 <= start < stop:
        raise JaxdistError(f"train.profile_steps={text!r} needs 0 <= START < STOP")
    return start, stop


# ---- documentation generated from the dataclasses (--help, the README's key reference) ----------------


def field_docs(cls) -> dict[str, str]:
    """Each field's `# comment` in the class source (wherever the formatter wrapped it): the one place a
    key is documented."""
    import ast
    import inspect
    import io
    import textwrap
    import tokenize

    source = textwrap.dedent(inspect.getsource(cls))
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").replace("noqa", "").strip()
    docs = {}
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            lines = range(node.lineno, node.end_lineno + 1)
            docs[node.target.id] = " ".join(comments[i] for i in lines if i in comments)
    return docs


def iter_keys():
    """(section.key, field type, default, doc) for every config key, in declaration order."""
    for section in dataclasses.fields(Config):
        cls = _section_types()[section.name]
        docs, defaults = field_docs(cls), cls()
        for key, tp in _field_types(cls).items():
            yield f"{section.name}.{key}", (tp, getattr(defaults, key), docs.get(key, ""))


def _describe_type(tp) -> str:
    base, rng = _base(tp)
    return _type_name(base) + (f" ({rng})" if rng else "")


def keys_help() -> str:
    """Every config key with its type, default and doc, for `--help`."""
    lines = ["config keys (override as section.key=value):"]
    for key, (tp, default, doc) in iter_keys():
        lines.append(f"  {key} = {default!r}  [{_describe_type(tp)}]  {doc}".rstrip())
    return "\n".join(lines)


def keys_markdown() -> str:
    """The README's key reference table."""
    rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for key, (tp, default, doc) in iter_keys():
        t = _describe_type(tp).replace("|", "\\|")
        rows.append(f"| `{key}` | {t} | `{default!r}` | {doc.replace('|', '/')} |")
    return "\n".join(rows)


if __name__ == "__main__":  # python -m jaxdist.config: print the README's key reference
    print(keys_markdown())
