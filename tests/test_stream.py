"""Streamed sources (`data.sources` with `stream: true`, jaxdist/data/stream.py): the windows `prepare`
makes, the same global batches on any mesh or process split inside a mixture, exact resume, bad input.
The loader alone: no model is compiled."""

import json
import os
import re
import shutil

import numpy as np
import pytest
from test_mixture import batch_sharding, take
from test_tokenize import word_tokenizer

from jaxdist import config
from jaxdist.data import data_rules, prepare, stream, stream_workers
from jaxdist.data import loader as loader_mod
from jaxdist.errors import JaxdistError
from jaxdist.observe import report

SEQ = 16  # windows of 17 tokens


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    """Three JSONL files of word documents (~17 windows each), the word tokenizer, and the same corpus
    through `prepare --val-fraction 0`."""
    root = tmp_path_factory.mktemp("stream")
    tok = word_tokenizer(root / "tok", post_bos=True, extra=200)  # <s> words </s>; ids < 205
    rng = np.random.default_rng(0)
    (root / "jsonl").mkdir()
    for f in range(3):
        with open(root / "jsonl" / f"part{f}.jsonl", "w") as fh:
            for _ in range(12):
                words = " ".join(f"w{i}" for i in rng.integers(0, 200, rng.integers(3, 40)))
                fh.write(json.dumps({"text": words, "id": f}) + "\n")
    args = ["prepare", "--tokenizer", str(tok), "--out", str(root / "prep"), "--workers", "1", "--val-fraction", "0"]
    assert prepare.main([*args, str(root / "jsonl")]) == 0
    (np.arange(3000) % 50 + 250).astype(np.uint16).tofile(root / "web.bin")  # ids 250..299: told apart
    return root


def stream_cfg(root, *extra):
    sources = (
        f"data.sources=[{{name: web, path: {root}/web.bin, weight: 0.5}}, "
        f"{{name: docs, path: {root}/jsonl, weight: 0.5, stream: true}}]"
    )
    base = ["model.vocab_size=300", f"model.seq_len={SEQ}", "data.source=tokens", f"data.tokenizer={root}/tok"]
    return config.load(None, [*base, "train.steps=20", "train.eval_batches=2", sources, *extra])


