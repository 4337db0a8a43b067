"""Hugging Face checkpoints in and out of jaxdist run dirs (the work of `python -m jaxdist.convert`).

from_hf writes a run dir (config.yaml + checkpoints/0 with parameters only) that
`python -m jaxdist.train --config OUT_RUN_DIR/config.yaml --restore OUT_RUN_DIR checkpoint.params_only=true`
fine-tunes; to_hf exports a run's newest parameters (read by `checkpoint.run_params.read_run`).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jaxdist import checkpoint
from jaxdist import config as config_mod
from jaxdist.adapters import peft as peft_format
from jaxdist.adapters import quant
from jaxdist.adapters import tree as adapters
from jaxdist.checkpoint import integrity, run_params
from jaxdist.checkpoint.storage import TMP_SUFFIX
from jaxdist.data import run_tokenizer
from jaxdist.data.shards import remove_stale
from jaxdist.distributed import mesh as mesh_mod
from jaxdist.errors import JaxdistError, disk_full
from jaxdist.hf import export, tensors
from jaxdist.hf.tensors import import_params


def from_hf(hf_dir: Path, out: Path, cfg, log: Callable = print) -> Path:

    if cfg.lora.rank or cfg.lora.base_dtype != "float32":  # the checkpoint holds the plain model's weights
        raise JaxdistError(
            f"convert from-hf writes the plain model (no adapters), so lora.rank={cfg.lora.rank} / "
            f"lora.base_dtype={cfg.lora.base_dtype} would describe a checkpoint it does not write; drop the lora.* "
            f"overrides, and start LoRA at training: python -m jaxdist.train --restore hf:{hf_dir} lora.rank=..."
        )
    # Decided together: process 0 must not write before every process has looked.
    if not checkpoint.all_agree(not (checkpoint.has_checkpoints(out) or (out / "config.yaml").exists())):
        raise JaxdistError(f"{out} already holds a run; choose a new OUT_RUN_DIR (nothing was overwritten)")
    export.generation_config(Path(hf_dir))  # kept in hf_source/ for the export: checked before any work
    mesh = mesh_mod.mesh_from_string(cfg.mesh.shape, dcn_text=cfg.mesh.dcn)
    start = time.perf_counter()
    params, _ = import_params(hf_dir, cfg, mesh)
    jax.block_until_ready(params)
    log(f"read {hf_dir} onto mesh {dict(mesh.shape)} in {time.perf_counter() - start:.1f}s")
    out.mkdir(parents=True, exist_ok=True)
    if jax.process_index() == 0:
        (out / "config.yaml").write_text(config_mod.dump(cfg))
        export.keep_source(hf_dir, out)

    directory = out / checkpoint.SUBDIR

    # Checksummed like a training checkpoint: before orbax publishes step 0 (process 0).
    def checksum() -> None:
        integrity.write(directory.resolve() / f"0{TMP_SUFFIX}")

    manager = checkpoint.open_manager(directory, keep=1, before_commit=checksum)
    meta = {
        "step": 0,
        "seed": cfg.train.seed,
        "config": cfg.to_dict(),
        "source": f"hf:{Path(hf_dir).resolve()}",
        integrity.META_FLAG: True,
    }
    manager.save(0, args=ocp.args.Composite(params=ocp.args.StandardSave(params), meta=ocp.args.JsonSave(meta)))
    manager.wait_until_finished()
    manager.close()
    log(f"wrote {out / checkpoint.SUBDIR / '0'} (parameters only) and {out / 'config.yaml'}")
    return out


def to_hf(
    path: Path,
    out: Path,
    dtype: str,
    max_shard_bytes: int,
    log: Callable = print,
    peft: bool = False,
    allow_base_mismatch: bool = False,
) -> list[Path]:
    """Export a run's newest intact checkpoint as an HF model; a LoRA run's adapters merged into the
    weights, or (`peft`) alone as a PEFT adapter for the original HF model (refused for an int8 / NF4
    base, whose adapters mean another model on the float base, unless `allow_base_mismatch`). The folder
    appears whole or not at all: it is written as a hidden sibling and renamed into place."""

    out = Path(out)
    _check_export_folder(out)
    directory, _ = checkpoint.checkpoint_dir(Path(path))
    recorded = run_tokenizer.of_run(directory.parent)  # checked before any work
    mesh = mesh_mod.mesh_from_string("fsdp=-1")
    got = run_params.read_run(path, mesh, log=log)
    cfg, params = got.cfg, got.params
    source = got.run_dir / tensors.SOURCE
    source = source if source.is_dir() else None
    export.generation_config(source)  # a corrupt one is copied nowhere: checked before any work
    if peft:
        return _write_peft(path, out, cfg, params, source, dtype, log, allow_base_mismatch, mesh)
    if cfg.lora.rank:  # the adapters folded into the weights: a plain checkpoint for transformers
        params = jax.jit(lambda p: adapters.merge(p, cfg.lora))(params)
        log(f"merged the LoRA adapters (rank {cfg.lora.rank}) into the base weights")
    tokenizer, token_ids = _export_tokenizer(cfg, recorded, got.run_dir)
    export.check_exportable(cfg.model)
    return _write_whole(
        out,
        lambda tmp: export.export(
            params,
            cfg.model,
            tmp,
            dtype,
            source,
            tokenizer,
            max_shard_bytes,
            lambda m: log(m.replace(str(tmp), str(out))),
            token_ids,
        ),
        log,
    )


def _check_export_folder(out: Path) -> None:
    """`out` is a folder (or not there yet) that holds no model: nothing is overwritten."""
    if out.exists() and not out.is_dir():
        raise JaxdistError(f"{out} is a file; choose a folder for the Hugging Face model")
    held = (out / "config.json").exists() or (out / "adapter_config.json").exists() or list(out.glob("*.safetensors"))
    if not checkpoint.all_agree(not held):
        raise JaxdistError(f"{out} already holds a model; choose a new HF_DIR (nothing was overwritten)")


def _write_peft(path, out: Path, cfg, params, source, dtype: str, log, allow_base_mismatch: bool, mesh) -> list[Path]:
    """A LoRA run's adapters alone, as a PEFT adapter for the HF model the run started from (recorded in
    adapter_config.json, so `AutoPeftModelForCausalLM.from_pretrained(DIR)` finds it)."""

    if not cfg.lora.rank:
        raise JaxdistError(f"{path} is not a LoRA run (lora.rank=0): --peft needs adapters; export without --peft")
    if cfg.lora.base_dtype in quant.KINDS:
        if not allow_base_mismatch:
            raise JaxdistError(
                f"{path} trained its adapters against a {cfg.lora.base_dtype}-quantised base: peft applies them "
                "to the original float weights, which is another model; export merged (drop --peft), which "
                "reproduces the trained model, or pass --allow-base-mismatch to write the adapter anyway"
            )
        log(f"warning: {base_difference(params, cfg, export.origin(source), mesh)}")
    trained = jax.device_get(adapters.trainable(params))
    blocks, dense = trained["blocks"], trained.get("dense_blocks")  # dense: DeepSeek-V3's first layers
    came_from = export.origin(source)
    base, revision = came_from.get("base_model_name_or_path", ""), came_from.get("revision")
    if not base:
        log(
            "warning: the run did not start from a Hugging Face model it recorded: adapter_config.json's "
            "base_model_name_or_path is empty; set it before AutoPeftModelForCausalLM.from_pretrained"
        )
    if jax.process_index() != 0:
        return []
    files = _write_whole(
        out,
        lambda tmp: peft_format.write(
            tmp, blocks, cfg.lora, base, export.EXPORT_DTYPES[dtype], revision, cfg.model, dense
        ),
        log,
    )
    log(f"wrote the PEFT adapter (rank {cfg.lora.rank}, {', '.join(cfg.lora.targets)}) for {base or '?'} to {out}")
    return files


def base_difference(params, cfg, came_from: dict, mesh) -> str:
    """How far the quantised base the adapters were trained against lies from the original weights (read
    again from where the run's model came from): the largest relative Frobenius difference of a tensor."""
    kind = cfg.lora.base_dtype
    what = f"the adapters were trained against a {kind} copy of the base; peft applies them to the original weights"
    local = Path(came_from.get("local") or "")
    if not came_from.get("local") or not local.is_dir():
        return f"{what} (not measured: the original model folder {came_from.get('local') or '?'} is not here)"
    plain = cfg.replace(lora=dict(rank=0, base_dtype="float32"))
    original, _ = import_params(local, plain, mesh)
    stored = jax.jit(lambda p: adapters.merge(adapters.frozen(p), cfg.lora))(params)
    rel = jax.jit(
        lambda a, b: jax.tree.map(lambda x, y: jnp.linalg.norm(x - y) / jnp.maximum(jnp.linalg.norm(y), 1e-30), a, b)
    )(stored, original)
    worst = max(((float(v), "/".join(str(getattr(k, "key", k)) for k in p)) for p, v in _leaves(rel)), default=(0, ""))
    return (
        f"{what}, which differ from {local}'s by up to {worst[0]:.2%} (relative Frobenius norm, {worst[1]}): "
        "peft's outputs will differ from the trained model's (the merged export reproduces it)"
    )


def _leaves(tree):
    return jax.tree_util.tree_flatten_with_path(tree)[0]


def _export_tokenizer(cfg, recorded, run_dir: Path) -> tuple[str, dict]:
    """(the tokenizer to copy beside the model, its eos/bos token ids for config.json): the run's
    recorded one, else data.tokenizer (a run from before recording: checked now)."""
    tokenizer = getattr(cfg.data, "tokenizer", "")
    token_ids = {}
    if recorded is not None and recorded.kind == "tokenizer":
        tokenizer = str(run_dir / run_tokenizer.FOLDER)
    elif tokenizer:
        recorded = run_tokenizer._load(tokenizer, "data.tokenizer")
    if recorded is not None and recorded.eos_id is not None:
        token_ids["eos_token_id"] = int(recorded.eos_id)
        if recorded.bos_ids:
            token_ids["bos_token_id"] = int(recorded.bos_ids[0])
    return tokenizer, token_ids


def _write_whole(out: Path, write: Callable, log) -> list[Path]:
    """`write(folder) -> files` into a hidden sibling of `out`, then renamed into place (into an existing
    folder: the model's files move in, config.json last), so the model appears whole or not at all."""

    writer = jax.process_index() == 0
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    if writer:
        remove_stale(out, log)  # a killed export's hidden folder
        shutil.rmtree(tmp, ignore_errors=True)
    try:
        files = write(tmp)
        if writer:
            files = sorted(tmp.iterdir())  # all that was written (config, tokenizer...), not only the weights
            if out.is_dir() and not any(out.iterdir()):
                out.rmdir()
            if out.exists():
                for f in sorted(tmp.iterdir(), key=lambda f: f.name == "config.json"):
                    os.replace(f, out / f.name)
            else:
                os.replace(tmp, out)
    except Exception as e:  # an OSError, or safetensors' own error around one
        if not disk_full(e):
            raise
        raise JaxdistError(
            f"cannot write {out} (no space left on device): nothing was written there (the partial export in "
            f"{tmp.name} is removed); free space, then run the same command"
        ) from None
    finally:
        if writer:
            shutil.rmtree(tmp, ignore_errors=True)
    return [out / f.name for f in files]
