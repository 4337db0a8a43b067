"""Checksums of every file of a checkpoint: written before orbax makes the step visible, verified on restore.

orbax writes no checksums of its own, so a flipped bit or a truncated array file loads silently. Here,
once every process has written its files and before the rename that publishes `<step>`, process 0
hashes each file (xxh3-64, a fast non-cryptographic hash: it detects corruption, not tampering) into
`<step>/jaxdist-checksums.json`. The rename then publishes data and checksums together, so a visible
step always has them. On restore each process verifies its share of the files (sizes first, then
hashes) and all agree, so a checkpoint that fails anywhere is set aside like an unreadable one. Every
file present must be in the list: a file the list does not name (a list emptied or cut short, a file
added) is never verified, so it makes the checkpoint as corrupt as a mismatch does.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import xxhash

CHECKSUMS = "jaxdist-checksums.json"
# orbax rewrites its step metadata (commit time) during the rename, after the checksums, and writes the
# step's commit_success.txt marker then too: not covered. The metadata is small JSON that orbax parses
# itself (a damaged one fails to read and is handled as unreadable); the marker holds no data.
UNCOVERED = {CHECKSUMS, "_CHECKPOINT_METADATA", "commit_success.txt"}
CHUNK = 16 << 20
# Set in a checkpoint's meta item by every writer that publishes a checksum file: without the file,
# such a checkpoint lost it (corrupt), rather than predating checksums.
META_FLAG = "checksums_written"


def _digest(path: Path) -> str:
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def _files(step_dir: Path) -> list[str]:
    return sorted(
        str(p.relative_to(step_dir))
        for p in step_dir.rglob("*")
        if p.is_file() and str(p.relative_to(step_dir)) not in UNCOVERED
    )


def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1))  # the hash releases the GIL


def write(step_dir: Path) -> int:
    """Hash every file under `step_dir` into its checksum file; returns the bytes hashed."""
    step_dir = Path(step_dir)
    names = _files(step_dir)
    with _pool() as pool:
        digests = list(pool.map(lambda n: _digest(step_dir / n), names))
    table = {n: {"bytes": (step_dir / n).stat().st_size, "xxh3_64": d} for n, d in zip(names, digests)}
    tmp = step_dir / (CHECKSUMS + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"algorithm": "xxh3_64", "files": table}, f)
        f.flush()
        os.fsync(f.fileno())
    tmp.rename(step_dir / CHECKSUMS)
    return sum(v["bytes"] for v in table.values())


def has_checksums(step_dir: Path) -> bool:
    return (Path(step_dir) / CHECKSUMS).is_file()


def verify(step_dir: Path, share: tuple[int, int] = (0, 1)) -> str | None:
    """None if this process's share (`index`, `count`) of the files matches; else what is wrong.
    A checkpoint without a checksum file (written before jaxdist kept them) is not verified here."""
    step_dir = Path(step_dir)
    try:
        table = json.loads((step_dir / CHECKSUMS).read_text())["files"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return f"its checksum file {CHECKSUMS} is unreadable"
    if not isinstance(table, dict) or not all(
        isinstance(v, dict) and isinstance(v.get("bytes"), int) and isinstance(v.get("xxh3_64"), str)
        for v in table.values()
    ):
        return f"its checksum file {CHECKSUMS} is unreadable"
    unlisted = [n for n in _files(step_dir) if n not in table]  # a listing: cheap, so every process checks all
    if unlisted:
        more = f" and {len(unlisted) - 1} more" if len(unlisted) > 1 else ""
        return f"file {unlisted[0]}{more} is not in its checksum file {CHECKSUMS} (the list was altered), so it cannot be verified"
    index, count = share
    names = sorted(table)[index::count]
    for name in names:  # cheap checks first: a missing or truncated file needs no hashing
        path = step_dir / name
        if not path.is_file():
            return f"file {name} is missing"
        size = path.stat().st_size
        if size != table[name]["bytes"]:
            return f"file {name} has {size} bytes, {table[name]['bytes']} were written"
    with _pool() as pool:
        digests = list(pool.map(lambda n: _digest(step_dir / n), names))
    for name, digest in zip(names, digests):
        if digest != table[name]["xxh3_64"]:
            return f"file {name} does not match the checksum written with it (corrupted on disk)"
    return None
