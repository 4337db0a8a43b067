"""Make the committed evaluation fixture: a small jaxdist run's `convert to-hf` export and lm-eval's own
`hf` backend's answers on the local tasks (tests/fixtures/eval_tasks), which tests/test_eval.py checks
`python -m jaxdist.eval` against.

    python scripts/make_eval_fixture.py            # ~2 min on 2 cores: trains, exports, then runs the
                                                   # hf backend with /work/venvs/ref/bin/python (torch CPU)

Steps: (1) write the task data and a training corpus (deterministic), train a byte-level BPE tokenizer
(512 ids) on it; (2) train a 2-layer jaxdist model on the corpus (100 steps) and export it to
tests/fixtures/eval_model with `python -m jaxdist.convert to-hf`; (3) in the reference interpreter
(`--reference`), load the export with transformers and run lm-eval's `HFLM` (batch size 1, the same
max_length) on the three tasks with samples logged, writing tests/fixtures/eval_model/reference.json:
each task's metrics and each document's raw answers (log-likelihoods, is_greedy, generations).
The suite never imports torch or transformers; only this script's second half does.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TASKS = REPO / "tests" / "fixtures" / "eval_tasks"
MODEL = REPO / "tests" / "fixtures" / "eval_model"
REF_PYTHON = os.environ.get("REF_PYTHON", "/work/venvs/ref/bin/python")
SEQ_LEN = 64
VOCAB = 512
TASK_NAMES = ["jx_choice", "jx_ppl", "jx_gen"]

NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]
ANIMALS = ["cat", "dog", "cow", "hen", "fox", "owl", "pig", "bee"]
SOUNDS = {"cat": "meows", "dog": "barks", "cow": "moos", "hen": "clucks", "fox": "yips", "owl": "hoots"}
SOUNDS |= {"pig": "oinks", "bee": "buzzes"}
UNSEEN = {"horse": "neighs", "duck": "quacks", "lion": "roars", "frog": "croaks"}  # in tasks, never in training


def corpus(rng: random.Random) -> list[str]:
    lines = []
    for _ in range(600):
        k = rng.randrange(len(NUMBERS) - 3)
        a = rng.choice(ANIMALS)
        lines.append(f"after {NUMBERS[k]} comes {NUMBERS[k + 1]}. the {a} {SOUNDS[a]}.")
        lines.append(" ".join(NUMBERS[k : k + 4]) + f". a {a} is an animal.")
    return lines


def task_rows(rng: random.Random) -> dict[str, list[dict]]:
    choice, ppl, gen = [], [], []
    for i in range(16):
        sounds = SOUNDS | UNSEEN  # a model that learnt the corpus gets the seen animals right, guesses the rest
        a = [*ANIMALS, *UNSEEN][i % len(sounds)]
        wrong = [s for b, s in sounds.items() if b != a]
        rng.shuffle(wrong)
        options = [sounds[a], *wrong[:3]]
        rng.shuffle(options)
        choice.append({"animal": a, "choices": options, "label": options.index(sounds[a])})
        k = rng.randrange(len(NUMBERS) - 4)
        text = f"after {NUMBERS[k]} comes {NUMBERS[k + 1]}. the {a} {sounds[a]}. {NUMBERS[k + 2]}"
        ppl.append({"text": text if i % 4 else " ".join([text] * 8)})  # every 4th longer than the window
        gen.append({"number": NUMBERS[k], "answer": NUMBERS[k + 1]})
    return {"choice": choice, "ppl": ppl, "gen": gen}


def write_data() -> list[str]:
    rng = random.Random(0)
    for name, rows in task_rows(rng).items():
        (TASKS / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return corpus(rng)


def train_tokenizer(lines: list[str], out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer)
    tok.save(str(out))


def make_model() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        lines = write_data()
        (tmp / "corpus.txt").write_text("<|endoftext|>".join(lines))
        train_tokenizer(lines, tmp / "tokenizer.json")
        run = tmp / "run"
        model = dict(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128)
        overrides = [f"model.{k}={v}" for k, v in model.items()] + [
            f"model.seq_len={SEQ_LEN}",
            f"model.vocab_size={VOCAB}",
            "data.source=text",
            f"data.path={tmp / 'corpus.txt'}",
            f"data.tokenizer={tmp / 'tokenizer.json'}",
            "train.steps=100",
            "optim.warmup_steps=5",
            "train.eval_every=0",
            "checkpoint.every=100",
        ]
        py = sys.executable
        subprocess.run([py, "-m", "jaxdist.train", "--run-dir", str(run), *overrides], check=True, cwd=REPO)
        shutil.rmtree(MODEL, ignore_errors=True)
        subprocess.run([py, "-m", "jaxdist.convert", "to-hf", str(run), str(MODEL)], check=True, cwd=REPO)


def reference() -> None:
    """In the reference interpreter: lm-eval's hf backend on the export."""
    import lm_eval
    import torch
    import transformers
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(MODEL / "tokenizer.json"), eos_token="<|endoftext|>")
    lm = HFLM(pretrained=hf, tokenizer=tok, batch_size=1, max_length=SEQ_LEN, device="cpu")
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=TASK_NAMES,
        task_manager=TaskManager(include_path=str(TASKS)),
        log_samples=True,
        bootstrap_iters=0,
    )
    out = {
        "made_by": f"scripts/make_eval_fixture.py (lm-eval {lm_eval.__version__}, transformers {transformers.__version__}, "
        f"torch {torch.__version__})",
        "max_length": SEQ_LEN,
        "results": {t: results["results"][t] for t in TASK_NAMES},
        "samples": {
            t: [
                {"doc_id": s["doc_id"], "resps": s["resps"]}
                for s in sorted(results["samples"][t], key=lambda s: s["doc_id"])
            ]
            for t in TASK_NAMES
        },
    }
    (MODEL / "reference.json").write_text(json.dumps(out, indent=1, default=float) + "\n")
    print(json.dumps(out["results"], indent=1))


if __name__ == "__main__":
    if "--reference" in sys.argv:
        reference()
    else:
        make_model()
        subprocess.run([REF_PYTHON, __file__, "--reference"], check=True, cwd=REPO)
