"""Issue 18's throughput target in one process: dense `tiny` at fsdp=8 against `tiny-moe` (same active
parameters) at ep=8, dropless and capacity dispatch, each timed by `jaxdist.bench.measure`.

    nice -n 10 python scripts/moe_bench.py [--steps 10] [--rounds 2]

Rounds interleave the three programs (dense, dropless, capacity, dense, ...) so that a change in the
shared machine's load hits all of them; each line is one measurement, the summary takes each one's
best round. Ratios are tokens/s over dense's.
"""

from __future__ import annotations

import argparse
import json

RUNS = {
    "dense tiny fsdp=8": (None, "fsdp=8", []),
    "tiny-moe ep=8 dropless": ("configs/tiny-moe.yaml", "ep=8", ["model.moe_dispatch=dropless"]),
    "tiny-moe ep=8 capacity": ("configs/tiny-moe.yaml", "ep=8", ["model.moe_dispatch=capacity"]),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    from jaxdist import bench, config
    from jaxdist.train import setup_platform

    setup_platform(8)
    best = {}
    for r in range(args.rounds):
        for name, (path, mesh, overrides) in RUNS.items():
            rec = bench.measure(config.load(path, overrides), mesh, args.warmup, args.steps)
            print(json.dumps({"run": name, "round": r, **{k: rec[k] for k in ("tokens_per_sec", "loss", "mfu")}}))
            best[name] = max(best.get(name, 0.0), rec["tokens_per_sec"])
    dense = best["dense tiny fsdp=8"]
    print(json.dumps({name: {"tokens_per_sec": v, "ratio_to_dense": v / dense} for name, v in best.items()}))


if __name__ == "__main__":
    main()
