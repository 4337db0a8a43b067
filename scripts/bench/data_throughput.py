"""Data throughput: tokens/s the loader hands the trainer (one prepared folder, a mixture of sources, a
streamed JSONL source tokenized while it is read), with 1 and N grain threads or tokenizing workers, and
`prepare`'s MB/s per worker process.

    python scripts/bench/data_throughput.py --prepared data/stdlib --mixture data/stdlib data/tests data/docs
    python scripts/bench/data_throughput.py --prepared data/stdlib --stream-mb 20 --workers 1 2
    python scripts/bench/data_throughput.py --tokenizer tests/fixtures/chat/llama3 --prepare-mb 100 --workers 1 2
    python scripts/bench/data_throughput.py --tokenizer tests/fixtures/chat/llama3 --stream-mb 20 --workers 1 2 \
        --steps 2000 --threads 1 --trainer tiny --trainer-steps 40

With --stream-mb and no --prepared, the same corpus is also prepared (1 worker) and read back as a
prepared folder, so streamed and prepared tokens/s are measured on one corpus. --trainer CONFIG measures
the tokens/s `python -m jaxdist.train --config CONFIG` trains at on this machine (its closing line).

The loader is timed on one device (the batch as a global array, as the trainer takes it) after a
warm-up, over --steps steps of --global-batch windows of --seq-len + 1 tokens; `prepare` is timed on a
JSONL corpus of --prepare-mb MB (the standard library's .py files, repeated) with the prepared folder's
tokenizer. Prints one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def loader_rate(overrides: list[str], steps: int, threads: int) -> float:
    """Tokens/s through `Loader.__next__` (global arrays) after 5 warm-up steps."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxdist import config
    from jaxdist.data import loader as loader_mod
    from jaxdist.distributed.mesh import mesh_from_string

    cfg = config.load(None, [*overrides, f"data.prefetch={threads}"])
    sharding = NamedSharding(mesh_from_string("fsdp=1"), P(("dp", "fsdp")))
    loader = loader_mod.Loader(cfg, sharding)
    for _ in range(5):
        next(loader).block_until_ready()
    start = time.perf_counter()
    for _ in range(steps):
        next(loader).block_until_ready()
    return steps * cfg.train.global_batch * cfg.model.seq_len / (time.perf_counter() - start)


def corpus(folder: Path, megabytes: float) -> Path:
    """A JSONL corpus of the standard library's .py files, repeated to `megabytes` MB."""
    from jaxdist.data.files import stdlib_files

    out, size = folder / "corpus.jsonl", 0
    with out.open("w") as fh:
        while size < megabytes * 1e6:
            for f in stdlib_files():
                text = Path(f).read_bytes().decode("utf-8", errors="ignore")
                line = json.dumps({"text": text}) + "\n"
                fh.write(line)
                size += len(line)
                if size >= megabytes * 1e6:
                    break
    return out


def prepare_rate(tokenizer: str, source: Path, workers: int, where: Path) -> dict:
    from jaxdist.data import prepare

    out = where / f"out-{workers}"
    start = time.perf_counter()
    code = prepare.main(
        ["prepare", "--tokenizer", tokenizer, "--out", str(out), "--workers", str(workers), str(source)]
    )
    seconds = time.perf_counter() - start
    mb = source.stat().st_size / 1e6
    return {"workers": workers, "exit": code, "MB": round(mb, 1), "s": round(seconds, 1), "MB/s": mb / seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prepared", help="a folder made by python -m jaxdist.data prepare")
    p.add_argument("--tokenizer", help="for --stream-mb and --prepare-mb (default: the --prepared folder's)")
    p.add_argument("--stream-mb", type=float, default=0, help="> 0: time a streamed JSONL source this large")
    p.add_argument("--mixture", nargs="*", default=[], help="prepared folders to mix with equal weights")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--threads", type=int, nargs="*", default=[1, 4], help="grain threads (data.prefetch)")
    p.add_argument("--prepare-mb", type=float, default=0, help="> 0: time prepare on a corpus this large")
    p.add_argument("--workers", type=int, nargs="*", default=[1, 2], help="prepare's / the streamed source's")
    p.add_argument("--trainer", help="a config whose CPU training tokens/s to measure (e.g. tiny)")
    p.add_argument("--trainer-steps", type=int, default=40)
    args = p.parse_args()

    from jaxdist.distributed.platform import setup_platform

    setup_platform(1)
    from jaxdist.data import tokenizer as tokenizer_mod

    tokenizer = args.tokenizer or args.prepared
    if not tokenizer:
        p.error("give --prepared or --tokenizer")
    vocab = tokenizer_mod.load(tokenizer).vocab_size
    common = [
        "data.source=tokens",
        f"model.vocab_size={vocab}",
        f"model.seq_len={args.seq_len}",
        f"train.global_batch={args.global_batch}",
    ]
    runs = {"prepared": [*common, f"data.path={args.prepared}"]} if args.prepared else {}
    if args.mixture:
        listing = ", ".join(f"{{name: s{i}, path: {path}, weight: 1}}" for i, path in enumerate(args.mixture))
        runs["mixture"] = [*common, f"data.sources=[{listing}]"]
    for name, overrides in runs.items():
        for threads in args.threads:
            rate = loader_rate(overrides, args.steps, threads)
            print(json.dumps({"loader": name, "threads": threads, "tokens_per_s": round(rate)}), flush=True)
    if args.stream_mb > 0:  # one streamed source, its documents tokenized as the loader reads them
        with tempfile.TemporaryDirectory() as tmp:
            source = corpus(Path(tmp), args.stream_mb)
            for workers in args.workers:
                streamed = f"data.sources=[{{name: web, path: {source}, stream: true, workers: {workers}}}]"
                rate = loader_rate([*common, f"data.tokenizer={tokenizer}", streamed], args.steps, 1)
                print(json.dumps({"loader": "streamed", "workers": workers, "tokens_per_s": round(rate)}), flush=True)
            if not args.prepared:  # the same corpus through prepare, then read as a prepared folder
                got = prepare_rate(tokenizer, source, 1, Path(tmp))
                print(json.dumps({"prepare": got}), flush=True)
                for threads in args.threads:
                    rate = loader_rate([*common, f"data.path={tmp}/out-1"], args.steps, threads)
                    row = {"loader": "prepared (same corpus)", "threads": threads, "tokens_per_s": round(rate)}
                    print(json.dumps(row), flush=True)
    if args.prepare_mb > 0:
        with tempfile.TemporaryDirectory() as tmp:
            source = corpus(Path(tmp), args.prepare_mb)
            for workers in args.workers:
                got = prepare_rate(tokenizer, source, workers, Path(tmp))
                got["MB/s per worker"] = got["MB/s"] / workers
                print(json.dumps({"prepare": got}), flush=True)

    if args.trainer:
        print(json.dumps({"trainer": args.trainer, **trainer_rate(args.trainer, args.trainer_steps)}), flush=True)


def trainer_rate(name: str, steps: int) -> dict:
    """The tokens/s a CPU training run of config `name` reports in its closing line (compile excluded)."""
    import re
    import subprocess

    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "jaxdist.train", "--config", name, "--steps", str(steps)]
        command += ["train.eval_every=0", "train.plot=false", "--run-dir", f"{tmp}/run"]
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    done = next(line for line in out.splitlines() if line.startswith("done:"))
    return {"steps": steps, "tokens_per_s": float(re.search(r"([\d,.]+) tokens/s", done)[1].replace(",", ""))}


if __name__ == "__main__":
    main()
