"""jaxdist parameters -> a Hugging Face folder: parameters are restored onto the mesh, then gathered
and written tensor by tensor into safetensors shards of at most `max_shard_bytes` (one shard's tensors
are on the host at once), with config.json, generation_config.json and the tokenizer files.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from jax.experimental import multihost_utils
from safetensors.numpy import save_file

from jaxdist.config import ModelConfig
from jaxdist.errors import JaxdistError
from jaxdist.hf import families, hub, mapping
from jaxdist.hf.tensors import SIDE_FILES, SOURCE, TOKENIZER_FILES, layer_shape, names

EXPORT_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def _host(x) -> np.ndarray:
    """A global array gathered onto this host (every process takes part)."""
    if jax.process_count() > 1:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def check_exportable(m: ModelConfig) -> None:
    """A model `model.family`'s architecture cannot hold (experts in a dense family, an embedding
    multiplier, ...) would load without error in transformers and compute something else, so it is
    refused before anything is written (hf_families.exportable)."""
    families.exportable(m)


def export(
    params: dict,
    m: ModelConfig,
    out_dir: Path,
    dtype: str,
    source_dir: Path | None = None,
    tokenizer: str = "",
    max_shard_bytes: int = 5 * 10**9,
    log: Callable = print,
    token_ids: dict | None = None,
) -> list[Path]:
    """Write `params` (unstaged jaxdist parameters) as a Hugging Face model directory of `m.family`. Process 0 writes.
    `token_ids`: bos/eos ids of the run's recorded tokenizer, for what the imported config leaves null."""
    check_exportable(m)
    np_dtype = EXPORT_DTYPES[dtype]
    entries = []  # (hf name, tensor, index into the stack or None, bytes)
    for t in mapping.tensors(m):
        size = mapping._prod(layer_shape(t, m)) * np.dtype(np_dtype).itemsize
        per = m.moe_experts if t.experts else 1  # per-expert tensors: (layer, expert)
        entries += [
            (name, t, divmod(i, per) if t.experts else (i if t.stacked else None), size)
            for i, name in enumerate(names(t, m))
        ]
    shards: list[list] = [[]]
    for e in entries:
        if shards[-1] and sum(x[3] for x in shards[-1]) + e[3] > max_shard_bytes:
            shards.append([])
        shards[-1].append(e)
    writer = jax.process_index() == 0
    out_dir = Path(out_dir)
    if writer:
        out_dir.mkdir(parents=True, exist_ok=True)
    files, weight_map = [], {}
    take = jax.jit(lambda a, i: a[i])  # one layer (or (layer, expert)) of a stack, still sharded; gathered after
    for k, shard in enumerate(shards):
        file = "model.safetensors" if len(shards) == 1 else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, t, layer, _ in shard:
            a = mapping.get_path(params, t.path)
            host = _host(take(a, layer) if layer is not None else a)
            tensors[name] = np.ascontiguousarray(mapping.to_hf(host, t.n_in).astype(np_dtype))
            weight_map[name] = file
        if writer:
            save_file(tensors, str(out_dir / file), metadata={"format": "pt"})
            log(f"wrote {out_dir / file} ({len(tensors)} tensors)")
        files.append(out_dir / file)
        del tensors
    if not writer:
        return files
    if len(shards) > 1:
        total = sum(e[3] for e in entries)
        (out_dir / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
    source = _source_config(source_dir)
    source.update({k: v for k, v in (token_ids or {}).items() if source.get(k) is None})
    (out_dir / "config.json").write_text(json.dumps(mapping.to_hf_config(m, dtype, source), indent=2))
    if source_dir is not None and generation_config(source_dir) is not None:  # checked, then copied as it is
        shutil.copyfile(source_dir / "generation_config.json", out_dir / "generation_config.json")
    else:
        gen = {k: source.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id") if source.get(k) is not None}
        (out_dir / "generation_config.json").write_text(json.dumps({"_from_model_config": True, **gen}, indent=2))
    copy_tokenizer(tokenizer, source_dir, out_dir)
    return files


def generation_config(source_dir: Path | None) -> dict | None:
    """The imported model's generation_config.json (a JSON object whose token ids are ids), or None."""
    path = source_dir / "generation_config.json" if source_dir else None
    if path is None or not path.is_file():
        return None
    config = mapping.read_json(path, "generation_config.json")
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = config.get(key)
        ids = value if isinstance(value, list) else [value]
        if value is not None and not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise JaxdistError(
                f"{path}: {key} is {str(value)[:80]}, not a token id or a list of them; fix the file or copy it "
                "again from the model"
            )
    return config


def _source_config(source_dir: Path | None) -> dict:
    path = source_dir / "config.json" if source_dir else None
    return mapping.read_json(path, "config.json") if path is not None and path.is_file() else {}


def copy_tokenizer(tokenizer: str, source_dir: Path | None, out_dir: Path) -> None:
    """The run's tokenizer (`data.tokenizer`: a tokenizer.json or an HF directory), else the imported one."""
    if tokenizer:
        path = Path(tokenizer)
        if path.is_file():
            shutil.copyfile(path, out_dir / "tokenizer.json")
            return
        if not path.is_dir():
            raise JaxdistError(f"data.tokenizer={tokenizer} does not exist; the export needs the run's tokenizer")
        source_dir = path
    for name in TOKENIZER_FILES:
        if source_dir is not None and (source_dir / name).is_file():
            shutil.copyfile(source_dir / name, out_dir / name)


ORIGIN = "origin.json"  # in hf_source/: the Hub id (or folder) the model came from, for a PEFT export's base


def keep_source(hf_dir: Path, run_dir: Path) -> None:
    """Copy the HF model's config, generation config and tokenizer into `run_dir/hf_source/`, so an
    export gets the same token ids and tokenizer back, and record where the model came from (`origin`)."""
    target = Path(run_dir) / SOURCE
    target.mkdir(parents=True, exist_ok=True)
    name, revision = hub.base_model_name(Path(hf_dir))
    origin = {"base_model_name_or_path": name, "revision": revision, "local": str(Path(hf_dir).resolve())}
    (target / ORIGIN).write_text(json.dumps(origin, indent=2))
    for name in SIDE_FILES:
        if (Path(hf_dir) / name).is_file():
            shutil.copyfile(Path(hf_dir) / name, target / name)


def origin(source_dir: Path | None) -> dict:
    """Where the run's Hugging Face model came from ({base_model_name_or_path, revision, local}); a run
    recorded before `origin.json` existed falls back to its config.json's `_name_or_path` (maybe "")."""
    path = source_dir / ORIGIN if source_dir else None
    if path is not None and path.is_file():
        return mapping.read_json(path, ORIGIN)
    return {"base_model_name_or_path": _source_config(source_dir).get("_name_or_path", ""), "revision": None}
