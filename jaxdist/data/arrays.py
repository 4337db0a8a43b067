"""The token arrays a data path names, read and checked: text files as byte tokens or as documents encoded
with `data.tokenizer`, flat token files memory-mapped with every id checked against the vocabulary, and a
prepared folder's train/ and val/ shards (checked against its manifest, with the loss masks of chat and
preference data). jaxdist/data/loader.py cuts them into windows and batches."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from jaxdist.config import Config
from jaxdist.data import prefprep, tokenizer
from jaxdist.data.corpus import check_prepared
from jaxdist.data.files import expand_path
from jaxdist.data.loss_mask import Masked
from jaxdist.data.shards import read_manifest
from jaxdist.errors import JaxdistError


def prepared(path: str) -> dict | None:
    """The manifest when `path` is a folder made by `python -m jaxdist.data prepare`."""
    return read_manifest(Path(path).expanduser()) if path and os.path.isdir(os.path.expanduser(path)) else None


def read_documents(files: list[str], tokenizer_path: str, vocab_size: int) -> np.ndarray:
    """Tokens of all files, one document each, `[BOS] tokens EOS` by the tokenizer's rule."""
    tok = tokenizer.load(tokenizer_path)
    tokenizer.check_vocab(tok, vocab_size, f"data.tokenizer={tokenizer_path}")
    texts = []
    for f in files:
        try:
            texts.append(Path(f).read_bytes().decode("utf-8", errors="replace"))
        except OSError as e:
            raise JaxdistError(f"cannot read data file {f} ({e.strerror}); fix its permissions or data.path")
    ids = tok.encode_documents(texts)
    return np.concatenate(ids).astype(tok.dtype) if ids else np.zeros(0, tok.dtype)


def read_text(files: list[str], separator: int) -> np.ndarray:
    """Byte-level tokens of all files, each document followed by the separator byte."""
    parts = []
    for f in files:
        try:
            parts.append(Path(f).read_bytes())
        except OSError as e:
            raise JaxdistError(f"cannot read data file {f} ({e.strerror}); fix its permissions or data.path")
        parts.append(bytes([separator]))
    return np.frombuffer(b"".join(parts), dtype=np.uint8)


def read_tokens(files: list[str], dtype: str) -> list[np.ndarray]:
    arrays = []
    for f in files:
        size = os.path.getsize(f)
        if size % np.dtype(dtype).itemsize:
            raise JaxdistError(f"token file {f} has {size} bytes, not a multiple of {dtype}; check data.token_dtype")
        if size:
            arrays.append(np.memmap(f, dtype=dtype, mode="r"))
    return arrays


def check_vocab(files: list[str], arrays: list[np.ndarray], vocab_size: int, chunk: int = 1 << 26) -> None:
    """Every token of every file is < vocab_size (an id beyond the embedding gives NaN gradients steps
    later). Reads each memory-mapped file once, in chunks: ~0.1-0.3 s per GB from the page cache."""
    for f, a in zip(files, arrays):
        for lo in range(0, len(a), chunk):
            block = a[lo : lo + chunk]
            top = int(block.max())
            if top >= vocab_size:
                at = lo + int(np.argmax(block >= vocab_size))
                raise JaxdistError(
                    f"token id {int(a[at])} at position {at} of {f} is >= model.vocab_size="
                    f"{vocab_size}; set model.vocab_size to the tokenizer's size (or fix the file)"
                )


def prepared_arrays(cfg: Config, manifest: dict) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """A prepared folder's (train/, val/) shards, with the dtype and vocabulary its manifest records."""
    d, folder = cfg.data, Path(cfg.data.path).expanduser()
    if "prompts" in manifest:  # data/promptprep.py: rollouts are sampled from them, no tokens to train on
        raise JaxdistError(
            f"{folder} holds GRPO prompts (prepare --prompts), not training tokens; python -m jaxdist.train "
            "does not run GRPO yet: use jaxdist.inference.rollout.GRPORun (scripts/studies/grpo_recipe.py)"
        )
    if manifest["vocab_size"] > cfg.model.vocab_size:
        raise JaxdistError(
            f"{folder} was prepared with {manifest['vocab_size']} token ids but model.vocab_size="
            f"{cfg.model.vocab_size}; set model.vocab_size={manifest['vocab_size']} (or more), or, for a "
            "--restore'd model (whose vocabulary is fixed), re-run prepare with its tokenizer (--tokenizer MODEL_DIR)"
        )
    if d.tokenizer and tokenizer.load(d.tokenizer).sha256 != manifest["tokenizer"]["sha256"]:
        raise JaxdistError(
            f"data.tokenizer={d.tokenizer} is not the tokenizer {folder} was prepared with "
            f"(sha256 differs); use data.tokenizer={folder} or re-run prepare"
        )

    check_prepared(folder, manifest)  # every shard there, each split the tokens its manifest records
    arrays = []
    for name in ("train", "val"):
        files = [str(folder / f) for f in manifest["splits"][name]["files"]]
        arrays.append(read_tokens(files, manifest["dtype"]))
        check_vocab(files, arrays[-1], cfg.model.vocab_size)
    check_pairs(cfg, manifest, folder)
    if "chat" in manifest or "preference" in manifest:  # with a loss mask (data/chatprep.py, data/prefprep.py)
        arrays = chat_arrays(cfg, manifest, folder, arrays)
    return arrays[0], arrays[1]


