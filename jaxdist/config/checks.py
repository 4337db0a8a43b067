"""Value checks that need no devices, in one place (axis names: config/axes.py; checks that need the
mesh: step.check)."""

from __future__ import annotations

import dataclasses
import math

from jaxdist.config.axes import check_axes
from jaxdist.config.types import _base, _field_types
from jaxdist.errors import JaxdistError

# The trackers train.trackers may name: name -> (module to import, the pyproject extra that installs it).
# Data here, below observe/trackers.py, which opens them, so the config is checked without importing it.
TRACKERS = {"tensorboard": ("tensorboardX", "tensorboard"), "wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}


def validate(cfg) -> None:
    """Value checks that need no devices, in one place: each field's Literal choices and Range (at
    the field), finiteness of every float, then the checks that relate fields. Mesh/device checks
    live in distributed/mesh.py (and its callers)."""
    validate_fields(cfg)
    validate_trackers(cfg.train.trackers)
    validate_model(cfg.model)
    if cfg.train.global_batch % cfg.train.grad_accum_steps:
        raise JaxdistError(
            f"train.global_batch={cfg.train.global_batch} is not divisible by "
            f"train.grad_accum_steps={cfg.train.grad_accum_steps}; pick a divisor"
        )
    check_axes(cfg)  # every mesh axis name, once
    validate_reduce(cfg.reduce)
    if cfg.train.profile_steps:
        parse_step_range(cfg.train.profile_steps)
    validate_moe(cfg.model)
    validate_lora(cfg.lora)
    validate_mixture(cfg.data, cfg.train.steps)


def validate_fields(cfg) -> None:
    """Every float finite, every field inside its Range."""
    for section in dataclasses.fields(cfg):
        _check_fields(section.name, getattr(cfg, section.name))


def _check_fields(name: str, values) -> None:
    """One section's fields, and those of the sections inside it (reduce.topk, ...)."""
    for key, tp in _field_types(type(values)).items():
        v, (base, rng) = getattr(values, key), _base(tp)
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            _check_fields(f"{name}.{key}", v)
        elif base is float and isinstance(v, int | float) and not math.isfinite(v):
            raise JaxdistError(f"{name}.{key}={v} must be a finite number")
        elif rng is not None and not rng.holds(v):
            raise JaxdistError(f"{name}.{key}={v} is out of range: it must be {rng}")


def validate_trackers(names) -> None:
    for name in names:
        if name not in TRACKERS:
            raise JaxdistError(f"train.trackers: {name!r} is not one of {', '.join(TRACKERS)}")


def validate_model(m) -> None:
    """The model's fields that relate: attention groups, RoPE scaling, the loss's vocab blocks."""
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
    if m.rope_scaling == "linear" and m.family != "gemma3":
        raise JaxdistError(
            f"model.rope_scaling=linear is Gemma 3's full-layer rescale (model.family=gemma3), not {m.family}'s; "
            "use none or llama3"
        )
    if m.rope_scaling == "yarn" and m.family not in ("gpt_oss", "deepseek_v3"):
        raise JaxdistError(
            f"model.rope_scaling=yarn is implemented for model.family=gpt_oss and deepseek_v3 only, not {m.family}; "
            "use none or llama3"
        )
    if m.loss_block and m.vocab_size % m.loss_block:
        raise JaxdistError(
            f"model.loss_block={m.loss_block} must be 0 (automatic) or divide model.vocab_size={m.vocab_size}"
        )
    if m.head_dim % 2:
        raise JaxdistError(f"model.head_dim={m.head_dim} must be even for rotary embeddings")


def validate_reduce(r) -> None:
    """The one knob rule of reduce.* that needs no mesh (every other decision on reduce.method is
    jaxdist.reduce.registry's; the config layer sits below it, so this one stays here)."""
    if r.method == "topk" and r.topk.dgc != "off" and not r.error_feedback:
        raise JaxdistError(
            f"reduce.error_feedback=false has no effect with reduce.topk.dgc={r.topk.dgc} (DGC always accumulates "
            "what it has not sent); set reduce.topk.dgc=off for plain top-k without error feedback"
        )


LORA_DEFAULT = ("q", "k", "v", "o", "gate", "up", "down")  # lora.targets' default: a decoder's seven projections
LORA_TARGETS = (*LORA_DEFAULT, "q_a", "q_b", "kv_a", "kv_b")  # what it may name (DeepSeek-V3's MLA: the last four)


def validate_lora(lo) -> None:
    unknown = [t for t in lo.targets if t not in LORA_TARGETS]
    if unknown or len(set(lo.targets)) != len(lo.targets):
        raise JaxdistError(f"lora.targets={lo.targets} must name distinct projections among {', '.join(LORA_TARGETS)}")
    if lo.rank and not lo.targets:
        raise JaxdistError("lora.targets is empty with lora.rank > 0: name the projections to adapt, e.g. [q, v]")
    if lo.dropout > 0:
        raise JaxdistError(
            f"lora.dropout={lo.dropout} is not supported yet (the model has no dropout randomness); use lora.dropout=0"
        )


def validate_moe(m) -> None:
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


def validate_mixture(d, steps: int) -> None:
    """data.sources and data.stages: named, weighted sources instead of data.path, and stage weights that
    name only those sources and leave some positive total, each from a step the run reaches."""
    if d.stages and not d.sources:
        raise JaxdistError("data.stages changes the weights of data.sources, which is empty; list the sources first")
    if not d.sources:
        return
    if d.path:
        raise JaxdistError(
            f"data.path={d.path!r} and data.sources are both set; give each source's path in data.sources "
            "and drop data.path"
        )
    names = []
    for i, src in enumerate(d.sources):
        if not src.name or src.name in names:
            what = "has no name" if not src.name else f"repeats the name {src.name!r}"
            raise JaxdistError(
                f"data.sources[{i}] {what}; give each source a unique name (it is logged as eval_loss/NAME)"
            )
        if not src.path:
            raise JaxdistError(
                f"data.sources[{i}] ({src.name}) has no path; give a prepared folder, token files or a text glob"
            )
        if not (math.isfinite(src.weight) and src.weight > 0):
            raise JaxdistError(
                f"data.sources[{i}] ({src.name}) has weight {src.weight}; weights must be > 0 (drop the source, "
                "or give it weight 0 from a step on with data.stages)"
            )
        if src.stream and not d.tokenizer:
            raise JaxdistError(
                f"data.sources[{i}] ({src.name}) is streamed (stream: true) but data.tokenizer is empty; set "
                "data.tokenizer to the tokenizer.json or model folder its documents are encoded with"
            )
        if src.stream and d.on_exhausted == "stop":
            raise JaxdistError(
                f"data.sources[{i}] ({src.name}) is streamed, so its size is unknown until it is read and "
                "data.on_exhausted=stop cannot be checked at start-up; set data.on_exhausted=repeat or prepare it"
            )
        if src.workers < 1:
            raise JaxdistError(f"data.sources[{i}].workers={src.workers} must be >= 1")
        if src.split_files and not src.stream:
            raise JaxdistError(
                f"data.sources[{i}] ({src.name}) sets split_files but is not streamed; split_files applies to "
                "stream: true sources (drop it, or set stream: true)"
            )
        names.append(src.name)
    validate_stages(d.stages, names, steps)


def validate_stages(stages, names: list[str], steps: int) -> None:
    """Each stage after the last and before train.steps, naming only sources of data.sources, with weights
    >= 0 and a positive sum. A stage from step >= train.steps would never apply: refused, not ignored (a run
    extended on resume raises train.steps, and the stage is then accepted with it)."""
    last = 0
    for i, stage in enumerate(stages):
        if stage.step <= last:
            raise JaxdistError(
                f"data.stages[{i}].step={stage.step} must be > {last} (stages start after step 0, in increasing order)"
            )
        if stage.step >= steps:
            raise JaxdistError(
                f"data.stages[{i}].step={stage.step} is past the run's last step (train.steps={steps}), so its "
                f"weights would never apply; raise train.steps above {stage.step} or drop the stage"
            )
        last = stage.step
        for name, w in stage.weights.items():
            if name not in names:
                raise JaxdistError(
                    f"data.stages[{i}] names source {name!r}, which data.sources lacks ({', '.join(names)})"
                )
            if not (math.isfinite(w) and w >= 0):
                raise JaxdistError(f"data.stages[{i}].weights.{name}={w} must be >= 0")
        if sum(stage.weights.values()) <= 0:
            raise JaxdistError(
                f"data.stages[{i}] (from step {stage.step}) gives every source weight 0; give one a positive weight"
            )
