"""Nothing read unchecked (issue 27): every command that reads a run verifies what it reads and fails in
one line, exit 2, nothing written.

- checksums: train --restore, convert to-hf and generate --run-dir read through one function
  (`checkpoint.restoring.read_checkpoint`), so a flipped byte stops each of them alike; a checksum file
  missing although the checkpoint's meta says one was written is corruption, not an older checkpoint.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import MICRO_MODEL, NO_PLOT, overriding

from jaxdist import checkpoint, config, convert, generate
from jaxdist.checkpoint import integrity, run_params
from jaxdist.data import loader
from jaxdist.distributed.mesh import mesh_from_string
from jaxdist.train import main as train_main
from jaxdist.training import step

REPO = Path(__file__).resolve().parent.parent
MICRO = [f"model.{k}={v}" for k, v in MICRO_MODEL.items()] + ["train.steps=2", "train.eval_every=0", NO_PLOT]


def error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [x for x in err.replace("\r", "\n").splitlines() if x.strip() and not re.search(r"\d+%\|", x)]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A run dir with config.yaml and one checkpoint at step 1 of the MICRO model (no training)."""
    cfg = config.load(None, MICRO)
    prog = step.build_program(cfg, mesh_from_string("fsdp=8"))
    run_dir = tmp_path_factory.mktemp("verify") / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(config.dump(cfg))
    saver = checkpoint.Saver(run_dir, cfg, log=lambda *a: None)
    saver.save(prog.init_state(0), 1, loader.Loader(cfg, prog.batch_sharding))
    saver.close()
    return run_dir


def _params_file(run_dir: Path) -> Path:
    files = [f for f in (run_dir / "checkpoints" / "1" / "params").rglob("*") if f.is_file() and "/d/" in str(f)]
    return max(files, key=lambda f: f.stat().st_size)


