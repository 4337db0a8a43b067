"""The corpus a run reads, checked: a prepared folder's files against its manifest, and a fingerprint
(file names and sizes) that a checkpoint records so a resume on a changed corpus is refused.

Why refuse: the data order (windows shuffled from the seed) and the held-out split are functions of
the files; a file added, removed or resized since the checkpoint moves both under the run, and the
resumed curve silently stops being one run. `--allow-config-change data` accepts the change.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from jaxdist.data.files import expand_path, stdlib_files
from jaxdist.data.shards import read_manifest
from jaxdist.errors import JaxdistError

ALLOW = "data"  # the --allow-config-change name that accepts a changed corpus


def check_prepared(folder: Path, manifest: dict) -> None:
    """Every shard the manifest lists is there, and each split holds the tokens it records."""
    itemsize = 4 if manifest.get("dtype") == "uint32" else 2
    for name, split in manifest["splits"].items():
        size = 0
        for f in split["files"]:
            path = folder / f
            if not path.is_file():
                raise JaxdistError(
                    f"prepared folder {folder}: {f} is missing (its manifest.json lists it); restore it or re-run prepare"
                )
            size += path.stat().st_size
        if size != split["tokens"] * itemsize:
            raise JaxdistError(
                f"prepared folder {folder}: {name}/ holds {size // itemsize:,} tokens but its manifest.json "
                f"records {split['tokens']:,} (a shard was truncated or changed); restore it or re-run prepare"
            )


def files(cfg) -> list[str]:
    """The files this config's data comes from (both splits of a prepared folder; every source's)."""
    d = cfg.data
    if d.sources:
        return [f for src in d.sources for f in files(cfg.replace(data=dict(path=src.path, sources=[], stages=[])))]
    folder = Path(d.path).expanduser() if d.path else None
    manifest = read_manifest(folder) if folder is not None and folder.is_dir() else None
    if manifest is not None:
        root = Path(d.path).expanduser()
        return [str(root / f) for s in manifest["splits"].values() for f in s["files"]]
    return expand_path(d.path) if d.path else stdlib_files()


def fingerprint(cfg) -> dict:
    """{files, bytes, sha256 of the names and sizes}: what a checkpoint records of its corpus."""
    h, total, names = hashlib.sha256(), 0, files(cfg)
    for f in names:
        size = os.path.getsize(f)
        total += size
        h.update(f"{f}\0{size}\n".encode())
    return {"files": len(names), "bytes": total, "sha256": h.hexdigest()}


def check_unchanged(meta: dict, cfg, where: Path, allowed: frozenset[str]) -> None:
    """Refuse a resume whose corpus differs from the one the checkpoint was trained on."""
    saved = meta.get("corpus")
    if not saved or allowed & {ALLOW, "data.path", "data.source", "data.sources"}:  # a new corpus accepted by name
        return
    try:
        now = fingerprint(cfg)
    except (OSError, JaxdistError):
        return  # unreadable data is reported by the loader, in its own words
    if now["sha256"] != saved.get("sha256"):
        raise JaxdistError(
            f"resuming {where} on a corpus that changed since it was saved ({saved.get('files')} files, "
            f"{saved.get('bytes'):,} bytes then; {now['files']} files, {now['bytes']:,} bytes now), which moves "
            f"the data order and the held-out split; pass --allow-config-change {ALLOW} to continue on it, "
            "or restore the files"
        )
