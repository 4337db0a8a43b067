"""MoE studies on the CPU default corpus: expert-load balance with and without the aux loss, and
tiny-moe vs dense tiny eval loss at equal steps (one PNG of both curves).

    python scripts/studies/moe_study.py --out runs/moe_study            # trains the four runs, then reports
    python scripts/studies/moe_study.py --out runs/moe_study --report   # only reads the run folders again

Runs, one at a time, on --devices simulated CPU devices (default 8: dense over fsdp=8, MoE over ep=8,
the meshes of the issue's throughput target; equivalence to one device is what tests/test_moe.py
proves): dense `configs/tiny.yaml`; dense tiny with torchtitan's embedding init
(model.embed_init_std=1.0), the control that shows what that init alone does; `configs/tiny-moe.yaml`
(aux loss 0.01); tiny-moe with model.moe_aux_weight=0. `--runs` picks some of them. A run whose
metrics.jsonl has its summary line is not trained again. Children run under `nice -n 10`. Load
balance: `moe_load_cv` (std/mean of tokens per expert, per layer, averaged over layers) of the logged
steps up to --balance-step, mean of the last 3 logged.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

RUNS = {
    "dense": ("configs/tiny.yaml", []),
    "moe": ("configs/tiny-moe.yaml", []),
    # Only up to the balance step, on the 300-step schedule: the same trajectory as a full run there.
    "moe_noaux": ("configs/tiny-moe.yaml", ["model.moe_aux_weight=0", "train.steps=200", "optim.schedule_steps=300"]),
    "dense_emb1": ("configs/tiny.yaml", ["model.embed_init_std=1.0"]),
    "dense_scale16": ("configs/tiny.yaml", ["model.embed_scale=16"]),
}


def mesh_for(config: str, devices: int) -> str:
    """Dense runs split over fsdp, MoE runs over ep: the meshes the issue's targets name."""
    return f"ep={devices}" if "moe" in config else f"fsdp={devices}"


def train(out: Path, steps: int, eval_every: int, warmup: int, devices: int, names: list[str]) -> None:
    for name in names:
        config, extra = RUNS[name]
        if any(r.get("summary") for r in records(out / name)):
            continue
        cmd = [
            sys.executable,
            "-m",
            "jaxdist.train",
            "--config",
            config,
            "--cpu-devices",
            str(devices),
            "--mesh",
            mesh_for(config, devices),
            "--run-dir",
            str(out / name),
            f"train.steps={steps}",
            f"train.eval_every={eval_every}",
            f"optim.warmup_steps={warmup}",
            f"train.log_every={max(1, eval_every // 2)}",
            "checkpoint.every=0",
            *extra,
        ]
        with open(out / f"{name}.log", "w") as log:
            subprocess.run(["nice", "-n", "10", *cmd], stdout=log, stderr=subprocess.STDOUT, env=os.environ)


def records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def report(out: Path, balance_step: int) -> dict:
    runs = {name: [r for r in records(out / name) if not r.get("summary")] for name in RUNS}
    result = {}
    for name in ("moe", "moe_noaux"):
        logged = [r for r in runs[name] if "moe_load_cv" in r and r["step"] <= balance_step]
        last = logged[-3:]
        result[f"{name}_load_cv"] = sum(r["moe_load_cv"] for r in last) / len(last) if last else None
        result[f"{name}_load_cv_steps"] = [r["step"] for r in last]
    evals = {name: {r["step"]: r["eval_loss"] for r in rs if "eval_loss" in r} for name, rs in runs.items()}
    common = sorted(set(evals["dense"]) & set(evals["moe"]))
    result["eval_steps"] = common
    result["dense_eval_loss"] = [evals["dense"][s] for s in common]
    result["moe_eval_loss"] = [evals["moe"][s] for s in common]
    result["moe_noaux_eval_loss"] = [evals["moe_noaux"].get(s) for s in common]
    result["dense_emb1_eval_loss"] = [evals["dense_emb1"].get(s) for s in common]
    result["dense_scale16_eval_loss"] = [evals["dense_scale16"].get(s) for s in common]
    plot(runs, out / "moe_vs_dense.png")
    return result


def plot(runs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    labels = {
        "dense": "dense tiny (4.07M)",
        "dense_emb1": "dense tiny, embed_init_std=1",
        "moe": "tiny-moe E=8 K=2 (13.5M, 4.07M active)",
        "moe_noaux": "tiny-moe, no aux loss",
        "dense_scale16": "dense tiny, embed_scale=16",
    }
    for name, rs in runs.items():
        train = [(r["step"], r["loss"]) for r in rs if "loss" in r]
        evals = [(r["step"], r["eval_loss"]) for r in rs if "eval_loss" in r]
        if train:
            a.plot(*zip(*train), label=labels[name])
        if evals:
            b.plot(*zip(*evals), marker="o", label=labels[name])
    a.set(title="train loss", xlabel="step", ylabel="cross-entropy (nats/byte)")
    b.set(title="eval loss", xlabel="step")
    for ax in (a, b):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/moe_study")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--warmup", type=int, default=50, help="optim.warmup_steps")
    p.add_argument("--balance-step", type=int, default=200)
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices: dense fsdp=N, MoE ep=N")
    p.add_argument("--runs", default=",".join(RUNS), help="comma-separated run names to train, in order")
    p.add_argument("--report", action="store_true", help="only read existing run folders")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.report:
        train(out, args.steps, args.eval_every, args.warmup, args.devices, args.runs.split(","))
    print(json.dumps(report(out, args.balance_step)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
