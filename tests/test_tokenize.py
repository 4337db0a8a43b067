"""Tokenizers, `python -m jaxdist.data prepare`, prepared folders and directory paths, document masking."""

import itertools
import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdist import train
from jaxdist.data import data_rules, prepare, tokenizer
from jaxdist.data import loader as loader_mod
from jaxdist.distributed import mesh as mesh_mod
from jaxdist.errors import JaxdistError
from jaxdist.models.attention import document_segments
from jaxdist.training import step

STDLIB = sysconfig.get_paths()["stdlib"]
CORPUS = f"{STDLIB}/[a-c]*.py"  # 29 standard-library modules, ~0.6 MB
SMALL = ["model.num_layers=2", "model.d_model=64", "model.mlp_dim=256", "model.head_dim=16", "model.seq_len=64"]


def run_prepare(*argv):
    return subprocess.run(
        [sys.executable, "-m", "jaxdist.data.loader", "prepare", *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The corpus prepared twice with a trained 4k BPE: 2 worker processes (the CLI) and in-process."""
    root = tmp_path_factory.mktemp("prep")
    out = run_prepare("--train-tokenizer", 4096, "--out", root / "a", "--workers", 2, CORPUS, "--val-fraction", 0.15)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "tokens/s with 2 worker(s)" in out.stdout
    assert (
        prepare.main(
            [
                "prepare",
                "--train-tokenizer",
                "4096",
                "--out",
                str(root / "b"),
                "--workers",
                "1",
                CORPUS,
                "--val-fraction",
                "0.15",
            ]
        )
        == 0
    )
    return root / "a", root / "b"


def corpus_documents():
    docs = [Path(f).read_bytes().decode("utf-8", errors="replace") for f in loader_mod.expand_path(CORPUS)]
    return {
        "train": [d for d in docs if not prepare.is_held_out(d, 0.15)],
        "val": [d for d in docs if prepare.is_held_out(d, 0.15)],
    }


def split_at(ids: np.ndarray, eos: int) -> list[np.ndarray]:
    ends = np.flatnonzero(ids == eos)
    assert len(ends) and ends[-1] == len(ids) - 1  # every document ends with EOS
    return np.split(ids, ends[:-1] + 1)


def test_prepare_is_deterministic_whatever_the_worker_count(prepared):
    a, b = prepared
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files_a == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    assert {str(f) for f in files_a} >= {
        "manifest.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "train/000000.bin",
        "val/000000.bin",
    }
    for f in files_a:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f


def test_prepared_shards_round_trip_the_text(prepared):
    a, _ = prepared
    manifest = json.loads((a / "manifest.json").read_text())
    tok = tokenizer.load(str(a))
    assert manifest["vocab_size"] == tok.vocab_size == 4096 and manifest["dtype"] == "uint16"
    assert manifest["eos_id"] == tok.eos_id == 0 and manifest["prefix_ids"] == []  # GPT-2 style: EOS only
    assert manifest["tokenizer"]["sha256"] == tok.sha256
    expected = corpus_documents()
    assert len(expected["val"]) >= 1 and len(expected["train"]) >= 20
    for split in ("train", "val"):
        ids = np.concatenate([np.fromfile(a / f, dtype=np.uint16) for f in manifest["splits"][split]["files"]])
        assert manifest["splits"][split]["tokens"] == len(ids)
        docs = split_at(ids, tok.eos_id)
        assert manifest["splits"][split]["documents"] == len(docs) == len(expected[split])
        assert [tok.decode(d[:-1]) for d in docs] == expected[split]
    n_bytes = sum(len(d.encode()) for d in expected["train"])
    # A 4k BPE compresses Python source to ~3 bytes a token (bytes alone: 1).
    assert 2.0 < n_bytes / manifest["splits"]["train"]["tokens"] < 5.0


@pytest.mark.slow
def test_cli_trains_on_prepared_tokens_with_document_mask(prepared, tmp_path):
    a, _ = prepared
    run_dir = tmp_path / "run"
    # In-process (the command's own main; what the command does as a process is test_train's): the
    # subprocess cost a JAX start-up and a loss.png nobody reads.
    args = [
        "--steps",
        "40",
        "--run-dir",
        str(run_dir),
        *SMALL,
        "data.source=tokens",
        f"data.path={a}",
        "data.document_mask=true",
        "model.vocab_size=4096",
        "optim.lr=1e-2",
        "optim.warmup_steps=5",
        "train.log_every=5",
        "train.eval_every=40",
        "train.eval_batches=2",
        "train.plot=false",
    ]
    assert train.main(args) == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    summary = records[-1]
    # From near ln(4096) = 8.3 towards the corpus's unigram entropy (6.4 nats) in 40 small steps.
    assert losses[0] > 7.0 and summary["final_loss"] < losses[0] - 1.0 and summary["eval_loss"] < 7.2


# ------------------------------------------------------------------------------ document masking


def mask_cfg(tiny_cfg, **data_cfg):
    return tiny_cfg.replace(
        model=dict(
            num_layers=2,
            d_model=32,
            num_heads=4,
            num_kv_heads=2,
            head_dim=8,
            mlp_dim=64,
            vocab_size=64,
            seq_len=24,
            init_std=0.3,
        ),
        data=dict(document_mask=True, separator=1, **data_cfg),
    )


def packed_rows(rows: int, eos: int = 1):
    """Rows of 25 tokens (24 inputs + the last target) packing documents of random lengths."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(rows):
        row = []
        while len(row) < 25:
            n = int(rng.integers(2, 11))
            row += [*rng.integers(2, 64, n - 1), eos]
        out.append(row[:25])
    return np.array(out, np.int32)


def documents_of(row: np.ndarray, eos: int = 1) -> list[tuple[int, int]]:
    """(start, stop) of each document among the 24 input positions of a packed row."""
    ends = [i + 1 for i in range(24) if row[i] == eos]
    bounds = [0, *ends] + ([24] if not ends or ends[-1] != 24 else [])
    return list(itertools.pairwise(bounds))


@pytest.fixture(scope="module")
def mask_program(tiny_cfg):
    """The masked program on fsdp=4,tp=2, and `alone(rows)`: the same parameters unsharded, each row's
    logits with no mask. A document run alone is a row that starts with it; what follows it cannot
    matter under causal attention."""
    from flax import nnx

    prog = step.build_program(mask_cfg(tiny_cfg), mesh_mod.mesh_from_string("fsdp=4,tp=2"), eos_id=1)
    params = prog.init_state(0).params
    host = jax.device_get(params)
    packed = jax.jit(lambda t: nnx.merge(prog.graphdef, host)(t, document_segments(t, 1)))
    alone = jax.jit(lambda t: nnx.merge(prog.graphdef, host)(t))
    return prog, params, packed, alone


def alone_rows(batch: np.ndarray) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """Every document of every row moved to the start of its own row (padding after it); with
    (row, start, stop) of where it came from."""
    rows, where = [], []
    for r, row in enumerate(batch):
        for start, stop in documents_of(row):
            rows.append(np.concatenate([row[start : stop + 1], np.full(24 - (stop - start), 5)]))
            where.append((r, start, stop))
    return np.array(rows, np.int32), where


def test_document_mask_equals_each_document_alone(mask_program):
    _, _, packed, alone = mask_program
    batch = packed_rows(4)
    masked, unmasked = packed(batch[:, :24]), alone(batch[:, :24])
    rows, where = alone_rows(batch)
    singles = alone(rows[:, :24])
    worst = crossed = 0.0
    for i, (r, start, stop) in enumerate(where):
        worst = max(worst, float(jnp.abs(singles[i, : stop - start] - masked[r, start:stop]).max()))
        if start:
            crossed = max(crossed, float(jnp.abs(singles[i, : stop - start] - unmasked[r, start:stop]).max()))
    assert len(where) > 8 and worst < 1e-5
    assert crossed > 1e-2  # without the mask a document sees its predecessors: the test can fail


def test_document_mask_loss_on_a_sharded_mesh(mask_program):
    """The masked step's loss on fsdp=4,tp=2 = the sum over documents, each run alone unsharded, of
    their next-token losses (the one at a document's EOS predicts the next document's first token)."""
    prog, params, _, alone = mask_program
    batch = packed_rows(8)
    loss_sum, count = prog.eval_step(params, jax.device_put(batch, prog.batch_sharding))
    rows, where = alone_rows(batch)
    logp = jax.nn.log_softmax(alone(rows[:, :24]), axis=-1)
    picked = jnp.take_along_axis(logp, jnp.asarray(rows[:, 1:])[..., None], axis=-1)[..., 0]
    expected = -sum(float(picked[i, : stop - start].sum()) for i, (_, start, stop) in enumerate(where))
    assert float(count) == 8 * 24
    np.testing.assert_allclose(float(loss_sum), expected, rtol=1e-5)
    import optax

    tokens = jnp.asarray(batch)
    unmasked = float(optax.softmax_cross_entropy_with_integer_labels(alone(tokens[:, :-1]), tokens[:, 1:]).sum())
    assert abs(unmasked - expected) > 1e-3 * expected  # 100x the tolerance: the mask matters


def test_document_mask_needs_an_eos_and_no_pipeline(tiny_cfg, tmp_path):
    np.zeros(100, np.uint16).tofile(tmp_path / "t.bin")
    cfg = mask_cfg(tiny_cfg, source="tokens", path=str(tmp_path / "t.bin"))
    with pytest.raises(JaxdistError, match="end-of-document id of these token files"):
        data_rules.mask_eos(cfg)
    assert data_rules.mask_eos(cfg.replace(data=dict(document_mask=False))) is None
    with pytest.raises(JaxdistError, match="needs the end-of-document id: build the program with eos_id"):
        step.build_program(cfg, mesh_mod.mesh_from_string("fsdp=8"))  # the step reads no files
    with pytest.raises(JaxdistError, match="pipeline parallelism"):
        step.build_program(mask_cfg(tiny_cfg), mesh_mod.mesh_from_string("pp=2,fsdp=4"), eos_id=1)


# --------------------------------------------------------------------------- BOS/EOS and tokenizers


def word_tokenizer(folder: Path, post_bos: bool, config: dict | None = None, extra: int = 0) -> Path:
    """A word-level tokenizer.json (optionally a post-processor adding <s>) and tokenizer_config.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<s>": 0, "</s>": 1, "[UNK]": 2, "a": 3, "b": 4, **{f"w{i}": 5 + i for i in range(extra)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>"])
    if post_bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_bos_eos_follow_the_tokenizer_config(tmp_path):
    llama_like = tokenizer.load(str(word_tokenizer(tmp_path / "p", post_bos=True) / "tokenizer.json"))
    assert llama_like.prefix == (0,) and llama_like.eos_id == 1  # post-processor's BOS; EOS by name
    docs = llama_like.encode_documents(["a b", "b </s> a"])
    assert [d.tolist() for d in docs[:1]] == [[0, 3, 4, 1]]
    assert 1 not in docs[1][1:-1].tolist()  # literal "</s>" text is not the EOS id
    off = tokenizer.load(str(word_tokenizer(tmp_path / "c", True, {"add_bos_token": False, "eos_token": "</s>"})))
    assert off.prefix == () and off.eos_id == 1
    on = tokenizer.load(
        str(
            word_tokenizer(
                tmp_path / "d", False, {"add_bos_token": True, "bos_token": {"content": "<s>"}, "eos_token": "b"}
            )
        )
    )
    assert on.prefix == (0,) and on.eos_id == 4  # eos_token of the config wins over the usual names
    (tmp_path / "c2").mkdir()
    tokenizer.copy_files(llama_like, tmp_path / "c2")
    again = tokenizer.load(str(tmp_path / "c2"))  # a bare tokenizer.json copied with its rule recorded
    assert (again.prefix, again.eos_id) == (llama_like.prefix, llama_like.eos_id)


def test_text_source_with_a_tokenizer(prepared, tiny_cfg, tmp_path):
    a, _ = prepared
    (tmp_path / "docs" / "sub").mkdir(parents=True)
    texts = ["def f(x):\n    return x + 1\n" * 20, "import os\nprint(os.getcwd())\n" * 30]
    (tmp_path / "docs" / "one.py").write_text(texts[0])
    (tmp_path / "docs" / "sub" / "two.py").write_text(texts[1])
    (tmp_path / "docs" / ".hidden").write_text("not data")
    cfg = tiny_cfg.replace(
        data=dict(path=str(tmp_path / "docs"), tokenizer=str(a), eval_fraction=0.0),
        model=dict(vocab_size=4096, seq_len=16),
    )
    train, _ = loader_mod.load_windows(cfg)
    tok = tokenizer.load(str(a))
    stream = np.concatenate(tok.encode_documents(texts))
    assert len(train) == (len(stream) - 1) // 16
    np.testing.assert_array_equal(np.concatenate([train[i][:-1] for i in range(len(train))]), stream[: 16 * len(train)])
    with pytest.raises(JaxdistError, match="set model.vocab_size=4096"):
        loader_mod.load_windows(cfg.replace(model=dict(vocab_size=1000)))


def test_data_path_folders(prepared, tiny_cfg, tmp_path):
    a, _ = prepared
    (tmp_path / "tok" / "b").mkdir(parents=True)
    np.arange(3000, dtype=np.uint16).tofile(tmp_path / "tok" / "b" / "1.bin")
    np.arange(3000, 5000, dtype=np.uint16).tofile(tmp_path / "tok" / "0.bin")
    (tmp_path / "tok" / ".DS_Store").write_bytes(b"x")
    assert loader_mod.expand_path(str(tmp_path / "tok")) == [
        str(tmp_path / "tok" / "0.bin"),
        str(tmp_path / "tok" / "b" / "1.bin"),
    ]
    base = dict(model=dict(vocab_size=5000, seq_len=16))
    by_dir, _ = loader_mod.load_windows(
        tiny_cfg.replace(data=dict(source="tokens", path=str(tmp_path / "tok")), **base)
    )
    by_glob, _ = loader_mod.load_windows(
        tiny_cfg.replace(data=dict(source="tokens", path=str(tmp_path / "tok/**/*.bin")), **base)
    )
    assert len(by_dir) == len(by_glob) > 0 and by_dir[0][0] == 3000
    assert all(np.array_equal(by_dir[i], by_glob[i]) for i in range(len(by_dir)))

    # A prepared folder: train/ for training, val/ for eval, dtype from its manifest (which decides:
    # an override that contradicts it is an error, not ignored).
    cfg = tiny_cfg.replace(data=dict(source="tokens", path=str(a)), model=dict(vocab_size=4096, seq_len=16))
    with pytest.raises(
        JaxdistError, match=r"data.token_dtype=uint32 contradicts .*manifest.json, which records uint16"
    ):
        loader_mod.load_windows(cfg.replace(data=dict(token_dtype="uint32")))
    train, held_out = loader_mod.load_windows(cfg)
    np.testing.assert_array_equal(train[0], np.fromfile(a / "train" / "000000.bin", np.uint16)[:17])
    np.testing.assert_array_equal(held_out[0], np.fromfile(a / "val" / "000000.bin", np.uint16)[:17])
    assert data_rules.document_eos(cfg) == 0
    with pytest.raises(JaxdistError, match="prepared with 4096 token ids.*re-run prepare with its tokenizer"):
        loader_mod.load_windows(cfg.replace(model=dict(vocab_size=4000)))
    other = word_tokenizer(tmp_path / "other", post_bos=False)
    with pytest.raises(JaxdistError, match="sha256 differs"):
        loader_mod.load_windows(cfg.replace(data=dict(tokenizer=str(other))))


def test_data_line_counts_token_shards_and_says_the_dtype_read(prepared, tiny_cfg, tmp_path):
    """Three train shards + one val shard in uint32: the line counts those four (not manifest.json or
    the tokenizer files beside them) and says uint32, whatever data.token_dtype was left at."""
    from types import SimpleNamespace

    from jaxdist.observe import report

    a, _ = prepared
    out = tmp_path / "u32"
    args = ["prepare", "--tokenizer", str(a), "--out", str(out), "--dtype", "uint32", "--workers", "1"]
    assert prepare.main([*args, "--shard-tokens", "60000", "--val-fraction", "0.15", CORPUS]) == 0
    shards = {split: sorted((out / split).glob("*.bin")) for split in ("train", "val")}
    assert len(shards["train"]) >= 2 and len(shards["val"]) >= 1 and len(list(out.iterdir())) > 4
    cfg = tiny_cfg.replace(data=dict(source="tokens", path=str(out)), model=dict(vocab_size=4096, seq_len=16))
    resolved = data_rules.resolve_token_dtype(cfg)
    assert (cfg.data.token_dtype, resolved.data.token_dtype) == ("auto", "uint32")  # what config.yaml records
    train, held = loader_mod.load_windows(cfg)
    line = report.data_line(resolved, SimpleNamespace(train=train, held_out=held, mixture=None))
    n_train, n_val = len(shards["train"]), len(shards["val"])
    tokens = sum(len(np.fromfile(f, np.uint32)) for f in shards["train"])
    assert line.startswith(
        f"data: {n_train + n_val} token shards ({out}: {n_train} train/ + {n_val} val/, uint32 from its "
        f"manifest.json), {tokens:,} tokens; {len(train):,} train windows of 17 tokens + {len(held):,} held out "
        "(the val/ split, "
    ), line
    # Plain token files: the files read and the dtype they are read as.
    np.arange(100, dtype=np.uint32).tofile(tmp_path / "x.bin")
    plain = tiny_cfg.replace(data=dict(source="tokens", path=str(tmp_path / "x.bin"), token_dtype="uint32"))
    train, held = loader_mod.load_windows(plain.replace(model=dict(seq_len=16)))
    assert train.label == f"1 token file ({tmp_path / 'x.bin'}, uint32)" and held.label.startswith("the last 2%")


def test_prepare_warns_when_the_held_out_split_is_empty_or_small(prepared, tmp_path):
    a, _ = prepared
    docs = tmp_path / "docs"
    docs.mkdir()
    texts = (f"document {i}: " + "some words of text. " * 20 for i in range(1000))
    kept = [t for t in texts if not prepare.is_held_out(t, 0.01)][:17]  # --val-fraction 0.01 holds none out
    assert sum(prepare.is_held_out(t, 0.3) for t in kept) >= 1
    for i, text in enumerate(kept):
        (docs / f"{i:02d}.txt").write_text(text)
    lines = []

    def run(out: str, fraction: float) -> dict:
        argv = ["prepare", "--tokenizer", str(a), "--out", str(tmp_path / out), "--workers", "1"]
        return prepare.prepare(
            prepare.parse_args([*argv, "--val-fraction", str(fraction), str(docs)]), log=lines.append
        )

    manifest = run("none", 0.01)
    assert manifest["splits"]["val"]["documents"] == 0
    assert lines[-1] == (
        "warning: no document was held out (--val-fraction 0.01 of 17 documents): training on this folder will "
        "not evaluate; re-run with --val-fraction 0.5 or add documents"
    )
    manifest = run("some", 0.3)
    val = manifest["splits"]["val"]
    assert 1 <= val["documents"] < 17 and lines[-1].startswith(
        f"warning: the held-out split is small ({val['documents']} of 17 documents, {val['tokens']:,} tokens, under "
        "65,536): its eval loss is noisy, and absent for model.seq_len >= "
    )
    n = len(lines)
    big = prepare.held_out_note(
        {
            "val_fraction": 0.01,
            "splits": {"train": {"tokens": 10**7, "documents": 999}, "val": {"tokens": 10**5, "documents": 10}},
        }
    )
    assert big is None and len(lines) == n


def test_a_prepared_folder_evaluates_on_its_val_split_only(prepared, tiny_cfg):
    """One rule: a prepared folder's val/ split, never windows from the tail of the training shards; a
    val/ split with no whole window turns evaluation off with a reason that names the fix."""
    a, _ = prepared
    manifest = json.loads((a / "manifest.json").read_text())
    val_tokens = manifest["splits"]["val"]["tokens"]
    cfg = tiny_cfg.replace(data=dict(source="tokens", path=str(a)), model=dict(vocab_size=4096, seq_len=val_tokens))
    train, held = loader_mod.load_windows(cfg)
    assert len(held) == 0 and len(train) == (manifest["splits"]["train"]["tokens"] - 1) // val_tokens
    loader = type("L", (), {"train": train, "held_out": held, "mixture": None, "has_eval": lambda self: False})()
    reason = loader_mod.no_eval_reason(cfg.replace(train=dict(eval_every=10)), loader)
    assert reason == (
        f"the val/ split of {a} ({val_tokens:,} tokens) holds no window of model.seq_len+1={val_tokens + 1} tokens; "
        "re-run prepare with a larger --val-fraction (or more documents), or lower model.seq_len"
    )


# ---------------------------------------------------------------------------------------- inputs


def test_jsonl_and_parquet_inputs(prepared, tmp_path):
    pq = pytest.importorskip(
        "pyarrow.parquet", reason="pyarrow not installed: pip install -e '.[parquet]' (CI installs .[ci])"
    )
    import pyarrow as pa

    a, _ = prepared
    texts = ["first document\nwith two lines", "second: é ü ✓", "third <|endoftext|> is text here"]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"body": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    pq.write_table(pa.table({"body": texts}), tmp_path / "d.parquet")
    outs = []
    for name in ("d.jsonl", "d.parquet"):
        out = tmp_path / f"out-{name}"
        assert (
            prepare.main(
                [
                    "prepare",
                    "--tokenizer",
                    str(a),
                    "--out",
                    str(out),
                    str(tmp_path / name),
                    "--field",
                    "body",
                    "--val-fraction",
                    "0",
                    "--workers",
                    "1",
                ]
            )
            == 0
        )
        outs.append(np.fromfile(out / "train" / "000000.bin", np.uint16))
    np.testing.assert_array_equal(outs[0], outs[1])
    tok = tokenizer.load(str(a))
    assert [tok.decode(d[:-1]) for d in split_at(outs[0], tok.eos_id)] == texts


def test_bad_prepare_input_is_one_line_exit_2(prepared, tmp_path, capsys):
    a, _ = prepared
    out = run_prepare("--tokenizer", tmp_path / "missing.json", "--out", tmp_path / "o", CORPUS)
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert out.stderr.startswith("error: tokenizer ") and "not found" in out.stderr
    assert not (tmp_path / "o").exists()

    def fails(*argv) -> str:
        assert prepare.main(["prepare", *map(str, argv)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ")
        return err

    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "x.jsonl").write_text('{"text": "ok"}\n{"other": 1}\n')
    big = word_tokenizer(tmp_path / "big", post_bos=False, extra=70_000)
    assert "too many for uint16" in fails("--tokenizer", big, "--dtype", "uint16", "--out", tmp_path / "o", CORPUS)
    assert "are empty" in fails("--tokenizer", a, "--out", tmp_path / "o", tmp_path / "empty.txt")
    assert "matches no files" in fails("--tokenizer", a, "--out", tmp_path / "o", tmp_path / "nope*.txt")
    assert "no string field 'text'" in fails("--tokenizer", a, "--out", tmp_path / "o", tmp_path / "x.jsonl")
    assert "not empty" in fails("--tokenizer", a, "--out", a, CORPUS)
    assert "too small" in fails("--train-tokenizer", 100, "--out", tmp_path / "o", CORPUS)
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.tmp-*"))
    assert json.loads((a / "manifest.json").read_text())["vocab_size"] == 4096  # the refused --out is untouched


def test_prepare_says_hub_ids_are_not_taken_for_the_tokenizer(tmp_path, capsys):
    """`prepare --tokenizer hf:ORG/NAME` was refused as 'not found' without saying why: it names the fix."""
    (tmp_path / "a.txt").write_text("hello")
    argv = ["prepare", "--tokenizer", "hf:Qwen/Qwen3-0.6B", "--out", str(tmp_path / "o"), str(tmp_path / "a.txt")]
    assert prepare.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Hub ids are not read here" in err and "hf download Qwen/Qwen3-0.6B" in err
    assert not (tmp_path / "o").exists()
