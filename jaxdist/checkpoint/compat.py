"""Compatibility policy: which checkpoint may continue which run.

- the model must match tensor by tensor (a different model, or another pipeline layout, is named);
- a resume keeps the seed (it fixes the data order) and a sequence length the weights were trained at;
- the saved optimizer and reducer state must have the tensors this run builds (another reduce.method,
  allowed by name, or a layout an older jaxdist wrote, is named);
- any other change of the resolved config is refused with one line listing the changed keys, unless
  the user names them (`--allow-config-change KEY,...`) or they are meant to change between attempts
  (`FREE_KEYS`: length of the run, checkpointing, logging, mesh and memory settings that leave the
  maths unchanged).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from pathlib import Path
from typing import Any

import jax
import yaml

from jaxdist.adapters.lora import SCALE, A, B
from jaxdist.config import Config
from jaxdist.config.model_section import SHAPE_FIELDS
from jaxdist.config.schema import flatten as flat
from jaxdist.data.corpus import ALLOW
from jaxdist.errors import JaxdistError

# Keys that may differ from the checkpoint's config without a flag: how long and how the run is
# driven, not what it computes (the mesh may change: arrays are resharded on restore).
FREE_KEYS = frozenset(
    {
        "train.steps",
        "train.eval_every",
        "train.evals",
        "train.eval_batches",
        "train.log_every",
        "train.peak_flops",
        "train.max_skipped_steps",
        "train.profile_steps",
        "train.plot",
        "train.grad_accum_steps",
        "pipeline.microbatches",
        # The parameter layout depends on pp, pipeline.repeats and the schedule's chunk placement only
        # (parallel/pipeline.to_stages); a resume under another placement at the same pp (gpipe <-> circular
        # <-> zb_v) has its staged rows moved by checkpoint/restage.py.
        "pipeline.schedule",
        "optim.schedule_steps",
        # The WSD decay's placement and shape change the LR schedule only, like schedule_steps: a
        # cool-down from any checkpoint is a resume with optim.decay_steps set (docs/optimizers.md).
        "optim.decay_fraction",
        "optim.decay_steps",
        "optim.decay_shape",
        "checkpoint.every",
        "checkpoint.saves",
        "checkpoint.keep",
        "checkpoint.async_save",
        "checkpoint.params_only",
        "mesh.shape",
        "mesh.dcn",
        "mesh.rules",
        "model.remat",
        "model.loss_gather_mib",  # how the loss gathers and keeps its blocks: memory and speed, not the result
        "model.loss_keep_mib",
        "offload.optimizer",
        "offload.params",
        "offload.activations",
        "data.prefetch",
        "data.poison_step",
    }
)

# Keys added after run folders were named: a run at their default is named as before they existed
# (training/rundir.identity leaves them out), so the same command still finds its folder.
OMITTED_AT_DEFAULT = {
    "optim.name": "adamw",
    "optim.muon_momentum": 0.95,
    "optim.muon_nesterov": True,
    "optim.muon_ns_steps": 5,
    "optim.muon_scale": "match_rms_adamw",
    "train.eval_tasks": [],
    "train.eval_limit": 0,
    "train.eval_include_path": "",
    "train.eval_batch_size": 8,
    "objective.method": "lm",
    "objective.beta": 0.1,
    "objective.dpo_loss": "sigmoid",
    "objective.label_smoothing": 0.0,
    "objective.gamma": 0.5,
    "objective.orpo_lambda": 0.1,
    "objective.reward": [],
    "objective.reward_weights": [],
    "objective.group_size": 4,
    "objective.max_new_tokens": 16,
    "objective.temperature": 1.0,
    "objective.top_p": 1.0,
    "objective.epsilon": 0.2,
    "objective.epsilon_high": 0.0,
    "objective.iterations": 1,
    "objective.grpo_loss": "dapo",
    "objective.scale_rewards": "group",
    "lora.rslora": False,
    "data.sources": [],
    "data.stages": [],
    "data.on_exhausted": "repeat",
    "model.fp8": "off",
}


def _path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def check_model(saved_params, abstract_params, where: Path, saved_config: dict | None = None, cfg=None) -> None:
    """Same tensors with the same shapes, or an error naming the first tensor that differs (LoRA's: the
    lora.* keys that changed since `saved_config`, when given, and the export-first way)."""
    saved = {_path_str(p): tuple(m.shape) for p, m in jax.tree_util.tree_flatten_with_path(saved_params)[0]}
    wanted = {_path_str(p): tuple(a.shape) for p, a in jax.tree_util.tree_flatten_with_path(abstract_params)[0]}
    fix = "use the model.* settings it was trained with, or a new --run-dir"
    changed = changed_keys(saved_config, cfg) if saved_config is not None and cfg is not None else {}
    lora = _lora_mismatch(set(saved), set(wanted), saved, wanted, where, changed)
    if lora:
        raise JaxdistError(lora)
    for name, shape in wanted.items():
        if name not in saved:
            raise JaxdistError(f"checkpoint {where} is of a different model: it has no tensor params/{name}; {fix}")
        if saved[name] != shape and _restaged(saved[name], shape):
            raise JaxdistError(
                f"checkpoint {where} stores the layer stack in another pipeline layout: params/{name} is "
                f"{saved[name]} there but {shape} here; resume with the pp and pipeline.repeats it was saved "
                "with (moving a checkpoint across pipeline layouts is not supported yet)"
            )
        if saved[name] != shape:
            raise JaxdistError(
                f"checkpoint {where} is of a different model: tensor params/{name} has shape "
                f"{saved[name]} there but {shape} in this config; {fix}"
            )
    extra = sorted(set(saved) - set(wanted))
    if extra:
        raise JaxdistError(
            f"checkpoint {where} is of a different model: it has tensor params/{extra[0]} that this config lacks; {fix}"
        )


def _lora_mismatch(
    saved: set, wanted: set, saved_shapes: dict, wanted_shapes: dict, where: Path, changed: dict
) -> str | None:
    """The line for a checkpoint whose LoRA tensors (adapters, quantisation scales) differ from this
    config's, naming the lora.* cause and the way that works: export, then start from the export."""
    adapter = lambda n: n.endswith((A, B))
    quant = lambda n: n.endswith(SCALE)
    had, has = {n for n in saved if adapter(n)}, {n for n in wanted if adapter(n)}
    export = f"python -m jaxdist.convert to-hf {where} DIR"
    if has and not had:
        return (
            f"checkpoint {where} has no LoRA adapters (a full-training run) and this run has lora.rank > 0: a "
            f"LoRA run starts from a Hugging Face model; export it first ({export}) and start a new --run-dir "
            "with --restore hf:DIR lora.rank=..."
        )
    if had and not has:
        return (
            f"checkpoint {where} is a LoRA run's (adapters beside a frozen base) and this run has lora.rank=0: "
            f"export it merged ({export}) and start from --restore hf:DIR in a new --run-dir"
        )
    if not had:
        return None
    same = had == has and {n for n in saved if quant(n)} == {n for n in wanted if quant(n)}
    if same and all(saved_shapes[n] == wanted_shapes[n] for n in wanted if adapter(n) or quant(n)):
        return None
    keys = {k: v for k, v in changed.items() if k.startswith("lora.")}
    what = (
        ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in keys.items())
        if keys
        else "rank, targets, base_dtype or block_size"
    )
    back = " ".join(f"{k}={a}" for k, (a, _) in keys.items()) or "the lora.* values of its config.yaml"
    return (
        f"checkpoint {where} was trained with other lora.* settings ({what}): its adapters or quantised base "
        f"do not fit this config's; resume with {back}, or export it merged ({export}) and start a new "
        "--run-dir with --restore hf:DIR and the new lora.* values"
    )


