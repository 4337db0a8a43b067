"""Tokens/s of this checkout's train step against another checkout's, in one run, interleaved.

    python scripts/bench/before_after.py --source /path/to/old/worktree --rounds 3 -- --mesh fsdp=8 \
        model.compute_dtype=bfloat16 model.remat=full

Each round runs `python -m jaxdist.bench ARGS` once with `--source`'s jaxdist (a child process with that
checkout first on its path) and once with this one's, alternating which goes first, so load on a shared
machine falls on both alike. Prints one JSON line per run and a last line with the median tokens/s of
each side and their ratio (after / before), and the best run's of each and their ratio (the least
disturbed by other work on a shared machine). ARGS after `--` go to the bench unchanged (config, mesh,
steps, overrides). Each bench run compiles its step: tens of seconds a run for `tiny` on 8 CPU devices.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def run(checkout: str, args: list[str]) -> dict:
    """One bench run with `checkout`'s jaxdist: its (last) JSON line."""
    env = {**os.environ, "PYTHONPATH": checkout}
    cmd = [sys.executable, "-m", "jaxdist.bench", *args]
    done = subprocess.run(cmd, env=env, cwd=checkout, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        raise SystemExit(f"bench in {checkout} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", required=True, help="the 'before' checkout (its jaxdist is benched as before)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("bench_args", nargs="*", help="arguments for python -m jaxdist.bench (after --)")
    args = p.parse_args(argv)
    sides = {"before": os.path.abspath(args.source), "after": HERE}
    speeds: dict[str, list[float]] = {"before": [], "after": []}
    for i in range(args.rounds):
        for side in ("before", "after") if i % 2 == 0 else ("after", "before"):
            r = run(sides[side], args.bench_args)
            speeds[side].append(r["tokens_per_sec"])
            print(json.dumps({"round": i, "side": side, "tokens_per_sec": r["tokens_per_sec"]}), flush=True)
    before, after = (statistics.median(speeds[s]) for s in ("before", "after"))
    best = {s: max(speeds[s]) for s in speeds}
    summary = {"before_tokens_per_sec": before, "after_tokens_per_sec": after, "ratio": after / before}
    summary["best_ratio"] = best["after"] / best["before"]
    print(json.dumps({**summary, "runs": speeds, "bench_args": args.bench_args}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
