"""Bad input: one table. Each row runs the CLI's `main(argv)` in-process and must exit 2 with a one-line
message naming the problem, and write or overwrite nothing.

To add a case: append a row (id, builder, expected message regex). The builder gets a `Paths` (a fresh
folder, and a saved run it may point at) and returns (options, overrides); without --run-dir the row
runs on a fresh run dir that must not appear.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
from pathlib import Path

import pytest
from conftest import SMALL_ARGS, overriding, unwritable_dir

from jaxdist import checkpoint, config
from jaxdist.data import loader as loader_mod
from jaxdist.distributed.mesh import mesh_from_string
from jaxdist.train import main
from jaxdist.training import step

SMALL = [
    *SMALL_ARGS,
    "train.steps=4",
    "train.eval_every=0",
]


@dataclasses.dataclass
class Paths:
    tmp: Path  # fresh per row
    saved: Path  # a run dir holding one checkpoint of the SMALL model (shared, must stay untouched)
    cleanup: contextlib.ExitStack  # undone after the row

    @property
    def run(self) -> Path:
        return self.tmp / "run"

    def file(self, name: str, content: bytes = b"") -> Path:
        path = self.tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        return path

    def unreadable_copy(self) -> Path:
        copy = self.tmp / "broken"
        shutil.copytree(self.saved, copy)
        for f in copy.rglob("*"):
            if f.is_file() and f.parent.name != "checkpoints" and "CHECKPOINT_METADATA" not in f.name:
                f.write_bytes(b"not a checkpoint")
        return copy

    def locked_dir(self) -> Path:
        return self.cleanup.enter_context(unwritable_dir(self.tmp / "locked"))


ROWS = [  # (id, paths -> (options, overrides), expected message)
    ("mesh/device mismatch", lambda p: (["--mesh", "dp=3"], []), r"needs 3 devices but there are 8"),
    (
        "indivisible global batch",
        lambda p: ([], ["train.global_batch=12"]),
        r"train.global_batch=12 must be divisible by .* 8 batch shards",
    ),
    (
        "unknown config key",
        lambda p: ([], ["optim.lrr=1e-3"]),
        r"unknown config key 'optim.lrr': did you mean 'optim.lr'",
    ),
    ("wrong value type", lambda p: ([], ["train.steps=ten"]), r"train.steps must be int, got 'ten'"),
    ("missing data files", lambda p: ([], [f"data.path={p.tmp}/none/*.txt"]), r"matches no files"),
    (
        "empty corpus",
        lambda p: ([], ["data.source=tokens", f"data.path={p.file('empty.bin')}"]),
        r"the corpus has 0 tokens",
    ),
    (
        "sequence longer than the model supports",
        lambda p: (["--run-dir", str(p.saved)], ["model.seq_len=64"]),
        r"model.seq_len=64 is longer than the 32 tokens the checkpoint .* was trained on",
    ),
    (
        "checkpoint dir of a different model",
        lambda p: (["--run-dir", str(p.saved)], ["model.mlp_dim=256"]),
        r"tensor params/blocks/mlp/w_down_FD has shape \(2, 128, 64\) there but \(2, 256, 64\)",
    ),
    (
        "--restore of a different model",
        lambda p: (["--restore", str(p.saved)], ["model.d_model=32"]),
        r"checkpoint .* is of a different model: tensor params/",
    ),
    (
        "unreadable checkpoint",
        lambda p: (["--restore", str(p.unreadable_copy())], []),
        r"no checkpoint under .*broken/checkpoints could be restored \(step 1:",
    ),
    ("--restore path missing", lambda p: (["--restore", str(p.tmp / "nowhere")], []), r"does not exist"),
    ("--restore without checkpoints", lambda p: (["--restore", str(p.tmp)], []), r"holds no checkpoint"),
    (
        "resume with another seed",
        lambda p: (["--run-dir", str(p.saved)], ["train.seed=1"]),
        r"train.seed=1 differs from the seed 0 of checkpoint",
    ),
    ("run dir that is a file", lambda p: (["--run-dir", str(p.file("afile"))], []), r"is a file; pass a folder path"),
    ("run dir inside a file", lambda p: (["--run-dir", str(p.file("afile") / "sub")], []), r"is not writable"),
    (
        "a flag hiding a bad override of its key",
        lambda p: (["--steps", "2"], ["train.steps=-5"]),
        r"train.steps is given twice \(--steps 2 and train.steps=-5\); give one of them",
    ),
    (
        "bad flag value",
        lambda p: (["--steps", "abc"], []),
        r"^error: python -m jaxdist.train: argument --steps: invalid int value: 'abc'; see .* --help$",
    ),
    ("negative heartbeat timeout", lambda p: (["--heartbeat-timeout", "-1"], []), r"--heartbeat-timeout -1 must be"),
    (
        "duplicate YAML key",
        lambda p: (["--config", str(p.file("dup.yaml", b"train:\n  steps: 5\n  steps: 7\n"))], []),
        r"dup.yaml: key 'steps' appears twice \(lines 2 and 3\); keep one of them",
    ),
    ("YAML off as a method", lambda p: ([], ["reduce.method=off"]), r"reduce.method='off' is not one of implicit"),
    (
        "checkpoints folder that is a file",
        lambda p: (["--run-dir", str(p.file("r/checkpoints").parent)], []),
        r"r/checkpoints is a file, where checkpoints go",
    ),
    (
        "unwritable run dir",
        lambda p: (["--run-dir", str(p.locked_dir() / "sub")], []),
        r"is not writable",
    ),
]


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    """A run dir with config.yaml and a checkpoint at step 1 (written directly, no training)."""
    run_dir = tmp_path_factory.mktemp("saved") / "run"
    cfg = config.load(None, SMALL)
    prog = step.build_program(cfg, mesh_from_string("fsdp=8"))
    loader = loader_mod.Loader(cfg, prog.batch_sharding)
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(config.dump(cfg))
    saver = checkpoint.Saver(run_dir, cfg, log=lambda *a: None)
    state = prog.init_state(0)
    saver.save(state, 1, loader)
    saver.close()
    return run_dir


def snapshot(*roots: Path) -> dict:
    """Every path under `roots` with its size and modification time."""
    out = {}
    for root in roots:
        for path in [root, *root.rglob("*")] if root.exists() else []:
            st = path.lstat()
            out[str(path)] = (st.st_size, st.st_mtime_ns, path.is_dir())
    return out


@pytest.mark.parametrize("build, message", [pytest.param(a, m, id=i) for i, a, m in ROWS])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(build, message, saved_run, tmp_path, capsys):

    with contextlib.ExitStack() as cleanup:
        run_row(Paths(tmp_path, saved_run, cleanup), build, message, capsys)


def run_row(paths, build, message, capsys):
    import re

    tmp_path, saved_run = paths.tmp, paths.saved
    options, overrides = build(paths)
    if "--run-dir" not in options:
        options = ["--run-dir", str(paths.run), *options]
    args = [*options, *overriding(SMALL, *overrides)]  # a row's overrides replace SMALL's
    before = snapshot(tmp_path, saved_run)
    rc = main(args)
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert re.search(message, lines[0]), lines[0]
    assert snapshot(tmp_path, saved_run) == before
    assert not paths.run.exists()
