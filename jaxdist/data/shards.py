"""A prepared folder on disk: token shards written (`ShardWriter`), its manifest read back, and the folder's
life cycle: `--out` checked, the new folder swapped in whole, the hidden leftovers of a killed run removed.

`python -m jaxdist.data prepare` (prepare.py) writes it; the loader and the corpus check read it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import BinaryIO

import numpy as np

from jaxdist.errors import JaxdistError

MANIFEST = "manifest.json"
FORMAT = "jaxdist-tokens/1"


class ShardWriter:
    """Appends token arrays to `folder/000000.bin`, ... of at most `shard_tokens` tokens each."""

    def __init__(self, folder: Path, dtype: str, shard_tokens: int):
        self.folder, self.dtype, self.shard_tokens = folder, dtype, shard_tokens
        self.files: list[str] = []
        self.tokens = self.documents = self._in_shard = 0
        self._fh: BinaryIO | None = None

    def write(self, ids: np.ndarray, documents: int) -> None:
        self.documents += documents
        ids = ids.astype(self.dtype)
        while len(ids):
            fh = self._fh
            if fh is None or self._in_shard == self.shard_tokens:
                fh = self._open()
            take = min(len(ids), self.shard_tokens - self._in_shard)
            fh.write(ids[:take].tobytes())
            self._in_shard, self.tokens, ids = self._in_shard + take, self.tokens + take, ids[take:]

    def _open(self) -> BinaryIO:
        self.close()
        self.folder.mkdir(parents=True, exist_ok=True)
        name = f"{len(self.files):06d}.bin"
        self.files.append(f"{self.folder.name}/{name}")
        self._fh, self._in_shard = open(self.folder / name, "wb"), 0  # noqa: SIM115 (closed by close())
        return self._fh

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def summary(self) -> dict:
        return {"files": self.files, "tokens": self.tokens, "documents": self.documents}


def check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise JaxdistError(f"--out {out} is a file; give a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise JaxdistError(f"--out {out} exists and is not empty; choose a new folder or pass --overwrite")
    probe = out
    while not probe.exists():
        probe = probe.parent
    if not os.access(probe, os.W_OK):
        raise JaxdistError(f"--out {out}: {probe} is not writable; choose a folder you can write to")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_stale(out: Path, log=print) -> list[Path]:
    """The hidden `.OUT.tmp-PID` / `.OUT.old-PID` folders a killed run left beside `out` (their process
    is gone on this host): removed, so they do not pile up. A live writer's folder is left alone."""
    removed = []
    for p in sorted(out.parent.glob(f".{out.name}.*-*")):
        kind, _, pid = p.name[len(out.name) + 2 :].partition("-")
        if kind in ("tmp", "old") and pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            removed.append(p)
            log(f"removed {p}, left by a process that is gone (pid {pid})")
    return removed


def replace_folder(tmp: Path, out: Path) -> None:
    """Move the finished folder into place; an old --out (with --overwrite) goes only after that."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _looks_prepared(folder: Path) -> bool:
    """`train/` or `val/` holding token shards (`*.bin`): the layout prepare writes."""
    return any(next((folder / split).glob("*.bin"), None) is not None for split in ("train", "val"))


def read_manifest(folder: Path) -> dict | None:
    """The manifest of a prepared folder, or None if `folder` is not one. No manifest, no token read:
    a folder laid out as prepare writes it (train/ or val/ with .bin shards) but without a valid
    manifest.json is refused, never read as text files or as raw tokens."""
    path = folder / MANIFEST
    if not path.is_file():
        if _looks_prepared(folder):
            raise JaxdistError(
                f"prepared folder {folder}: no {MANIFEST} beside its token shards (train/*.bin, val/*.bin), and only "
                "it says what they are (dtype, tokenizer, token counts); restore it or re-run prepare"
            )
        return None
    try:
        manifest = json.loads(path.read_text())
    except ValueError:
        raise JaxdistError(f"{path} is not valid JSON; re-run prepare or remove it") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        if _looks_prepared(folder):
            raise JaxdistError(
                f"prepared folder {folder}: its {MANIFEST} is not a jaxdist manifest (format {FORMAT!r} expected) "
                "although the folder holds token shards; restore it or re-run prepare"
            )
        return None
    return manifest
