"""Throughput of jaxdist's lm-eval model against lm-eval's `hf` backend on the same weights, on CPU:
loglikelihood requests/s and generated tokens/s, the same requests in the same batches.

    python scripts/bench/eval_throughput.py                 # the tiny config (configs/tiny.yaml's model), 1 step
    python scripts/bench/eval_throughput.py --model DIR     # an HF folder (e.g. tests/fixtures/eval_model)

Without --model it trains the tiny config for one step with the evaluation fixture's tokenizer (vocab
512) and exports it with `convert to-hf`. Then: jaxdist (`jaxdist.evaluation`, fsdp over the 8
simulated devices, programs compiled first and timed apart) and, in the reference interpreter
(/work/venvs/ref/bin/python: torch CPU, transformers), lm-eval's `HFLM` answer N loglikelihood
requests (the multiple-choice fixture's contexts and choices, repeated) and G generation requests
(greedy, `max_gen_toks` new tokens, no stop sequence). Prints one JSON line per backend and the ratios.
Both run on the same 2-core machine; the hf backend uses torch's own threads.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "tests" / "fixtures" / "eval_model" / "tokenizer.json"
CHOICES = REPO / "tests" / "fixtures" / "eval_tasks" / "choice.jsonl"
REF_PYTHON = os.environ.get("REF_PYTHON", "/work/venvs/ref/bin/python")


def requests(n_ll: int, n_gen: int, max_gen: int):
    from lm_eval.api.instance import Instance

    rows = [json.loads(line) for line in CHOICES.read_text().splitlines()]
    pairs = [(f"the {r['animal']}", f" {c}") for r in rows for c in r["choices"]]
    ll = [Instance("loglikelihood", {}, pairs[i % len(pairs)], i) for i in range(n_ll)]
    gen_kwargs = {"until": [], "max_gen_toks": max_gen, "do_sample": False}
    gen = [
        Instance("generate_until", {}, (f"after {r['animal']} comes", gen_kwargs), i) for i, r in enumerate(rows * 8)
    ][:n_gen]
    return ll, gen


def timed(lm, ll, gen, max_gen: int) -> dict:
    t0 = time.perf_counter()
    lm.loglikelihood(ll)
    t1 = time.perf_counter()
    lm.generate_until(gen)
    t2 = time.perf_counter()
    return {
        "loglikelihood_requests_per_s": len(ll) / (t1 - t0),
        "generated_tokens_per_s": len(gen) * max_gen / (t2 - t1),
        "loglikelihood_s": t1 - t0,
        "generate_s": t2 - t1,
    }


def jaxdist_side(model_dir: str, batch: int, n_ll: int, n_gen: int, max_gen: int) -> dict:
    from jaxdist.distributed.platform import setup_platform

    setup_platform(8)
    from jaxdist.evaluation import model

    lm = model.from_source(None, model_dir, "fsdp=-1", batch)
    ll, gen = requests(n_ll, n_gen, max_gen)
    t0 = time.perf_counter()
    timed(lm, ll[:batch], gen[:batch], max_gen)  # compiles the buckets these requests use
    out = {"backend": "jaxdist", "warm_up_and_compile_s": time.perf_counter() - t0}
    out |= timed(lm, ll, gen, max_gen)
    out["buckets"] = lm.programs.stats.line()
    return out


def hf_side(model_dir: str, batch: int, n_ll: int, n_gen: int, max_gen: int) -> dict:
    import torch
    import transformers
    from lm_eval.models.huggingface import HFLM

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(Path(model_dir) / "tokenizer.json"), eos_token="<|endoftext|>"
    )
    tok.pad_token = tok.eos_token
    lm = HFLM(pretrained=hf, tokenizer=tok, batch_size=batch, device="cpu")
    ll, gen = requests(n_ll, n_gen, max_gen)
    timed(lm, ll[:batch], gen[:batch], max_gen)  # warm-up
    return {"backend": "hf", "torch_threads": torch.get_num_threads()} | timed(lm, ll, gen, max_gen)


def tiny_export(tmp: Path) -> str:
    corpus = tmp / "corpus.txt"
    corpus.write_text("after one comes two. the cat meows.\n" * 400)
    run, out = tmp / "run", tmp / "hf"
    args = ["model.vocab_size=512", "data.source=text", f"data.path={corpus}", f"data.tokenizer={TOKENIZER}"]
    args += ["train.steps=1", "train.eval_every=0", "checkpoint.every=1"]
    subprocess.run([sys.executable, "-m", "jaxdist.train", "--run-dir", str(run), *args], check=True, cwd=REPO)
    subprocess.run([sys.executable, "-m", "jaxdist.convert", "to-hf", str(run), str(out)], check=True, cwd=REPO)
    return str(out)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", help="an HF folder (default: the tiny config, trained one step and exported)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--requests", type=int, default=256, help="loglikelihood requests")
    p.add_argument("--generations", type=int, default=32)
    p.add_argument("--max-gen-toks", type=int, default=32)
    p.add_argument("--side", choices=["jaxdist", "hf"], help=argparse.SUPPRESS)
    a = p.parse_args()
    sizes = (a.batch_size, a.requests, a.generations, a.max_gen_toks)
    if a.side:
        print(json.dumps((jaxdist_side if a.side == "jaxdist" else hf_side)(a.model, *sizes)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = a.model or tiny_export(Path(tmp))
        common = [__file__, "--model", model_dir, "--batch-size", str(a.batch_size), "--requests", str(a.requests)]
        common += ["--generations", str(a.generations), "--max-gen-toks", str(a.max_gen_toks)]
        got = {}
        for side, py in (("jaxdist", sys.executable), ("hf", REF_PYTHON)):
            out = subprocess.run([py, *common, "--side", side], capture_output=True, text=True, cwd=REPO)
            if out.returncode:
                sys.exit(out.stderr[-3000:])
            got[side] = json.loads(out.stdout.strip().splitlines()[-1])
            print(json.dumps(got[side]))
    for key in ("loglikelihood_requests_per_s", "generated_tokens_per_s"):
        print(f"{key}: jaxdist / hf = {got['jaxdist'][key] / got['hf'][key]:.2f}")


if __name__ == "__main__":
    main()
