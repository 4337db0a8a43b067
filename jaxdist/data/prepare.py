"""`python -m jaxdist.data prepare`: text, JSONL or Parquet -> flat token shards for `data.source=tokens`.

    python -m jaxdist.data prepare --train-tokenizer 4096 --out data/stdlib          # the standard library
    python -m jaxdist.data prepare --tokenizer ~/Llama-3.2-1B --out data/mine 'corpus/*.jsonl' --field text

Output folder: `train/NNNNNN.bin`, `val/NNNNNN.bin` (uint16 when the vocabulary fits, else uint32),
the tokenizer files, and `manifest.json` (dtype, vocab size, BOS/EOS ids, tokenizer sha256, token and
document counts). `data.path=DIR` trains on `train/` and evaluates on `val/`. `--chat`: conversations
with a loss mask (jaxdist/data/chatprep.py); `--preference`: preference pairs (jaxdist/data/prefprep.py).

Documents: a plain-text file is one document; a JSONL line or a Parquet row is one (its `--field`).
Each is encoded `[BOS] tokens EOS` by the tokenizer's rule (jaxdist/data/tokenizer.py). The held-out split
is chosen by a hash of each document's text: independent of order, worker count and machine, and
exact duplicates land on the same side. Workers encode chunks in parallel; the main process writes
them in input order, so the shards are byte-identical whatever `--workers` is. Everything is written
to a temporary folder that replaces `--out` only when complete (the folder on disk: jaxdist/data/shards.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from jaxdist.data import chatprep, jsonl_lines, prefprep, promptprep
from jaxdist.data import tokenizer as tokenizer_mod
from jaxdist.data.documents import documents, input_files
from jaxdist.data.encode import chunks, encoded, is_held_out
from jaxdist.data.shards import FORMAT, MANIFEST, ShardWriter, check_out, remove_stale, replace_folder
from jaxdist.errors import ArgumentParser, JaxdistError, command, disk_full

# Held-out tokens below which `prepare` warns: 32 windows of 2,048 tokens (the default eval reads
# train.eval_batches=4 x global_batch=8 windows); below it the eval loss is noisy, or absent at long seq_len.
SMALL_VAL_TOKENS = 65_536


def parse_args(argv: list[str]) -> argparse.Namespace:
    """`prepare ARGS...` (the one subcommand so far); flags and inputs may be intermixed."""
    if not argv or argv[0] != "prepare":
        top = ArgumentParser(
            prog="python -m jaxdist.data", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        top.add_argument("command", choices=["prepare"])
        top.parse_args(argv[:1])  # prints usage / help and exits
    q = ArgumentParser(
        prog="python -m jaxdist.data prepare", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    which = q.add_mutually_exclusive_group(required=True)
    which.add_argument("--tokenizer", help="a tokenizer.json or a Hugging Face model folder")
    which.add_argument(
        "--train-tokenizer",
        type=int,
        metavar="VOCAB",
        help="first train a byte-level BPE of VOCAB tokens on the input (no download)",
    )
    q.add_argument("--out", required=True, help="output folder (must be new or empty, unless --overwrite)")
    q.add_argument(
        "inputs",
        nargs="*",
        metavar="INPUT",
        help="files, globs or folders (default: this Python's standard library source)",
    )
    q.add_argument("--field", help="JSONL/Parquet field holding the text (default text)")
    q.add_argument(
        "--format",
        default="auto",
        choices=("auto", "text", "jsonl", "parquet", "arrow"),
        help="input format (auto: .jsonl/.ndjson, .parquet, .arrow (the HF datasets cache), else plain text)",
    )
    q.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1), help="encoding processes")
    q.add_argument("--val-fraction", type=float, default=0.01, help="documents held out (default 0.01)")
    q.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "uint16", "uint32"),
        help="token dtype (auto: uint16 when the vocabulary fits)",
    )
    q.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard file")
    q.add_argument("--overwrite", action="store_true", help="replace a non-empty --out folder")
    c = q.add_argument_group("chat data (jaxdist/data/chatprep.py, docs/chat-data.md)")
    c.add_argument("--chat", action="store_true", help='JSONL conversations {"messages": [...]} with a loss mask')
    c.add_argument("--seq-len", type=int, help="window length = the model.seq_len you will train with")
    c.add_argument("--loss-on", choices=("assistant", "all"), help="tokens trained on (default assistant)")
    q.add_argument(
        "--on-error",
        choices=("skip", "stop"),
        help="a bad line or a document that is not UTF-8: skip it and count (default), or stop",
    )
    c.add_argument("--chat-template", metavar="FILE", help="a Jinja template instead of the tokenizer's own")
    c.add_argument(
        "--preference",
        action="store_true",
        help='JSONL pairs {"prompt", "chosen", "rejected"} for objective.method=dpo (jaxdist/data/prefprep.py)',
    )
    c.add_argument(
        "--prompts",
        action="store_true",
        help='JSONL prompts {"prompt", ...columns for the reward} for GRPO (jaxdist/data/promptprep.py)',
    )
    return q.parse_intermixed_args(argv[1:])


def max_workers() -> int:
    """The --workers cap: twice the cores this process may run on (at least 4). Each worker is a process
    holding the tokenizer, with two 1 MiB chunks in flight; 100,000 of them were accepted and forked."""
    return max(4, 2 * len(os.sched_getaffinity(0)))


# ------------------------------------------------------------------------------------------ command


def prepare(args: argparse.Namespace, log=print) -> dict:
    """Run the preparation; returns the manifest. Input is checked before anything is written."""
    out = Path(args.out)
    check_out(out, args.overwrite)
    if args.workers < 1 or args.shard_tokens < 1 or not 0 <= args.val_fraction < 1:
        raise JaxdistError("--workers and --shard-tokens must be >= 1 and --val-fraction in [0, 1)")
    if args.workers > (most := max_workers()):
        raise JaxdistError(
            f"--workers {args.workers} is more than this machine can use ({len(os.sched_getaffinity(0))} cores; "
            f"at most {most} encoding processes); give --workers {most} or fewer"
        )
    tok = tokenizer_mod.load(args.tokenizer) if args.tokenizer else None
    files = input_files(args.inputs)
    chatprep.check_args(args, files)
    args.field = args.field or "text"  # given with --chat or --preference it was refused above
    total_bytes = sum(os.path.getsize(f) for f in files)
    if total_bytes == 0:
        raise JaxdistError(f"the {len(files)} input file(s) are empty; give files that hold text")
    if tok is not None:
        dtype = check_dtype(tok.vocab_size, args.dtype, str(tok.file))

    remove_stale(out, log)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        t0 = time.perf_counter()
        if tok is None:  # train on the documents that will be training data
            train_texts = (
                t
                for t, _ in documents(files, args.format, args.field, None if args.on_error == "stop" else [])
                if t and not is_held_out(t, args.val_fraction)
            )
            tokenizer_mod.save_trained(tokenizer_mod.train_bpe(train_texts, args.train_tokenizer), tmp)
            tok = tokenizer_mod.load(str(tmp))
            dtype = check_dtype(tok.vocab_size, args.dtype, f"the trained tokenizer ({args.train_tokenizer})")
            log(f"trained a byte-level BPE of {tok.vocab_size} tokens in {time.perf_counter() - t0:.1f}s")
        else:
            tokenizer_mod.copy_files(tok, tmp)
        # conversations -> windows + loss mask; preference pairs -> a chosen and a rejected row + loss mask;
        # prompts (+ the reward's columns) -> prompt records for GRPO's rollouts
        special = (
            chatprep.encode_chat
            if args.chat
            else prefprep.encode_preference
            if args.preference
            else promptprep.encode_prompts
            if args.prompts
            else None
        )
        if special is not None:
            manifest = special(args, files, total_bytes, dtype, tmp, log, is_held_out)
        else:
            manifest = encode_all(args, files, total_bytes, tok, dtype, tmp, log)
        if manifest["splits"]["train"]["documents"] == 0:
            raise JaxdistError(
                f"the input ({len(files)} file(s)) holds no training documents (all empty, "
                "or all held out); give more text or lower --val-fraction"
            )
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        replace_folder(tmp, out)
        if (note := held_out_note(manifest)) is not None:
            log(note)
    except OSError as e:
        if not disk_full(e):
            raise
        raise JaxdistError(
            f"cannot write {out} ({e.strerror.lower() if e.strerror else 'the disk is full'}): nothing was written "
            f"there (the partial output in {tmp.name} is removed); free space, then run the same command"
        ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def held_out_note(manifest: dict) -> str | None:
    """A warning when the held-out split is empty or small, with a --val-fraction that would fix it (the
    trainer evaluates on val/ only, and not at all when it holds no window)."""
    train, val = manifest["splits"]["train"], manifest["splits"]["val"]
    fraction, docs = manifest["val_fraction"], train["documents"] + val["documents"]
    if val["tokens"] >= SMALL_VAL_TOKENS:
        return None
    total = train["tokens"] + val["tokens"]
    # enough tokens on average, at least two documents, and more than now; at most half the data
    want = max(SMALL_VAL_TOKENS / max(total, 1), 2 / max(docs, 1), 2 * fraction)
    suggest = f"{min(0.5, float(f'{want:.2g}')):g}"
    if val["documents"] == 0:
        return (
            f"warning: no document was held out (--val-fraction {fraction:g} of {docs:,} documents): training on "
            f"this folder will not evaluate; re-run with --val-fraction {suggest} or add documents"
        )
    return (
        f"warning: the held-out split is small ({val['documents']:,} of {docs:,} documents, {val['tokens']:,} "
        f"tokens, under {SMALL_VAL_TOKENS:,}): its eval loss is noisy, and absent for model.seq_len >= "
        f"{val['tokens']:,}; re-run with --val-fraction {suggest} or add documents"
    )


def check_dtype(vocab_size: int, requested: str, what: str) -> str:
    dtype = tokenizer_mod.smallest_dtype(vocab_size) if requested == "auto" else requested
    if vocab_size > np.iinfo(dtype).max + 1:
        raise JaxdistError(f"{what} has {vocab_size} token ids, too many for {dtype}; use --dtype uint32 (or auto)")
    return dtype


def encode_all(args, files, total_bytes, tok, dtype, tmp: Path, log) -> dict:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker: --workers is the parallelism
    writers = {
        "train": ShardWriter(tmp / "train", dtype, args.shard_tokens),
        "val": ShardWriter(tmp / "val", dtype, args.shard_tokens),
    }
    t0 = time.perf_counter()
    skipped: list[str] | None = None if args.on_error == "stop" else []
    tasks = chunks(documents(files, args.format, args.field, skipped), args.val_fraction)
    # A terminal shows the bar (cleared at the end, so an error stays one line); logs do not.
    with tqdm(
        total=total_bytes,
        unit="B",
        unit_scale=True,
        desc="tokenize",
        dynamic_ncols=True,
        mininterval=1.0,
        leave=False,
        disable=None,
    ) as bar:
        for train, val, n_train, n_val, nbytes in encoded(tasks, tok, tmp, args.workers):
            writers["train"].write(train, n_train)
            writers["val"].write(val, n_val)
            bar.update(nbytes)
    for w in writers.values():
        w.close()
    seconds = time.perf_counter() - t0
    if skipped:
        (tmp / "skipped.txt").write_text("".join(s + "\n" for s in skipped), encoding="utf-8")
        shown = "\n".join(f"  {s}" for s in skipped[: jsonl_lines.REPORT_LINES])
        more = (
            f"\n  ... {len(skipped) - jsonl_lines.REPORT_LINES} more" if len(skipped) > jsonl_lines.REPORT_LINES else ""
        )
        log(
            f"skipped {len(skipped)} document(s) that are not UTF-8 (--on-error stop refuses them); every one is "
            f"listed in {args.out}/skipped.txt:\n{shown}{more}"
        )
    splits = {name: w.summary() for name, w in writers.items()}
    tokens = sum(s["tokens"] for s in splits.values())
    log(
        f"{tokens:,} tokens ({splits['train']['documents']:,} train / {splits['val']['documents']:,} held-out "
        f"documents) from {len(files)} file(s), {total_bytes / 1e6:.1f} MB, in {seconds:.1f}s: "
        f"{tokens / seconds:,.0f} tokens/s with {args.workers} worker(s); dtype {dtype} -> {args.out}"
    )
    return {
        "format": FORMAT,
        "dtype": dtype,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "prefix_ids": list(tok.prefix),
        "tokenizer": {"file": "tokenizer.json", "sha256": tok.sha256},
        "splits": splits,
        "val_fraction": args.val_fraction,
        "input": {
            "files": len(files),
            "bytes": total_bytes,
            "field": args.field,
            "skipped": {"not_utf8": len(skipped or [])},
        },
    }


@command
def main(argv: list[str] | None = None) -> int:
    prepare(parse_args(sys.argv[1:] if argv is None else argv))
    return 0