def _shapes(tree) -> list[tuple]:
    return sorted(tuple(leaf.shape) for leaf in jax.tree.leaves(tree) if hasattr(leaf, "shape"))


def check_train_state(saved_train, abstract_train: dict, saved_config: dict, cfg: Config, where: Path) -> None:
    """The saved reducer and optimizer state holds the tensors this run's settings build, or one line
    naming the setting. Without it orbax's tree mismatch reads like a corrupt file, and restore would
    try every older checkpoint of the same layout before giving up."""
    start = f"start from its weights with --restore {where} checkpoint.params_only=true in a new --run-dir"
    for item in ("reducer_state", "opt_state"):
        try:
            saved = _shapes(saved_train[item])
        except (KeyError, TypeError):
            continue
        wanted = _shapes(abstract_train[item])
        if saved == wanted:
            continue
        counts = f"{len(saved)} tensors saved, {len(wanted)} needed"
        if item == "opt_state":
            raise JaxdistError(
                f"checkpoint {where} holds optimizer state in another layout than this config's optim.* "
                f"settings build ({counts}); resume with the optim.* settings it was saved with, or {start}"
            )
        then = saved_config.get("reduce", {}).get("method", Config().reduce.method)
        if then != cfg.reduce.method:
            raise JaxdistError(
                f"checkpoint {where} holds reduce.method={then} state, which reduce.method={cfg.reduce.method} "
                f"cannot continue from ({counts}); resume with reduce.method={then}, or {start}"
            )
        raise JaxdistError(
            f"checkpoint {where} holds reduce.method={then} state in another layout ({counts}): other "
            "reduce.* settings, or an older jaxdist (int8 before its requantisation feedback); resume with "
            f"the reduce.* settings it was saved with, or {start}"
        )


