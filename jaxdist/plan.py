"""`python -m jaxdist.plan`: memory, communication and step time of a model on a cluster, before renting it.

    python -m jaxdist.plan --config configs/llama2-70b.yaml --devices 128 --hardware h100-80gb
    python -m jaxdist.plan --config configs/llama2-70b.yaml --devices 128 --mesh pp=4,tp=8,fsdp=4 --json
    python -m jaxdist.plan --config configs/llama3-8b.yaml --devices 64 train.global_batch=256 --plot s.png

Without --mesh every candidate family (DP, FSDP, HSDP, TPxFSDP, PPxFSDP, PPxTPxFSDP) is sized, with the
accumulation / pipeline micro-batches that make it fit fastest (on pp meshes under every pipeline.schedule),
and the best is recommended. The cost
model (jaxdist.planner) is checked against the compiled program in tests/test_plan.py.
"""

from __future__ import annotations

import argparse
import json
import sys

from jaxdist.errors import ArgumentParser, command
from jaxdist.planner import hardware


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(
        prog="python -m jaxdist.plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--config",
        default=None,
        help="YAML path or shipped config name (default: tiny), or a Hugging Face model: hf:DIR, hf:ORG/NAME[@REV] "
        "or a model folder (its shape from config.json)",
    )
    p.add_argument("--devices", type=int, default=8, help="number of accelerators")
    p.add_argument("--hardware", default="h100-80gb", help=f"one of {', '.join(hardware.HARDWARE)}")
    p.add_argument(
        "--mesh",
        default=None,
        help="plan this mesh only (e.g. dp=2,fsdp=-1); uses the config's "
        "train.grad_accum_steps and pipeline settings as given",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="write the scaling curves to this file")
    p.add_argument("--no-scaling", action="store_true", help="skip the 1..1024-device scaling curves")
    p.add_argument("overrides", nargs="*", help="section.key=value config overrides")
    return p.parse_intermixed_args(argv)  # overrides may come before or after flags


@command
def main(argv=None) -> int:
    args = parse_args(argv)
    # The library, once, here: --help and a bad flag answer before it loads.
    # deferred: flax, jax, optax load on first use, not when python -m jaxdist.plan starts
    from jaxdist.planner.plans import run
    from jaxdist.planner.tables import STEP_TIME_NOTE, comm_table, memory_table, offload_lines, plot, scaling_table

    out = run(args)
    if args.plot and out["scaling"]:
        plot(out["scaling"], args.plot, f"{out['config']} on {out['hardware']}")
    if args.json:
        doc = dict(
            out,
            candidates=[e.as_dict() for e in out["candidates"]],
            recommended=out["recommended"].as_dict() if out["recommended"] else None,
            offload=[dict(o, estimate=o["estimate"].as_dict()) for o in out["offload"]],
        )
        print(json.dumps(doc))
        return 0
    print(f"{out['config']} on {args.devices} x {out['hardware']}\n")
    print(memory_table(out["candidates"]))
    shown = out["recommended"] or out["candidates"][0]
    print()
    print(comm_table(shown))
    print(f"\nrecommendation: {out['reason']}")
    for line in offload_lines(out["offload"]):
        print(line)
    if out["command"]:
        print(f"run it with:\n  {out['command']}")
    print(f"({STEP_TIME_NOTE})")
    if out["objective_note"]:
        print(f"({out['objective_note']})")
    if out["scaling"]:
        print()
        print(scaling_table(out["scaling"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
