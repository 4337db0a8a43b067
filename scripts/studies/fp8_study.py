"""FP8 against bf16 on the CPU: the same run (configs/tiny.yaml's corpus, a smaller model, two seeds) with
model.fp8=off / tensorwise / rowwise in bfloat16 compute, and the final held-out loss of each; prints a
markdown table with each FP8 run's relative gap to bf16 at the same seed, beside the gap between seeds.

    python scripts/studies/fp8_study.py                     # 3 modes x 2 seeds, ~15 min on 2 idle cores
    python scripts/studies/fp8_study.py --steps 120 --out /tmp/fp8s
    python scripts/studies/fp8_study.py --moe --modes off,rowwise --out /tmp/fp8moe   # the same with experts

The runs are ordinary `python -m jaxdist.train` runs (each its own --run-dir under --out); nothing here
is timed. The numbers say how much FP8's rounding moves a small model's loss, not its speed (XLA:CPU
upcasts FP8 operands: scripts/gpu_check.sh measures tokens/s on a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

MODEL = ["model.num_layers=2", "model.d_model=128", "model.num_heads=4", "model.num_kv_heads=2"]
MODEL += ["model.head_dim=32", "model.mlp_dim=512", "model.seq_len=128", "model.compute_dtype=bfloat16"]
# --moe: every layer's MLP replaced by 4 routed experts of 256 (top-2, dropless) and one shared expert
MOE = ["model.moe_experts=4", "model.moe_topk=2", "model.moe_mlp_dim=256", "model.moe_shared_experts=1"]


def final_eval(run: Path) -> float:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    if not evals:
        sys.exit(f"{run}: no eval_loss in metrics.jsonl")
    return float(evals[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--modes", default="off,tensorwise,rowwise")
    ap.add_argument("--out", default="runs/fp8_study")
    ap.add_argument("--moe", action="store_true", help="the model with experts (MOE) instead of dense MLPs")
    args = ap.parse_args()
    out = Path(args.out)
    env = {**os.environ, "TQDM_DISABLE": "1"}
    losses: dict[tuple[str, int], float] = {}
    for seed in map(int, args.seeds.split(",")):
        for mode in args.modes.split(","):
            run = out / f"{mode}-seed{seed}"
            model = MODEL + (MOE if args.moe else [])
            argv = [sys.executable, "-m", "jaxdist.train", "--run-dir", str(run), *model, f"model.fp8={mode}"]
            argv += [f"train.seed={seed}", f"train.steps={args.steps}", f"train.eval_every={args.steps}"]
            argv += ["checkpoint.every=0", "train.trackers=[]"]
            if not (run / "metrics.jsonl").is_file() or "eval_loss" not in (run / "metrics.jsonl").read_text():
                r = subprocess.run(argv, env=env, capture_output=True, text=True)
                if r.returncode != 0:
                    sys.exit(f"{' '.join(argv)} failed:\n{r.stderr[-2000:]}")
            losses[mode, seed] = final_eval(run)
            print(f"{mode} seed {seed}: eval loss {losses[mode, seed]:.4f}", flush=True)
    seeds = sorted({s for _, s in losses})
    print(f"\n{args.steps} steps, bf16 compute; gap = (FP8 - bf16) / bf16 at the same seed\n")
    print("| mode | " + " | ".join(f"seed {s} eval loss | gap" for s in seeds) + " |")
    print("| --- |" + " --- | --- |" * len(seeds))
    for mode in args.modes.split(","):
        cells = []
        for s in seeds:
            base = losses["off", s]
            cells += [f"{losses[mode, s]:.4f}", f"{(losses[mode, s] - base) / base:+.2%}"]
        print(f"| {mode} | " + " | ".join(cells) + " |")
    if len(seeds) > 1:
        a, b = (losses["off", s] for s in seeds[:2])
        print(f"\nseed-to-seed gap of bf16 itself: {(b - a) / a:+.2%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
