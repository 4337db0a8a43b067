"""Pictures of runs, from their run dirs (metrics.jsonl + config.yaml); no JAX needed.

    python -m jaxdist.plot runs/a                          # runs/a/loss.png (what every run writes at its end)
    python -m jaxdist.plot runs/a runs/b --metric eval_loss --out lr.png   # overlay, labelled by config
    python -m jaxdist.plot runs/a --metric eval/hellaswag/acc_norm         # a task metric (train.eval_tasks)

`loss_png` draws one run: train loss (raw and smoothed) and eval loss against steps (bottom axis) and
tokens (top axis), the learning rate on a second y axis, skipped (non-finite) steps as red marks.
Several runs are overlaid on one metric and labelled by the config keys in which they differ. A resumed
run's metrics.jsonl holds all its segments (the resume drops the interrupted attempt's extra records),
and records are joined by step, the later one winning.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jaxdist.errors import ArgumentParser, command
from jaxdist.observe.plots import METRICS, check_out, loss_png, overlay


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(
        prog="python -m jaxdist.plot", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("run_dirs", nargs="+", type=Path, help="run folders (each with metrics.jsonl)")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="PNG to write (default: RUN_DIR/loss.png for one run's loss, else METRIC.png here)",
    )
    p.add_argument(
        "--metric",
        default="loss",
        help=f"what to overlay: {', '.join(METRICS)}, or a task metric eval/TASK/METRIC (train.eval_tasks); default loss",
    )
    args = p.parse_args(argv)
    if args.metric not in METRICS and not args.metric.startswith("eval/"):
        p.error(f"argument --metric: {args.metric!r} is not one of {', '.join(METRICS)} nor eval/TASK/METRIC")
    return args


@command
def main(argv=None) -> int:
    args = parse_args(argv)
    if args.out is not None:
        check_out(args.out)  # before reading or drawing anything
    if len(args.run_dirs) == 1 and args.metric == "loss":
        out = loss_png(args.run_dirs[0], args.out)
    else:
        out = args.out or Path(f"{args.metric.replace('/', '_')}.png")
        labels = overlay(args.run_dirs, args.metric, out)
        print("runs: " + "; ".join(labels))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
