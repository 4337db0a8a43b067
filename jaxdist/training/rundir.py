"""The run folder: a path the checkpoint stack can store, one trainer at a time, and a config history.

- Paths: orbax expands glob patterns (`*`, `?`, `[...]`) in the folder it merges array files from, so
  `runs/lr[3e-3]` saves steps whose arrays cannot be read back, and `runs/a*` could merge another
  run's files; tensorstore reads `\\` as a separator. Such run dirs are refused before anything runs.
- Lock: `<run_dir>/jaxdist.lock` holds the owner's host and pid under an exclusive `flock`. The kernel
  drops a flock when its process dies, so a lock left by a crashed trainer is stale by construction
  and is simply taken over; a live owner makes a second trainer stop with one line.
- History: `config.yaml` is the config the run started with and is never overwritten; every later
  start whose resolved config differs writes `config.<n>.yaml`, headed by the step and changed keys.
- Default folder (no `--run-dir`): `runs/<config name>-<8 hex digits>`, the digits a hash of the
  resolved config without the keys a resume may change (`checkpoint.compat.FREE_KEYS`: train.steps,
  checkpoint.*, logging, mesh, ...) and other architectures' model fields, and of `--restore`. So the same command finds the same folder and
  resumes it (after Ctrl-C, SIGTERM, a SLURM requeue), `--steps 600` after `--steps 300` extends the
  same run, and a config that a resume would refuse gets a folder of its own.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import socket
import time
from pathlib import Path

from jaxdist.checkpoint.compat import FREE_KEYS, OMITTED_AT_DEFAULT, check_allowed_keys, flat
from jaxdist.checkpoint.storage import SUBDIR
from jaxdist.config import REGROUPED, Config
from jaxdist.data.files import RUN_LOCK as LOCK
from jaxdist.errors import JaxdistError
from jaxdist.models import registry

# A write that fails for these reasons (the lock, config.yaml, the tokenizer record, ...) is the
# user's environment, not a bug: one line instead of a traceback.
WRITE_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO, errno.EFBIG}
UNSTORABLE = {"*": "glob", "?": "glob", "[": "glob", "]": "glob", "\\": "path separator"}


def check_storable(path: Path, flag: str = "--run-dir") -> None:
    """Refuse a folder whose absolute path orbax/tensorstore would misread."""
    text = str(Path(path).absolute())
    bad = sorted({c for c in text if c in UNSTORABLE})
    if bad:
        raise JaxdistError(
            f"{flag} {path}: checkpoints cannot be stored under a path containing "
            f"{' '.join(repr(c) for c in bad)} (orbax reads it as a {UNSTORABLE[bad[0]]} "
            "character); choose a folder name without it"
        )


def identity(cfg: Config, restore: str | None = None) -> str:
    """8 hex digits naming what a run computes: the resolved config without the keys a resume may
    change, and where it starts from."""

    # Another architecture's model fields (at their defaults) are not part of what this run computes.
    inert = {f"model.{f}" for f in registry.inert_fields(cfg.model)}
    unnamed = lambda k, v: k in FREE_KEYS | inert or (k in OMITTED_AT_DEFAULT and v == OMITTED_AT_DEFAULT[k])
    old_name = {new: old for old, new in REGROUPED.items()}  # reduce.topk.dgc hashes as reduce.dgc did
    kept = {old_name.get(k, k): v for k, v in sorted(flat(cfg.to_dict()).items()) if not unnamed(k, v)}
    text = json.dumps({"config": kept, "restore": restore or ""}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def default_run_dir(
    cfg: Config, config_name: str | None, restore: str | None = None, root: Path = Path("runs")
) -> Path:
    """runs/<config name>-<identity>: the folder the same command finds again."""
    name = Path(config_name).stem if config_name else "tiny"
    return root / f"{name}-{identity(cfg, restore)}"


def prepare(run_dir: str | None, cfg: Config, config_name: str | None = None, restore: str | None = None) -> Path:
    """Check (do not yet create) the run folder, so bad input writes nothing. Without `run_dir`: the
    folder named by the config (`default_run_dir`), which the same command finds again."""
    path = Path(run_dir) if run_dir else default_run_dir(cfg, config_name, restore)
    check_storable(path)
    if path.exists() and not path.is_dir():
        raise JaxdistError(f"--run-dir {path} is a file; pass a folder path")
    ckpts = path / SUBDIR
    if ckpts.exists() and not ckpts.is_dir():  # else the first save fails, steps later
        raise JaxdistError(f"{ckpts} is a file, where checkpoints go; move it away or choose another --run-dir")
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK):
        raise JaxdistError(f"--run-dir {path}: {probe} is not writable; choose a folder you can write to")
    return path


def allowed_changes(text: str) -> frozenset[str]:
    """--allow-config-change's keys, checked: those a resume may change."""
    keys = frozenset(k.strip() for k in text.split(",") if k.strip())
    check_allowed_keys(keys)
    return keys