def test_streamed_windows_are_prepares_windows(docs, tmp_path):
    """The first N windows of a streamed JSONL source are those of the same corpus through `prepare`
    (same tokenizer, same packing rule), and so are those of the same rows as Arrow files; the stream then
    repeats in the same order."""
    cfg = config.load(None, ["model.vocab_size=300", f"model.seq_len={SEQ}", f"data.path={docs}/prep"])
    prepared, _ = loader_mod.load_windows(data_rules.source_of_prepared(cfg, log=lambda *a: None))
    streamed = stream.Streamed(sorted(map(str, (docs / "jsonl").iterdir())), "auto", "text", f"{docs}/tok", SEQ + 1)
    n = len(prepared)
    assert 40 <= n <= 70  # ~17 windows per file: the stream crosses files
    got = np.stack([streamed[i] for i in range(n)])
    np.testing.assert_array_equal(got, np.stack([prepared[i] for i in range(n)]))
    assert got[0, 0] == 0 and (got == 1).any()  # BOS and EOS inside windows: documents packed as prepare packs
    np.testing.assert_array_equal(streamed[n + 3], got[3])  # the next pass, same order
    assert streamed.epoch == n
    np.testing.assert_array_equal(streamed[5], got[5])  # an earlier window is read again from its file's start
    # the same documents as Arrow IPC streams, as the Hugging Face datasets cache stores them
    import pyarrow as pa

    arrow = []
    for f in sorted((docs / "jsonl").iterdir()):
        table = pa.Table.from_pylist([json.loads(x) for x in f.read_text().splitlines()])
        arrow.append(str(tmp_path / f"{f.stem}.arrow"))
        with pa.OSFile(arrow[-1], "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=5)
    from_arrow = stream.Streamed(arrow, "auto", "text", f"{docs}/tok", SEQ + 1)
    np.testing.assert_array_equal(np.stack([from_arrow[i] for i in range(n)]), got)


def test_same_batches_on_dp8_fsdp8_two_process_split_and_exact_resume(docs, tmp_path):
    """A mixture with a streamed source: 20 global batches identical on dp=8, fsdp=8 and two processes x
    4 devices (the loader's row split); a resume at step 7 gives batches 8..20 unchanged, reading again
    only from the start of the file that holds the next window."""
    cfg = stream_cfg(docs, "data.stages=[{step: 10, weights: {web: 1, docs: 3}}]")
    dp = take(loader_mod.Loader(cfg, batch_sharding("dp=8")), 20)
    fsdp = take(loader_mod.Loader(cfg, batch_sharding("fsdp=8")), 20)
    for a, b in zip(dp, fsdp):
        np.testing.assert_array_equal(a, b)
    mix = loader_mod.Loader(cfg, batch_sharding("dp=8")).mixture
    halves = [loader_mod.mixed_batches(mix, 8, rows) for rows in ((0, 4), (4, 8))]
    for s in (0, 9, 10, 19):
        np.testing.assert_array_equal(dp[s], np.concatenate([h[s] for h in halves]))
    streamed_rows = np.concatenate(dp)[:, 0] < 250
    assert 0.45 < streamed_rows[:80].mean() < 0.55 and 0.7 < streamed_rows[80:].mean() < 0.8  # weights, stage

    first = loader_mod.Loader(cfg, batch_sharding("dp=8"))
    take(first, 7)
    state = json.loads(json.dumps(first.get_state()))  # what a checkpoint stores
    assert state["sources"] == {"web": 28, "docs": 28}
    saved = state["streamed"]["docs"]
    assert saved["file"] == 1 and 0 < saved["window"] <= 28 and len(saved["carry"]) < SEQ + 1
    again = loader_mod.Loader(cfg, batch_sharding("fsdp=8"))
    again.set_state(state)
    for a, b in zip(dp[7:], take(again, 13)):
        np.testing.assert_array_equal(a, b)
    # the saved position reads from its own file on: with the first file gone, its windows are the same
    copies = []
    for f in sorted((docs / "jsonl").iterdir()):
        copies.append(str(tmp_path / f.name))
        shutil.copy(f, copies[-1])
    resumed = stream.Streamed(copies, "auto", "text", f"{docs}/tok", SEQ + 1)
    resumed.restore(saved)
    os.remove(copies[0])
    whole = stream.Streamed(sorted(map(str, (docs / "jsonl").iterdir())), "auto", "text", f"{docs}/tok", SEQ + 1)
    for i in range(saved["window"], 40):
        np.testing.assert_array_equal(resumed[i], whole[i])
    line = report.data_line(cfg, first)
    assert "docs: 3 files streamed" in line and "none held out" in line


def test_grain_workers_give_the_same_windows_resume_exactly_and_carry_bad_input(docs, tmp_path, monkeypatch):
    """`workers: 2` (chunks tokenized in two grain worker processes, chunk k in worker k mod 2), one
    pipeline (each start spawns two Python processes that import JAX: the cost of this test): resumed from
    a 1-worker state mid-stream (file 1, tokens carried into it), it gives one worker's windows after it
    across the next file (a fresh stream is the same path from file 0 with nothing carried); a document
    that is not UTF-8 in a worker's chunk is counted once, and a line that is not JSON arrives as the same
    one-line error, after the windows before it."""
    monkeypatch.setattr(stream_workers, "CHUNK_CHARS", 300)  # ~2 documents a chunk: ~5 chunks per file
    files = sorted(map(str, (docs / "jsonl").iterdir()))
    one = stream.Streamed(files, "auto", "text", f"{docs}/tok", SEQ + 1)
    n = 40  # into the third file
    want = np.stack([one[i] for i in range(n)])
    saved = one.state(20)
    assert saved["file"] == 1 and saved["carry"] and saved["window"] < 20
    bad = tmp_path / "z.jsonl"  # after the three files: a good document, one not UTF-8, one not JSON
    bad.write_bytes(json.dumps({"text": "w1 w2"}).encode() + b'\n{"text": "w3 \xff"}\n{not json\n')
    two = stream.Streamed([*files, str(bad)], "auto", "text", f"{docs}/tok", SEQ + 1, workers=2)
    two.restore(saved)
    np.testing.assert_array_equal(np.stack([two[i] for i in range(saved["window"], n)]), want[saved["window"] :])
    with pytest.raises(JaxdistError, match=r"^\S+z.jsonl:3 is not valid JSON; JSONL needs one JSON object per line$"):
        for i in range(n, n + 30):
            np.testing.assert_array_equal(two[i], one[i])  # the windows before the bad line are read
    assert [s.split(": ")[0] for s in two.skipped_docs()] == [f"{bad}:2"]
    assert {**two.state(30), "skipped": 0} == {
        **one.state(30),
        "skipped": 0,
    }  # what a checkpoint stores does not depend on the worker count
    two.close()


def test_split_files_each_process_opens_only_its_files_and_resumes_exactly(docs, monkeypatch):
    """split_files (opt-in): simulated process p of 2 (rows 4p..4p+3 of each batch of 8) opens only files
    p, p+2 (file opens counted), the two open each file once between them, and a process's streamed rows
    take its own stream's windows in turn (none skipped or repeated, so together they read the corpus
    once per pass). Its resume is exact and refuses another process count; fewer files than processes
    and split_files on a prepared source are one line."""
    import functools

    from jaxdist.data import documents, mixture

    opened: list[str] = []

    def counting_open(path, *args, **kwargs):
        opened.append(os.path.basename(path))
        return open(path, *args, **kwargs)

    web = {"name": "web", "path": f"{docs}/web.bin", "weight": 0.5}
    split = {"name": "docs", "path": f"{docs}/jsonl", "weight": 0.5, "stream": True, "split_files": True}
    cfg = stream_cfg(docs).replace(data=dict(sources=[web, split]))
    files = sorted(map(str, (docs / "jsonl").iterdir()))
    monkeypatch.setattr(documents, "open", counting_open, raising=False)
    seen = []
    for p in (0, 1):
        opened.clear()
        rows = (4 * p, 4 * p + 4)
        mix = mixture.Mixture(cfg, functools.partial(loader_mod.read_source, process=(p, 2)), rows)
        got = np.concatenate([loader_mod.mixed_batches(mix, 8, rows)[s] for s in range(20)])
        seen.append(sorted(set(opened)))
        mine = got[got[:, 0] < 250]  # the streamed rows, in row order
        assert 36 <= len(mine) <= 44  # half of 80 rows, to within grain's interleaving
        own = stream.Streamed(files[p::2], "auto", "text", f"{docs}/tok", SEQ + 1)
        np.testing.assert_array_equal(mine, np.stack([own[i] for i in range(len(mine))]))
    assert seen == [["part0.jsonl", "part2.jsonl"], ["part1.jsonl"]]

    first = loader_mod.Loader(cfg, batch_sharding("dp=8"), process=(1, 2))
    want = take(first, 20)
    first = loader_mod.Loader(cfg, batch_sharding("dp=8"), process=(1, 2))
    take(first, 7)
    state = json.loads(json.dumps(first.get_state()))
    assert state["streamed"]["docs"]["local"] == int((np.concatenate(want[:7])[:, 0] < 250).sum())
    again = loader_mod.Loader(cfg, batch_sharding("fsdp=8"), process=(1, 2))
    again.set_state(state)
    for a, b in zip(want[7:], take(again, 13)):
        np.testing.assert_array_equal(a, b)
    other = loader_mod.Loader(cfg, batch_sharding("dp=8"), process=(0, 2))
    with pytest.raises(JaxdistError, match=r"checkpoint was saved by process 1 of 2, but this is process 0 of 2"):
        other.set_state(state)
    with pytest.raises(JaxdistError, match=r"^data.sources docs: split_files gives each of the 4 processes its own"):
        loader_mod.Loader(cfg, batch_sharding("dp=8"), process=(0, 4))
    with pytest.raises(JaxdistError, match=r"sets split_files but is not streamed"):
        stream_cfg(docs).replace(data=dict(sources=[{**web, "split_files": True}]))


def test_bad_streamed_input(docs, tmp_path):
    """A line that is not UTF-8 is skipped and counted; a line that is not JSON stops with one line naming
    file and line, and the next read tries again (nothing is taken from elsewhere); config errors."""
    lines = [json.dumps({"text": " ".join(["w1"] * 30)})] * 4
    (tmp_path / "a.jsonl").write_bytes(b"\n".join([lines[0].encode(), b'{"text": "w1 \xff"}', *map(str.encode, lines)]))
    (tmp_path / "b.jsonl").write_text(lines[0] + "\n{not json\n")
    s = stream.Streamed([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")], "auto", "text", f"{docs}/tok", SEQ + 1)
    for i in range(8):
        s[i]  # a.jsonl's windows
    assert len(s.skipped) == 1 and "a.jsonl:2: byte 0xff" in s.skipped[0] and s.state(8)["skipped"] == 1
    for _ in range(2):
        with pytest.raises(
            JaxdistError, match=r"^\S+b.jsonl:2 is not valid JSON; JSONL needs one JSON object per line$"
        ):
            s[12]
    for extra, message in [
        (["data.tokenizer="], r"data.sources\[1\] \(docs\) is streamed \(stream: true\) but data.tokenizer is empty"),
        (["data.on_exhausted=stop"], "is streamed, so its size is unknown until it is read"),
    ]:
        with pytest.raises(JaxdistError, match=message):
            stream_cfg(docs, *extra)


def test_a_run_whose_stream_turns_bad_saves_the_steps_done_and_counts_skips(docs, tmp_path):
    """End to end (MICRO_MODEL, one run of 4 steps): a streamed file's document that is not UTF-8 is
    skipped and counted; the next file's line that is not JSON, met while drawing step 4's batch, ends the
    run in one line naming file and line and the skips, after saving step 3 (its checkpoint and metrics).
    What a run that ends well reports of the skips (its closing line, metrics.jsonl's `data_skipped`) is
    the loader's own: checked on the loader, without a second training."""
    from conftest import MICRO_MODEL

    from jaxdist import checkpoint, run

    good = json.dumps({"text": " ".join(["w1"] * 30)})  # 32 tokens: 13 of them are 25 windows of 17 tokens
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.jsonl").write_bytes(
        b"\n".join([good.encode(), b'{"text": "w2 \xff"}', *[good.encode()] * 12])
    )
    (tmp_path / "data" / "b.jsonl").write_text("{not json\n")
    model = [f"model.{k}={v}" for k, v in MICRO_MODEL.items() if k != "seq_len"]
    cfg = stream_cfg(
        docs,
        *model,
        "train.steps=4",
        "train.eval_every=0",
        "train.log_every=1",
        "train.plot=false",
        "checkpoint.every=100",
    ).replace(data=dict(sources=[{"name": "docs", "path": str(tmp_path / "data"), "stream": True}]))
    skip_note = r"streamed data skipped 1 document\(s\) that are not UTF-8: docs 1 \(first \S+a.jsonl:2: byte 0xff"
    loader = loader_mod.Loader(cfg, batch_sharding("dp=8"))  # what finish() reports after a run's last step
    take(loader, 3)
    assert loader.mixture is not None
    assert re.match("^; " + skip_note, loader.skip_note()) and loader.mixture.skip_counts() == {"docs": 1}

    with pytest.raises(JaxdistError) as got:
        run(cfg, tmp_path / "run", log=lambda *a: None)
    line = str(got.value)
    assert "\n" not in line
    assert re.match(r"^\S+b.jsonl:1 is not valid JSON; JSONL needs one JSON object per line; " + skip_note, line), line
    assert re.search(
        r"stopping: checkpoint step 3 saved in \S+; fix the data, then run the same command to resume$", line
    )
    assert checkpoint.open_manager(tmp_path / "run" / "checkpoints", read_only=True).all_steps() == [3]
    records = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r and "step" in r] == [1, 2, 3]