def flipped(saved: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "flipped"
    shutil.copytree(saved, copy)
    f = _params_file(copy)
    b = bytearray(f.read_bytes())
    b[len(b) // 2] ^= 0x10
    f.write_bytes(bytes(b))
    return copy


def unlisted(saved: Path, tmp_path: Path) -> Path:
    """A flipped byte in a file the checksum list no longer names (`{"files": {}}`): was resumed silently."""
    copy = flipped(saved, tmp_path)
    path = copy / "checkpoints" / "1" / integrity.CHECKSUMS
    path.write_text(json.dumps({"algorithm": "xxh3_64", "files": {}}))
    return copy


def no_checksums(saved: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "unchecked"
    shutil.copytree(saved, copy)
    (copy / "checkpoints" / "1" / integrity.CHECKSUMS).unlink()
    return copy


READERS = {
    "train --restore": lambda run, tmp: train_main(["--run-dir", str(tmp / "new"), "--restore", str(run), *MICRO]),
    "convert to-hf": lambda run, tmp: convert.main(["to-hf", str(run), str(tmp / "hf")]),
    "generate --run-dir": lambda run, tmp: generate.main(
        ["--run-dir", str(run), "--prompt-tokens", "1 2 3", "--max-new-tokens", "2"]
    ),
}
DAMAGE = {
    "flipped byte": (flipped, r"file params/.* does not match the checksum written with it"),
    "file not in the checksum list": (unlisted, r"file \S+ and \d+ more is not in its checksum file"),
    "checksum file deleted": (
        no_checksums,
        r"its checksum file jaxdist-checksums.json is missing although it was written",
    ),
}


@pytest.mark.parametrize("damage", DAMAGE, ids=str)
@pytest.mark.parametrize("reader", READERS, ids=str)
def test_every_reader_refuses_a_damaged_checkpoint_in_one_line(reader, damage, saved, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "8")  # the devices are set up: the CLIs are told so
    make, message = DAMAGE[damage]
    run = make(saved, tmp_path)
    capsys.readouterr()
    assert READERS[reader](run, tmp_path) == 2
    line = error_line(capsys)
    assert re.search(rf"no checkpoint under .*/checkpoints could be restored \(step 1: {message}", line), line
    assert not (tmp_path / "hf").exists() and not (tmp_path / "new").exists()


def test_the_intact_checkpoint_reads_through_the_same_path(saved, capsys, monkeypatch):
    """The control: the undamaged run passes every reader's checks (what the damage test flips)."""
    got = run_params.read_run(saved, mesh_from_string("fsdp=-1"), log=print)
    assert got.step_dir == saved / "checkpoints" / "1" and got.cfg.model.d_model == MICRO_MODEL["d_model"]
    assert "warning" not in capsys.readouterr().out


# ---- a run knows its tokenizer ------------------------------------------------------------------------

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu"]


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory):
    """A prepared folder (a trained 300-token BPE, several shards) and a 2-step run trained on it."""
    from jaxdist.data import prepare

    root = tmp_path_factory.mktemp("bpe")
    texts = root / "texts"
    texts.mkdir()
    for i in range(40):
        (texts / f"{i:02d}.txt").write_text(" ".join(WORDS[(i + k) % len(WORDS)] for k in range(60)))
    folder = root / "prepared"
    argv = ["prepare", "--train-tokenizer", "300", "--out", str(folder), "--workers", "1", str(texts)]
    assert prepare.main([*argv, "--val-fraction", "0.2", "--shard-tokens", "2000"]) == 0
    run_dir = root / "run"
    args = [*MICRO, f"data.path={folder}", "model.vocab_size=300", "train.log_every=1"]  # the source: its manifest
    return folder, run_dir, args


def test_run_records_its_tokenizer_and_every_reader_uses_it(bpe_run, tmp_path, capsys, monkeypatch):
    from jaxdist.data import tokenizer

    monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "8")
    monkeypatch.setenv("TQDM_DISABLE", "1")
    folder, run_dir, args = bpe_run
    assert train_main(["--run-dir", str(run_dir), *args, "pipeline.schedule=1f1b"]) == 0
    out = capsys.readouterr().out
    assert "warning: pipeline.schedule=1f1b has no effect at pp=1" in out, out  # issue 39: ignored silently
    assert "is a prepared folder: training on its token shards (data.source=tokens)" in out, out
    assert "nats/token" in out and "bits/byte" not in out, out  # BPE tokens are not bytes
    assert "source: tokens" in (run_dir / "config.yaml").read_text()
    info = json.loads((run_dir / "tokenizer" / "jaxdist-tokenizer.json").read_text())
    tok = tokenizer.load(str(folder))
    assert info["kind"] == "tokenizer" and info["eos_id"] == tok.eos_id == 0 and info["bos_ids"] == []
    assert (run_dir / "tokenizer" / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()

    # generate encodes with it (prefix + text tokens, as in training) and decodes with it
    assert generate.main(["--run-dir", str(run_dir), "--prompt", "alpha beta", "--max-new-tokens", "3", "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["prompt_tokens"] == tok.tokenizer.encode("alpha beta", add_special_tokens=False).ids
    assert got["prompt_tokens"] != list(b"alpha beta") and got["text"] == tok.decode(got["tokens"])
    # to-hf writes the tokenizer and its EOS id
    assert convert.main(["to-hf", str(run_dir), str(tmp_path / "hf")]) == 0
    hf = tmp_path / "hf"
    assert (hf / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    assert json.loads((hf / "config.json").read_text())["eos_token_id"] == 0
    assert json.loads((hf / "generation_config.json").read_text())["eos_token_id"] == 0
    assert not list(tmp_path.glob(".hf.tmp-*"))  # written beside, renamed into place
    capsys.readouterr()

    # a corrupt tokenizer file: one line in every command, nothing written
    broken = tmp_path / "broken"
    shutil.copytree(run_dir, broken)
    (broken / "tokenizer" / "tokenizer.json").write_text('{"not": "a tokenizer"')
    prompt = ["--prompt-tokens", "1 2 3", "--max-new-tokens", "2"]
    assert generate.main(["--run-dir", str(broken), *prompt]) == 2
    assert re.search(r"tokenizer/tokenizer.json is not a tokenizers JSON file", error_line(capsys))
    assert convert.main(["to-hf", str(broken), str(tmp_path / "hf2")]) == 2
    assert re.search(r"tokenizer/tokenizer.json is not a tokenizers JSON file", error_line(capsys))
    assert not (tmp_path / "hf2").exists() and not list(tmp_path.glob(".hf2.tmp-*"))

    # no tokenizer, no text (issue 39 item 1: generate encoded prompts as raw bytes, to-hf exported no tokenizer)
    gone = tmp_path / "gone"
    shutil.copytree(run_dir, gone)
    shutil.rmtree(gone / "tokenizer")
    missing = r"gone/tokenizer is missing .*: the run trained on token ids from data.path=.*prepared, and without its"
    for argv in (["--prompt", "alpha beta"], prompt[:2]):
        assert generate.main(["--run-dir", str(gone), *argv, "--max-new-tokens", "2"]) == 2
        assert re.search(missing, error_line(capsys))
    assert convert.main(["to-hf", str(gone), str(tmp_path / "hf3")]) == 2
    assert re.search(missing, error_line(capsys))
    assert not (tmp_path / "hf3").exists()

    # the data re-prepared with another tokenizer: refused even with --allow-config-change data (item 2:
    # it trained on the new ids while RUN/tokenizer kept the old one)
    from jaxdist.data import prepare

    other = tmp_path / "other"
    assert (
        prepare.main(
            ["prepare", "--train-tokenizer", "280", "--out", str(other), "--workers", "1", str(folder.parent / "texts")]
        )
        == 0
    )
    capsys.readouterr()
    resumed = [*overriding(args, f"data.path={other}", "train.steps=3"), "--allow-config-change", "data"]
    assert train_main(["--run-dir", str(run_dir), *resumed]) == 2
    line = error_line(capsys)
    assert re.search(
        r"run/tokenizer records the tokenizer this run trained with, tokenizer \(sha256 \w{8}…\), but its data now comes from tokenizer \(sha256 \w{8}…\) at .*other",
        line,
    ), line
    assert "--tokenizer" in line and "checkpoint.params_only=true" in line
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["2"]  # nothing trained


def test_bits_per_byte_only_for_byte_tokens():
    from jaxdist.data import run_tokenizer
    from jaxdist.observe import report

    for overrides, bytes_ in [([], True), (["data.tokenizer=tok.json"], False), (["data.source=tokens"], False)]:
        cfg = config.load(None, overrides)
        assert run_tokenizer.byte_tokens(cfg) is bytes_, overrides
        assert ("bits/byte" in report.units_line(cfg)) is bytes_, overrides


def test_training_refuses_a_changed_or_corrupt_prepared_tokenizer(bpe_run, tmp_path, capsys):
    folder, _, args = bpe_run
    copy = tmp_path / "prepared"
    shutil.copytree(folder, copy)
    args = [a if not a.startswith("data.path=") else f"data.path={copy}" for a in args]
    (copy / "tokenizer.json").write_text('{"not": "a tokenizer"')
    assert train_main(["--run-dir", str(tmp_path / "run"), *args]) == 2
    assert re.search(r"prepared/tokenizer.json is not a tokenizers JSON file", error_line(capsys))
    shutil.copyfile(folder / "tokenizer.json", copy / "tokenizer.json")
    with open(copy / "tokenizer.json", "a") as f:
        f.write(" ")  # still a valid tokenizer, but not the one the shards were made with
    assert train_main(["--run-dir", str(tmp_path / "run"), *args]) == 2
    assert re.search(r"does not match the sha256 .*manifest.json recorded for it", error_line(capsys))
    assert not (tmp_path / "run").exists()


# ---- data folders checked against their manifest -----------------------------------------------------


def _truncate(folder: Path) -> None:
    f = folder / "train" / "000000.bin"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


PREPARED_DAMAGE = {
    "truncated shard": (_truncate, r"train/ holds [\d,]+ tokens but its manifest.json records [\d,]+"),
    "missing shard": (lambda f: (f / "train" / "000001.bin").unlink(), r"train/000001.bin is missing"),
    "missing val/": (lambda f: shutil.rmtree(f / "val"), r"val/000000.bin is missing"),
    # no manifest, no token read (issue 39 item 4: the .bin shards and tokenizer.json were trained on as text)
    "manifest deleted": (lambda f: (f / "manifest.json").unlink(), r"no manifest.json beside its token shards"),
    "manifest of another format": (
        lambda f: (f / "manifest.json").write_text('{"format": "other"}'),
        r"its manifest.json is not a jaxdist manifest",
    ),
}


@pytest.mark.parametrize("damage", PREPARED_DAMAGE, ids=str)
def test_prepared_folder_that_disagrees_with_its_manifest_is_one_line(damage, bpe_run, tmp_path, capsys):
    folder, _, args = bpe_run
    copy = tmp_path / "prepared"
    shutil.copytree(folder, copy)
    make, message = PREPARED_DAMAGE[damage]
    make(copy)
    args = [a if not a.startswith("data.path=") else f"data.path={copy}" for a in args]
    sources = ([], ["data.source=tokens"]) if "manifest" in damage else ([],)  # text, then raw tokens
    for source in sources:
        assert train_main(["--run-dir", str(tmp_path / "run"), *args, *source]) == 2
        assert re.search(rf"prepared folder .*prepared: {message}", error_line(capsys))
        assert not (tmp_path / "run").exists()


def test_resume_on_a_changed_corpus_is_refused_unless_allowed(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TQDM_DISABLE", "1")
    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(3):
        (texts / f"{i}.txt").write_text(" ".join(WORDS) * 20)
    run_dir = tmp_path / "run"
    args = ["--run-dir", str(run_dir), *MICRO, f"data.path={texts}"]
    assert train_main(args) == 0
    (texts / "3.txt").write_text(" ".join(WORDS) * 20)  # a file added since the checkpoint
    capsys.readouterr()
    assert train_main(overriding(args, "train.steps=3")) == 2
    line = error_line(capsys)
    assert re.search(r"on a corpus that changed since it was saved \(3 files, [\d,]+ bytes then; 4 files", line)
    assert "--allow-config-change data" in line
    assert train_main([*overriding(args, "train.steps=3"), "--allow-config-change", "data"]) == 0
    assert "restored step 2" in capsys.readouterr().out


# ---- never hang: failed writes stop the run in one line ---------------------------------------------

FAULT_RUN = [
    *overriding(MICRO, "train.steps=6"),
    "train.log_every=1",
    "checkpoint.every=4",
    "checkpoint.async_save=false",
]
ENOSPC = OSError(errno.ENOSPC, "No space left on device")

TB_FAULT = """
import errno, sys
from jaxdist.observe import trackers
trackers.import_tracker("tensorboardX")
import tensorboardX.record_writer as rw
calls, write = [0], rw.RecordWriter.write
def failing(self, data):
    calls[0] += 1
    if calls[0] > 12:  # the writer's header and config, then the first steps' scalars
        raise OSError(errno.ENOSPC, "No space left on device")
    return write(self, data)
rw.RecordWriter.write = failing
from jaxdist.train import main
sys.exit(main(sys.argv[1:]))
"""


def test_tensorboard_on_a_full_disk_stops_the_run_in_one_line_with_a_checkpoint(tmp_path):
    """tensorboardX's writer thread died on ENOSPC and the loop blocked in queue.put forever: now the
    write fails in the loop, which saves the last step and exits 2 (and a timeout proves it returns)."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": "8", "TQDM_DISABLE": "1"}
    argv = ["--run-dir", str(run_dir), *FAULT_RUN, 'train.trackers=["tensorboard"]']
    r = subprocess.run(
        [sys.executable, "-c", TB_FAULT, *argv], capture_output=True, text=True, timeout=120, env=env, cwd=REPO
    )
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert re.match(
        r"error: tracker tensorboard could not be written in .* \(no space left on device\); stopping: "
        r"checkpoint step (\d) saved in .*/checkpoints; free space",
        lines[0],
    ), lines[0]
    step_saved = re.search(r"checkpoint step (\d) saved", lines[0]).group(1)
    assert integrity.verify(run_dir / "checkpoints" / step_saved) is None
    assert 1 <= int(step_saved) < 6


def _failing_after(n: int, real_open=open):
    """`open` whose files raise ENOSPC from their n-th write on (metrics.jsonl's flush on a full disk)."""

    class Failing:
        def __init__(self, *a, **k):
            self.f, self.writes = real_open(*a, **k), 0

        def write(self, text):
            self.writes += 1
            if self.writes >= n:
                raise ENOSPC
            return self.f.write(text)

        def __getattr__(self, name):
            return getattr(self.f, name)

    return Failing


def test_metrics_file_on_a_full_disk_stops_in_one_line_and_the_run_resumes(tmp_path, capsys, monkeypatch):
    from jaxdist.observe import metrics

    monkeypatch.setenv("TQDM_DISABLE", "1")
    monkeypatch.setattr(metrics, "open", _failing_after(3), raising=False)  # step 3's record
    run_dir = tmp_path / "run"
    assert train_main(["--run-dir", str(run_dir), *FAULT_RUN]) == 2
    line = error_line(capsys)
    assert re.match(
        r"error: metrics.jsonl could not be written in .* \(no space left on device\); stopping: checkpoint step 4 "
        r"saved in .*; free space or fix the folder, then run the same command to resume",
        line,
    ), line
    monkeypatch.undo()
    monkeypatch.setenv("TQDM_DISABLE", "1")
    assert train_main(["--run-dir", str(run_dir), *FAULT_RUN]) == 0
    out = capsys.readouterr().out
    assert "restored step 4" in out and "done: 6 steps" in out
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # metrics are read one step late: step 3's record failed after step 4 ran (saved); 3 and 4 are lost
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 5, 6] and records[-1].get("summary")


def test_lock_write_on_a_full_disk_is_one_line(tmp_path, capsys, monkeypatch):
    from jaxdist.training import rundir

    def pwrite(*a):
        raise ENOSPC

    monkeypatch.setattr(rundir.os, "pwrite", pwrite)
    assert train_main(["--run-dir", str(tmp_path / "run"), *MICRO]) == 2
    assert re.match(
        r"error: cannot write the lock .*jaxdist.lock \(no space left on device\); free space", error_line(capsys)
    )


def test_loss_png_is_never_left_empty(tmp_path, capsys, monkeypatch):
    import matplotlib.figure

    def savefig(self, fname, **kwargs):
        Path(fname).write_bytes(b"")  # what a full disk leaves: the file created, nothing in it
        raise ENOSPC

    monkeypatch.setenv("TQDM_DISABLE", "1")
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    run_dir = tmp_path / "run"
    assert train_main(["--run-dir", str(run_dir), *MICRO, "train.plot=true"]) == 0
    done = [x for x in capsys.readouterr().out.splitlines() if x.startswith("done:")]
    assert re.search(r"no loss plot \(cannot write .*loss.png \(no space left on device\)", done[0]), done
    assert not (run_dir / "loss.png").exists() and not list(run_dir.glob(".loss.png*"))


# ---- every value validated before any work -----------------------------------------------------------

HF = REPO / "tests" / "fixtures" / "hf_llama"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--temperature", "nan"], r"--temperature a finite number >= 0"),
        (["--top-p", "nan"], r"--top-p nan must be in \(0, 1\]"),
        (["--max-new-tokens", "abc"], r"argument --max-new-tokens: invalid int value: 'abc'; see .* --help$"),
        (
            ["--prompt-tokens", " ".join(["5"] * 120)],
            r"a prompt of 120 tokens \+ --max-new-tokens 16 = 136 positions, ",
        ),
        (["--top-p", "0.9"], r"--top-p 0.9 has no effect with --temperature 0 \(greedy decoding\)"),  # was ignored
        (["--seed", "99999999999999999999999"], r"--seed 99999999999999999999999 does not fit in 64 bits"),  # traceback
    ],
    ids=["temperature nan", "top-p nan", "bad int", "prompt beyond max_position_embeddings", "top-p greedy", "seed"],
)
def test_generate_refuses_bad_values_in_one_line(argv, message, capsys, monkeypatch):
    monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "8")
    base = ["--hf", str(HF), "--max-new-tokens", "16", "--prompt-tokens", "1 2 3"]
    assert generate.main([*base, *argv]) == 2
    assert re.search(message, error_line(capsys))


def test_to_hf_refuses_a_zero_shard_size(saved, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "8")
    assert convert.main(["to-hf", str(saved), str(tmp_path / "hf"), "--max-shard-gb", "0"]) == 2
    assert "--max-shard-gb 0.0 must be a positive number" in error_line(capsys)
    assert not (tmp_path / "hf").exists()


def test_nonfinite_weights_in_an_imported_model_are_one_line(tmp_path, capsys, monkeypatch):
    from safetensors.numpy import load_file, save_file

    monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "8")
    damaged = tmp_path / "hf"
    shutil.copytree(HF, damaged)
    tensors = load_file(damaged / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = float("inf")
    save_file(tensors, damaged / "model.safetensors", metadata={"format": "pt"})
    assert convert.main(["from-hf", str(damaged), str(tmp_path / "run")]) == 2
    assert re.search(r"hf: tensor .*w_up.* holds NaN or Inf values; the checkpoint is damaged", error_line(capsys))
    assert not (tmp_path / "run").exists()


# ---- outputs whole or not at all ---------------------------------------------------------------------


@pytest.fixture
def metrics_run(tmp_path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    lines = [json.dumps({"step": s, "loss": 5.0 - s / 10, "lr": 1e-3}) for s in range(1, 6)]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run


def test_plot_outputs_are_checked_and_written_whole(metrics_run, tmp_path, capsys, monkeypatch):
    import matplotlib.figure

    from jaxdist import plot

    cases = [
        (["--out", str(tmp_path / "nowhere" / "a.png")], r"folder .*nowhere does not exist; create the folder"),
        (["--out", str(metrics_run / "metrics.jsonl" / "a.png")], r"folder .*metrics.jsonl is a file"),
        (["--out", str(tmp_path)], r"--out .*: give a file name ending in .png"),
        (["--out", str(metrics_run / "metrics.jsonl")], r"--out .*metrics.jsonl: give a file name ending in .png"),
    ]
    before = (metrics_run / "metrics.jsonl").read_bytes()
    for argv, message in cases:
        assert plot.main([str(metrics_run), *argv]) == 2, argv
        assert re.search(message, error_line(capsys)), argv
    assert (metrics_run / "metrics.jsonl").read_bytes() == before and not (tmp_path / "nowhere").exists()

    # the message names the file written
    assert plot.main([str(metrics_run), "--out", str(tmp_path / "curve.png")]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'curve.png'}"
    assert (tmp_path / "curve.png").stat().st_size > 1000

    # a folder that refuses the write (root ignores chmod: the write is made to fail as it would)
    def savefig(self, fname, **kwargs):
        Path(fname).write_bytes(b"")
        raise PermissionError(errno.EACCES, "Permission denied")

    with monkeypatch.context() as m:
        m.setattr(matplotlib.figure.Figure, "savefig", savefig)
        assert plot.main([str(metrics_run)]) == 2
    assert re.search(r"cannot write .*loss.png \(permission denied\)", error_line(capsys))
    assert not list(metrics_run.glob("*.png")) and not list(metrics_run.glob(".loss.png*"))

    # a read-only filesystem: every write and unlink there is EROFS, even of a file that is not there
    # (issue 39: the clean-up's unlink raised a traceback); root cannot make one without a mount
    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    with monkeypatch.context() as m:
        m.setattr(matplotlib.figure.Figure, "savefig", read_only)
        m.setattr(os, "unlink", read_only)
        assert plot.main([str(metrics_run)]) == 2
    assert re.search(r"cannot write .*loss.png \(read-only file system\); fix the folder", error_line(capsys))

    # a step record without a loss
    with open(metrics_run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 6, "lr": 1e-3}) + "\n")
    assert plot.main([str(metrics_run)]) == 2
    assert re.search(r"the record of step 6 has no numeric 'loss'; fix or remove that line", error_line(capsys))


def test_stale_temporary_folders_of_killed_writers_are_removed(tmp_path):
    from jaxdist.data import shards

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = [tmp_path / f".out.tmp-{dead.pid}", tmp_path / f".out.old-{dead.pid}"]
    live = tmp_path / f".out.tmp-{os.getppid()}"
    other = tmp_path / f".other.tmp-{dead.pid}"
    for p in [*stale, live, other]:
        p.mkdir()
    messages = []
    assert sorted(shards.remove_stale(tmp_path / "out", messages.append)) == sorted(stale)
    assert live.is_dir() and other.is_dir() and not any(p.exists() for p in stale)
    assert len(messages) == 2 and "left by a process that is gone" in messages[0]


def test_to_hf_failing_half_way_leaves_nothing_and_the_rerun_works(saved, tmp_path, capsys, monkeypatch):
    from jaxdist.errors import JaxdistError
    from jaxdist.hf import export

    def fail(*a):
        raise JaxdistError("data.tokenizer=gone.json does not exist; the export needs the run's tokenizer")

    monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "8")
    out = tmp_path / "hf"
    with monkeypatch.context() as m:
        m.setattr(export, "copy_tokenizer", fail)  # after the weights and config.json are written
        assert convert.main(["to-hf", str(saved), str(out)]) == 2
    assert "the export needs the run's tokenizer" in error_line(capsys)
    assert not out.exists() and not list(tmp_path.glob(".hf.*"))
    assert convert.main(["to-hf", str(saved), str(out)]) == 0
    written = sorted(p.name for p in out.iterdir())
    assert written == ["config.json", "generation_config.json", "model.safetensors"]
    assert f"exported {len(written)} file(s) to {out}" in capsys.readouterr().out  # every file, not the weights alone


def test_to_hf_on_a_full_disk_is_one_line_leaves_nothing_and_the_rerun_works(saved, tmp_path, capsys, monkeypatch):
    """safetensors' raw `SafetensorError: ... IoError(Os { code: 28, kind: StorageFull ...` before (issue 39)."""
    from conftest import full_disk

    monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "8")
    with full_disk(tmp_path / "disk", 32) as grow:
        out = tmp_path / "disk" / "hf"
        assert convert.main(["to-hf", str(saved), str(out)]) == 2
        line = error_line(capsys)
        assert line.startswith(f"error: cannot write {out} (no space left on device): nothing was written there")
        assert line.endswith("free space, then run the same command") and list((tmp_path / "disk").iterdir()) == []
        grow(8192)
        assert convert.main(["to-hf", str(saved), str(out)]) == 0
        assert (out / "model.safetensors").is_file()