def check_pairs(cfg: Config, manifest: dict, folder: Path) -> None:
    """Preference pairs (prepare --preference) train under a pairwise objective, and only they."""
    pairs = "preference" in manifest
    if pairs and not prefprep.paired(cfg):
        raise JaxdistError(
            f"{folder} holds preference pairs (prepare --preference) but objective.method={cfg.objective.method}; "
            f"set objective.method to one of {', '.join(prefprep.PAIRED)}"
        )
    if not pairs and prefprep.paired(cfg):
        raise JaxdistError(
            f"objective.method={cfg.objective.method} trains on preference pairs but {folder} holds none; "
            "prepare them with python -m jaxdist.data prepare --preference"
        )


def chat_arrays(cfg: Config, manifest: dict, folder: Path, arrays: list[list[np.ndarray]]) -> list[list]:
    """Each split's token shards joined with their loss masks (`jaxdist.data.loss_mask.Masked`); the windows
    must be the ones the conversations were packed into."""
    kind = "chat" if "chat" in manifest else "preference"
    seq_len = manifest[kind]["seq_len"]
    if kind == "chat" and not cfg.data.document_mask:  # packed conversations would attend to each other
        raise JaxdistError(
            f"{folder} holds chat conversations packed several to a window; set data.document_mask=true so "
            "each attends only to itself (without it, attention crosses conversations)"
        )
    if cfg.model.seq_len != seq_len:
        what = "packs conversations into windows" if kind == "chat" else "holds preference rows"
        raise JaxdistError(
            f"{folder} {what} of {seq_len} tokens but model.seq_len="
            f"{cfg.model.seq_len}; set model.seq_len={seq_len} or re-run prepare --{kind} --seq-len {cfg.model.seq_len}"
        )
    out = []
    for name, split in zip(("train", "val"), arrays):
        masks = check_masks(folder, name, manifest["splits"][name])
        if [len(m) for m in masks] != [len(a) for a in split]:
            raise JaxdistError(
                f"{folder}/{name}: the .mask files do not match the token files; re-run prepare --{kind}"
            )
        out.append([Masked(a, m) for a, m in zip(split, masks)])
    return out


def check_masks(folder: Path, name: str, split: dict) -> list[np.ndarray]:
    """A chat split's loss masks, checked against its manifest: every file there, every value 0 or 1, and
    as many trained tokens as prepare counted (an all-zero mask would train on nothing: loss nan)."""
    masks, trained = [], 0
    for f in split["mask_files"]:
        if not (folder / f).is_file():
            raise JaxdistError(
                f"prepared folder {folder}: {f} is missing (its manifest.json lists it); restore it or re-run prepare"
            )
        m = np.memmap(folder / f, dtype=np.uint8, mode="r") if (folder / f).stat().st_size else np.zeros(0, np.uint8)
        if len(m) and int(m.max()) > 1:
            raise JaxdistError(
                f"prepared folder {folder}: {f} holds the value {int(m.max())} where a loss mask holds only 0 or 1 "
                "(changed or corrupted); restore it or re-run prepare"
            )
        masks.append(m)
        trained += int(np.count_nonzero(m))
    want = split.get("trained_tokens")
    if want is not None and trained != want:
        raise JaxdistError(
            f"prepared folder {folder}: the {name}/ masks mark {trained:,} tokens to train on but its manifest.json "
            f"records {want:,} (a .mask file was changed); restore it or re-run prepare"
        )
    return masks


def token_arrays(cfg: Config) -> tuple[list[np.ndarray], list[np.ndarray] | None, str]:
    """(training arrays, a prepared folder's val/ arrays or None, what was read) of `data.source=tokens`."""
    d = cfg.data
    if not d.path:
        raise JaxdistError("data.source=tokens needs data.path, a folder or glob of binary token files")
    manifest = prepared(d.path)
    if manifest is not None:
        train, val = prepared_arrays(cfg, manifest)
        shards = {name: len(manifest["splits"][name]["files"]) for name in ("train", "val")}
        n = shards["train"] + shards["val"]
        what = (
            f"{n:,} token shard{'s' if n != 1 else ''} ({d.path}: {shards['train']:,} train/ + "
            f"{shards['val']:,} val/, {manifest['dtype']} from its manifest.json)"
        )
        if "chat" in manifest:  # what the loss covers, said once at start-up
            trained = sum(manifest["splits"][name].get("trained_tokens", 0) for name in ("train", "val"))
            total = sum(manifest["splits"][name]["tokens"] for name in ("train", "val"))
            covers = "every token" if manifest["chat"].get("loss_on") == "all" else "the assistant's tokens only"
            what += (
                f"; chat: loss on {covers} ({trained:,} of {total:,} tokens), attention inside each "
                "conversation (data.document_mask)"
            )
        return train, val, what
    if d.tokenizer:
        tokenizer.check_vocab(tokenizer.load(d.tokenizer), cfg.model.vocab_size, f"data.tokenizer={d.tokenizer}")
    files = [f for f in expand_path(d.path) if os.path.getsize(f)]
    arrays = read_tokens(files, d.token_dtype)
    check_vocab(files, arrays, cfg.model.vocab_size)  # every token, not a sample
    return arrays, None, f"{len(files):,} token file{'s' if len(files) != 1 else ''} ({d.path}, {d.token_dtype})"