def _owner(path: Path) -> str:
    try:
        info = json.loads(path.read_text())
        return f"pid {info['pid']} on host {info['host']}, since {info['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "owner unknown"


class RunLock:
    """`check()` before any write (reads only); `take()` (`acquire()`) when the run starts writing; `release()`."""

    def __init__(self, run_dir: Path | str):
        self.path = Path(run_dir) / LOCK
        self.fd: int | None = None

    def refused(self) -> JaxdistError:
        return JaxdistError(
            f"run dir {self.path.parent} is in use by another trainer ({_owner(self.path)}); "
            "wait for it to finish, stop it, or choose another --run-dir"
        )

    def check(self) -> None:
        if not self.path.is_file():
            return
        fd = os.open(self.path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise self.refused() from None
        finally:
            os.close(fd)  # closing drops the probe's lock

    def acquire(self) -> str | None:
        """Take the lock; returns a note on the stale lock taken over, if there was one."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise self.refused() from None
        previous = os.read(fd, 4096).decode(errors="replace").strip()
        stale = f"took over the stale lock of {_owner(self.path)}" if previous else None
        record = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode() + b"\n", 0)
        self.fd = fd
        return stale

    def take(self, log) -> bool:
        """`acquire()` as the run starts writing: False when another trainer holds it; a full disk or a
        read-only folder is one line; a stale lock taken over is said."""
        try:
            note = self.acquire()
        except JaxdistError:
            return False
        except OSError as e:  # e.g. a full disk at the lock's write: not another trainer
            if e.errno not in WRITE_ERRORS:
                raise
            raise JaxdistError(
                f"cannot write the lock {self.path} ({(e.strerror or str(e)).lower()}); free space or fix the "
                "folder, then run the same command to resume"
            ) from None
        if note:
            log(note)
        return True

    def release(self) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)  # an empty lock file: nobody to name as stale
            os.close(self.fd)
            self.fd = None


def record_config(run_dir: Path, text: str, step: int, changes: dict) -> Path | None:
    """Write `config.yaml` on the first start; later, `config.<n>.yaml` when the config changed."""
    run_dir = Path(run_dir)
    first = run_dir / "config.yaml"
    if not first.exists():
        first.write_text(text)
        return first
    numbers = sorted(int(p.name.split(".")[1]) for p in run_dir.glob("config.*.yaml") if p.name.split(".")[1].isdigit())
    try:
        latest = (
            (run_dir / f"config.{numbers[-1]}.yaml").read_text().split("\n", 2)[2] if numbers else first.read_text()
        )
    except (OSError, UnicodeDecodeError, IndexError):
        latest = None
    if latest == text:
        return None
    listing = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changes.items()) or "none from the checkpoint"
    path = run_dir / f"config.{(numbers[-1] if numbers else 0) + 1}.yaml"
    path.write_text(f"# resumed at step {step} on {time.strftime('%Y-%m-%d %H:%M:%S')}\n# changed: {listing}\n{text}")
    return path