def test_a_tracker_that_cannot_start_is_one_line(tmp_path, capsys, monkeypatch):
    from jaxdist.observe import trackers

    def fail(*a):
        raise ENOSPC

    monkeypatch.setattr(trackers.TensorBoard, "__init__", fail)
    assert train_main(["--run-dir", str(tmp_path / "run"), *MICRO, 'train.trackers=["tensorboard"]']) == 2
    line = error_line(capsys)
    assert line == (  # issue 39: said "remove tensorboard from train.trackers" for a full disk
        f"error: train.trackers: tensorboard could not start in {tmp_path / 'run'} (no space left on device); "
        "free space, then run the same command"
    ), line


def test_a_failed_save_names_the_intact_checkpoints_on_disk(saved, tmp_path):
    """checkpoint.keep=1 on a full disk: orbax's list had already dropped step 1 for the failing step 2, and
    the line said "no older checkpoint exists" while checkpoints/1 was intact (issue 39). The disk decides."""
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    saver = checkpoint.Saver(run, config.load(None, [*MICRO, "checkpoint.keep=1"]), log=lambda *a: None)
    try:
        saver.manager.all_steps = lambda: [2]  # what orbax reports while the save of step 2 fails
        line = str(saver._fail(2, ENOSPC))
    finally:
        saver.close()
    assert "(no space left on device); stopping: checkpoints 1 are intact; free space" in line, line
    (run / "checkpoints" / "1" / integrity.CHECKSUMS).unlink()  # a step without its checksums is not counted
    saver = checkpoint.Saver(run, config.load(None, MICRO), log=lambda *a: None)
    saver.manager.all_steps = lambda: [1, 2]
    assert "stopping: no older checkpoint exists" in str(saver._fail(2, ENOSPC))
    saver.close()
