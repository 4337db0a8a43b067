"""The DPO "it learns" recipe on CPU: a synthetic preference rule the base model does not follow, and the
held-out pairs' `eval_rewards/accuracies` curve (docs/post-training.md#it-learns).

    python scripts/studies/dpo_recipe.py [--out /tmp/dpo_recipe] [--steps 40]

The rule: to "Say the number N." the chosen answer is N's digits, the rejected one a refusal ("No."); 400
pairs (N in 0..399, conversational, rendered with the tiny model's chat template), 10% held out by hash.
The model is the committed tiny random Qwen-style model (tests/fixtures/chat/qwen), so its preference at
step 0 is chance: rewards are 0 at the start (reference = policy). DPO (beta 0.1, lr 1e-3, batch 16) on
fsdp=4,tp=2 (8 simulated CPU devices); prints the eval records of metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "tests" / "fixtures" / "chat" / "qwen"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/dpo_recipe")
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    pairs = [
        {
            "prompt": [{"role": "user", "content": f"Say the number {n}."}],
            "chosen": [{"role": "assistant", "content": f"{n}"}],
            "rejected": [{"role": "assistant", "content": "No."}],
        }
        for n in range(400)
    ]
    (out / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    py = sys.executable
    prep = [py, "-m", "jaxdist.data", "prepare", "--preference", "--tokenizer", str(MODEL), "--seq-len", "64"]
    subprocess.run([*prep, "--val-fraction", "0.1", "--out", str(out / "prefs"), str(out / "pairs.jsonl")], check=True)
    train = [py, "-m", "jaxdist.train", f"--restore=hf:{MODEL}", "objective.method=dpo", "objective.beta=0.1"]
    train += ["data.source=tokens", f"data.path={out / 'prefs'}", "model.seq_len=64", f"train.steps={args.steps}"]
    train += ["train.global_batch=16", "train.eval_every=10", "train.eval_batches=2", "optim.lr=1e-3"]
    train += ["optim.warmup_steps=4", "checkpoint.every=0", "--mesh", "fsdp=4,tp=2", "--run-dir", str(out / "run")]
    subprocess.run(train, check=True)
    print("step  loss    eval_loss  eval_rewards/accuracies  eval_rewards/margins")
    for line in (out / "run" / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "eval_loss" in r and "step" in r:
            print(
                f"{r['step']:>4}  {r['loss']:.4f}  {r['eval_loss']:.4f}     "
                f"{r['eval_rewards/accuracies']:.3f}                    {r['eval_rewards/margins']:.4f}"
            )


if __name__ == "__main__":
    main()