def _restaged(saved: tuple, wanted: tuple) -> bool:
    """The same layer stack laid out (layers, ...) vs (stage, layers/stage, ...), or staged differently."""

    def stack(shape):  # leading dims that hold layers: one, or two when staged
        return [shape[:1], shape[:2]]

    for a in stack(saved):
        for b in stack(wanted):
            if a != b and math.prod(a) == math.prod(b) and saved[len(a) :] == wanted[len(b) :]:
                return True
    return False


def check_resume(meta: dict, cfg: Config, where: Path) -> None:
    """A full resume continues the same run: the same data order and a sequence length the weights support.

    RoPE has no position table, so the architecture accepts any length; the sequence length a model
    supports is the one it was trained at. Training longer sequences from these weights is a fine-tune
    (`checkpoint.params_only=true`), not a resume.
    """
    saved = meta.get("config", {})
    seq = saved.get("model", {}).get("seq_len", cfg.model.seq_len)
    if cfg.model.seq_len > seq:
        raise JaxdistError(
            f"model.seq_len={cfg.model.seq_len} is longer than the {seq} tokens the checkpoint {where} was "
            f"trained on; resume with model.seq_len={seq}, or fine-tune longer sequences with "
            f"--restore {where} checkpoint.params_only=true in a new --run-dir"
        )
    if meta.get("seed", cfg.train.seed) != cfg.train.seed:
        raise JaxdistError(
            f"train.seed={cfg.train.seed} differs from the seed {meta['seed']} of checkpoint {where}, which "
            f"fixes the data order; drop the override (or start a new --run-dir)"
        )


def changed_keys(saved: dict, cfg: Config) -> dict[str, tuple[Any, Any]]:
    """Keys whose value differs between a saved config dict and `cfg`: key -> (saved, now). A key the
    saved config lacks (added to jaxdist since) counts as its default; one `cfg` lacks cannot be compared."""
    now, defaults, before = flat(cfg.to_dict()), flat(dataclasses.asdict(Config())), flat(saved)
    if before.get("data.source", defaults["data.source"]) != "tokens":  # no token files read: no dtype
        before["data.token_dtype"] = "auto"  # (recorded as uint16 before data.data_rules.resolve_token_dtype)
    return {k: (before.get(k, defaults[k]), v) for k, v in now.items() if before.get(k, defaults[k]) != v}


def check_config_drift(meta: dict, cfg: Config, where: Path, allowed: frozenset[str] = frozenset()) -> dict:
    """Refuse a resume whose config differs from the checkpoint's in keys neither free nor allowed.
    Returns every changed key (free ones included) -> (saved, now), for the run's config history."""
    changes = changed_keys(meta.get("config", {}), cfg)
    refused = [k for k in changes if k not in FREE_KEYS and k not in allowed]
    if refused:
        listing = ", ".join(f"{k} {changes[k][0]!r} -> {changes[k][1]!r}" for k in refused)
        raise JaxdistError(
            f"resuming {where} with a changed config ({listing}); pass --allow-config-change "
            f"{','.join(refused)} to continue with the change, or drop the overrides (or use a new --run-dir)"
        )
    return changes


def check_allowed_keys(keys: frozenset[str]) -> None:
    known = set(flat(dataclasses.asdict(Config()))) | {ALLOW}  # `data`: the corpus's files may have changed
    unknown = sorted(keys - known)
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(known), n=1)
        hint = f"did you mean '{close[0]}'?" if close else "give section.key names, e.g. optim.lr"
        raise JaxdistError(f"--allow-config-change names unknown config key '{unknown[0]}': {hint}")


def saved_config(run_dir: Path) -> dict | None:
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        return None

    try:
        return yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError):
        return None


def check_run_dir_model(run_dir: Path, cfg: Config) -> None:
    """A run dir without checkpoints but with another model's config.yaml is not ours to overwrite."""
    saved = (saved_config(run_dir) or {}).get("model")
    if not isinstance(saved, dict):
        return
    now = cfg.to_dict()["model"]
    for key in SHAPE_FIELDS:
        if key in saved and saved[key] != now[key]:
            raise JaxdistError(
                f"run dir {run_dir} holds a run of a different model (model.{key}={saved[key]} "
                f"there, {now[key]} here); choose a new --run-dir"
            )
