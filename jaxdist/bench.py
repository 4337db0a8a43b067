"""`python -m jaxdist.bench`: throughput, memory and communication of the compiled train step.

    python -m jaxdist.bench --mesh fsdp=1 --mesh fsdp=8 --mesh dp=8     # one JSON line per mesh
    python -m jaxdist.bench --compile-only --config llama3-8b --mesh fsdp=8 --hardware h100-80gb  # does it fit?
    python -m jaxdist.bench --mesh auto --mesh-search-steps 2      # the layout train --mesh auto would choose

Each mesh runs warm-up steps, then timed steps (each synchronised), on synthetic tokens of the
configured shape. Memory and collectives come from the compiled program, so they are exact and
repeatable; compare speeds only as ratios measured in one run (machines are shared and noisy).
A mesh using fewer devices than exist runs on the first ones (e.g. fsdp=1 is one device).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

from jaxdist import config
from jaxdist.distributed import xla_flags
from jaxdist.distributed.platform import setup_platform
from jaxdist.errors import ArgumentParser, JaxdistError, command
from jaxdist.planner import hardware as hardware_mod


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(
        prog="python -m jaxdist.bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", default=None, help="YAML path or shipped config name (default: tiny)")
    p.add_argument("--mesh", action="append", default=None, help="mesh to measure; repeat for several")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after compilation")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--cpu-devices", type=int, default=8, help="simulated devices on CPU (default 8)")
    p.add_argument("--table", action="store_true", help="after the JSON lines, print them as a table with notes")
    p.add_argument(
        "--compile-only",
        action="store_true",
        help="compile with abstract inputs (nothing allocated, nothing run): memory and "
        "collectives of a real config without its hardware; no timings",
    )
    p.add_argument(
        "--hardware",
        default=None,
        help="with --compile-only: the device to judge against (e.g. h100-80gb; see python -m jaxdist.plan "
        "--help): a verdict, fits or not, with the planner's and the compiler's bytes per device",
    )
    p.add_argument(
        "--mesh-search-steps",
        type=int,
        default=0,
        help="with --mesh auto: steps timed per candidate by the search (0: the planner decides)",
    )
    p.add_argument(
        "--memory-budget", default=None, metavar="BYTES", help="with --mesh auto: usable memory per device, e.g. 300MB"
    )
    p.add_argument("overrides", nargs="*", help="section.key=value config overrides")
    return p.parse_intermixed_args(argv)  # overrides may come before or after flags


CPU_COLLECTIVE_TIMEOUT_S = 1800


def _patient_cpu_collectives() -> None:
    """XLA:CPU aborts the process when a collective's rendezvous waits over 40 s (its default), which a
    long-sequence step on a loaded machine reaches; bench raises it before the backend starts (a value
    already in XLA_FLAGS wins)."""

    flag = {"xla_cpu_collective_call_terminate_timeout_seconds": str(CPU_COLLECTIVE_TIMEOUT_S)}
    os.environ["XLA_FLAGS"] = xla_flags.merge(os.environ.get("XLA_FLAGS", ""), flag)


@command
def main(argv=None) -> int:
    args = parse_args(argv)

    if args.steps < 1 or args.warmup < 0:
        raise JaxdistError(
            f"--steps {args.steps} / --warmup {args.warmup}: bench times at least one step "
            "(--steps >= 1) after --warmup >= 0 untimed ones"
        )
    if args.hardware and not args.compile_only:
        raise JaxdistError("--hardware judges a --compile-only compile against a device; add --compile-only")
    meshes = args.mesh or [config.load(args.config, args.overrides).mesh.shape]
    if (args.mesh_search_steps or args.memory_budget) and "auto" not in meshes:
        raise JaxdistError("--mesh-search-steps and --memory-budget belong to --mesh auto; add it or drop them")
    if "auto" in meshes and args.compile_only:
        raise JaxdistError("--mesh auto measures the layout it chooses; drop --compile-only (or name the mesh)")
    budget = hardware_mod.parse_bytes(args.memory_budget) if args.memory_budget else None
    cfg = config.load(args.config, args.overrides)
    _patient_cpu_collectives()
    setup_platform(args.cpu_devices)
    # The library, once, here: --help and a bad flag answer before it loads.
    # deferred: flax, grain, jax, optax load on first use, not when python -m jaxdist.bench starts
    from jaxdist.analysis.bench import compile_only, measure, verdict_line
    from jaxdist.analysis.bench_table import table
    from jaxdist.planner import hardware

    if args.hardware:
        hardware.get(args.hardware)  # an unknown name fails before compiling
    records = []
    for mesh_text in meshes:
        if mesh_text == "auto":
            record = measure_auto(cfg, args, budget)
        elif args.compile_only:
            record = compile_only(cfg, mesh_text, args.hardware)
        else:
            record = measure(cfg, mesh_text, args.warmup, args.steps)
        records.append(record)
        print(json.dumps(record), flush=True)
        if (line := verdict_line(record)) is not None:
            print(line, file=sys.stderr, flush=True)
    if args.table:
        print("\n" + table(records))
    return 0


def measure_auto(cfg, args: argparse.Namespace, budget: float | None) -> dict:
    """`--mesh auto`: the layout train --mesh auto would choose (mesh_search.run on the devices present),
    then measured as any named mesh; the record names the choice (`auto`) and why."""
    # deferred: the search compiles candidate layouts, after the platform set-up
    from jaxdist.analysis import mesh_auto, mesh_search
    from jaxdist.analysis.bench import measure

    say = functools.partial(print, file=sys.stderr, flush=True)
    hw = mesh_auto.ranking_entry(cfg, mesh_auto.hardware_here(budget), args.mesh_search_steps, say)
    result = mesh_search.run(cfg, hw, steps=args.mesh_search_steps)
    print(f"--mesh auto: {result.summary()}\n--mesh auto: {result.reason}", file=sys.stderr, flush=True)
    chosen = result.cfg
    record = measure(chosen, chosen.mesh.shape, args.warmup, args.steps)
    return dict(record, auto=dict(chosen=result.chosen.name, reason=result.reason, search=result.summary()))


if __name__ == "__main__":
    sys.exit(main())
