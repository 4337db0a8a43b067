"""Fault injection: a damaged latest checkpoint, and a disk that fills up mid-run.

- Flip one bit / overwrite 64 bytes with 0xFF / truncate / delete a file of the latest checkpoint (6), or
  flip a bit of a file after dropping it from the checksum list:
  the resumed run warns, sets 6 aside, resumes from 4, and its final parameters equal those of an
  uninterrupted run (checkpoints of one run resume bit-exactly; tests/test_checkpoint.py).
- A run dir on a small tmpfs that holds two checkpoints: the third save fails; the run stops with one
  line, exit 2; checkpoints 2 and 4 are intact (checksums verify, they restore) and nothing says saved.

All runs pin the LR schedule to 8 steps (optim.schedule_steps) so runs of 6 and 8 steps match.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import SMALL_ARGS

from jaxdist import checkpoint, config, run
from jaxdist.checkpoint import integrity
from jaxdist.data import loader
from jaxdist.distributed.mesh import mesh_from_string
from jaxdist.train import main
from jaxdist.training import step

SMALL = [
    *SMALL_ARGS,
    "optim.warmup_steps=2",
    "optim.schedule_steps=8",
    "train.eval_every=0",
    "train.log_every=1",
    "checkpoint.every=2",
    "checkpoint.keep=3",
]


def quiet(*args, **kwargs):
    pass


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """R: 8 uninterrupted steps; A: the same run stopped after 6 (checkpoints 2, 4, 6)."""
    root = tmp_path_factory.mktemp("faults")
    run(config.load(None, SMALL + ["train.steps=8"]), root / "r", log=quiet)
    run(config.load(None, SMALL + ["train.steps=6"]), root / "a", log=quiet)
    return root


def _largest(folder: Path) -> Path:
    return max(
        (f for f in folder.rglob("*") if f.is_file() and "ocdbt.process_0/d/" in str(f)), key=lambda f: f.stat().st_size
    )


def flip_bit(step_dir: Path) -> None:
    f = _largest(step_dir / "params")
    b = bytearray(f.read_bytes())
    b[len(b) // 2] ^= 0x10
    f.write_bytes(bytes(b))


def ff_bytes(step_dir: Path) -> None:
    f = _largest(step_dir / "train")
    b = bytearray(f.read_bytes())
    b[100:164] = b"\xff" * 64
    f.write_bytes(bytes(b))


def truncate(step_dir: Path) -> None:
    f = _largest(step_dir / "params")
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def delete(step_dir: Path) -> None:
    _largest(step_dir / "train").unlink()


def unlisted(step_dir: Path) -> None:
    """A flipped bit in a file dropped from the checksum list: a file the list does not name is never
    verified, so its absence from the list is itself corruption (issue 39: was resumed from silently)."""
    f = _largest(step_dir / "params")
    path = step_dir / integrity.CHECKSUMS
    listed = json.loads(path.read_text())
    del listed["files"][str(f.relative_to(step_dir))]
    path.write_text(json.dumps(listed))
    flip_bit(step_dir)


@pytest.mark.parametrize("damage", [flip_bit, ff_bytes, truncate, delete, unlisted], ids=lambda f: f.__name__)
def test_damaged_latest_checkpoint_falls_back_and_ends_where_an_uninterrupted_run_does(reference, damage, tmp_path):
    """Every damage: the reader all commands share (read_checkpoint, which train's restore calls) warns once
    about step 6 and takes step 4. What follows a fallback does not depend on the damage, so one of them
    (flip_bit) also trains on: the damaged step set aside, steps 5..8 bitwise those of the uninterrupted run."""
    from jaxdist.checkpoint import restoring

    copy = tmp_path / "run"
    shutil.copytree(reference / "a", copy)
    damage(copy / "checkpoints" / "6")
    messages = []
    if damage is not flip_bit:
        got = restoring.read_checkpoint(copy, lambda manager, directory, step: step, log=messages.append)
        assert got.step == 4 and got.path == copy / "checkpoints" / "4", (got, messages)
        assert len(messages) == 1 and f"{copy}/checkpoints/6 could not be restored" in messages[0], messages
        return
    run(config.load(None, SMALL + ["train.steps=8"]), copy, log=messages.append)
    warning = [m for m in messages if m.startswith("warning: checkpoint")]
    assert len(warning) == 1 and f"{copy}/checkpoints/6 could not be restored" in warning[0], messages
    assert any(m.startswith(f"restored step 4 from {copy}/checkpoints/4") for m in messages), messages
    assert sorted(p.name.split("-")[0] for p in (copy / "checkpoints").iterdir()) == ["4", "6", "8", "unreadable"]
    want = checkpoint.load_params(reference / "r" / "checkpoints" / "8")
    got = checkpoint.load_params(copy / "checkpoints" / "8")
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got)):
        assert x.tobytes() == y.tobytes(), jax.tree_util.keystr(path)


# ---- a full disk -------------------------------------------------------------------------------------


@pytest.fixture
def small_tmpfs(tmp_path, reference):
    """A tmpfs with room for ~2.5 checkpoints of the SMALL model; skipped where mounting is not allowed."""
    ckpt = sum(f.stat().st_size for f in (reference / "a" / "checkpoints" / "2").rglob("*") if f.is_file())
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    size_kb = int(2.5 * ckpt / 1024) + 64
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here ({r.stderr.strip() or r.returncode}): full-disk test not run; it runs as "
            "root where mount is allowed (CI)"
        )
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_full_disk_stops_in_one_line_and_keeps_older_checkpoints(small_tmpfs, capsys):
    run_dir = small_tmpfs / "run"
    rc = main(["--run-dir", str(run_dir), *SMALL, "train.steps=8"])
    out, err = capsys.readouterr()
    assert rc == 2, err[-2000:]
    lines = [x for x in err.replace("\r", "\n").splitlines() if x.strip() and not re.search(r"\d+%\|", x)]
    assert len(lines) == 1 and "Traceback" not in err, lines
    assert lines[0].startswith("error: checkpoint step 6 could not be written") and "no space left" in lines[0], lines
    assert "checkpoints 2, 4 are intact" in lines[0]
    assert "step 6 saved" not in out and "step 4 saved" in out
    listing = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert listing == ["2", "4", "6.orbax-checkpoint-tmp"], listing
    for s in ("2", "4"):
        assert integrity.verify(run_dir / "checkpoints" / s) is None
    cfg = config.load(None, SMALL + ["train.steps=8"])
    prog = step.build_program(cfg, mesh_from_string("fsdp=8"))
    restored = checkpoint.restore(run_dir, prog, loader.Loader(cfg, prog.batch_sharding), cfg, log=quiet)
    assert restored.step == 4 and np.isfinite(float(jax.tree.leaves(restored.state.params)[0].sum()))
    assert os.path.getsize(run_dir / "metrics.jsonl") > 0
