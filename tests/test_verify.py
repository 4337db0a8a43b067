"""Nothing read unchecked (issue 27): every command that reads a run verifies what it reads and fails in
one line, exit 2, nothing written.

- checksums: train --restore, convert to-hf and generate --run-dir read through one function
  (`checkpoint.restoring.read_checkpoint`), so a flipped byte stops each of them alike; a checksum file
  missing although the checkpoint's meta says one was written is corruption, not an older checkpoint.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from conftest import MICRO_MODEL

from jaxdist import checkpoint, config, convert, data, generate, step
from jaxdist.checkpoint import integrity
from jaxdist.mesh import mesh_from_string
from jaxdist.train import main as train_main

MICRO = [f"model.{k}={v}" for k, v in MICRO_MODEL.items()] + ["train.steps=2", "train.eval_every=0"]


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
    saver.save(prog.init_state(0), 1, data.Loader(cfg, prog.batch_sharding))
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
    got = convert.read_run(saved, mesh_from_string("fsdp=-1"), log=print)
    assert got.step_dir == saved / "checkpoints" / "1" and got.cfg.model.d_model == MICRO_MODEL["d_model"]
    assert "warning" not in capsys.readouterr().out


# ---- a run knows its tokenizer ------------------------------------------------------------------------

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory):
    """A prepared folder (a trained 300-token BPE, several shards) and a 2-step run trained on it."""
    from jaxdist import prepare

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
    from jaxdist import tokenizer

    monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "8")
    monkeypatch.setenv("TQDM_DISABLE", "1")
    folder, run_dir, args = bpe_run
    assert train_main(["--run-dir", str(run_dir), *args]) == 0
    out = capsys.readouterr().out
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
}


@pytest.mark.parametrize("damage", PREPARED_DAMAGE, ids=str)
def test_prepared_folder_that_disagrees_with_its_manifest_is_one_line(damage, bpe_run, tmp_path, capsys):
    folder, _, args = bpe_run
    copy = tmp_path / "prepared"
    shutil.copytree(folder, copy)
    make, message = PREPARED_DAMAGE[damage]
    make(copy)
    args = [a if not a.startswith("data.path=") else f"data.path={copy}" for a in args]
    assert train_main(["--run-dir", str(tmp_path / "run"), *args]) == 2
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
    assert train_main([*args, "--steps", "3"]) == 2
    line = error_line(capsys)
    assert re.search(r"on a corpus that changed since it was saved \(3 files, [\d,]+ bytes then; 4 files", line)
    assert "--allow-config-change data" in line
    assert train_main([*args, "--steps", "3", "--allow-config-change", "data"]) == 0
    assert "restored step 2" in capsys.readouterr().out
