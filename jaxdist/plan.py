"""`python -m jaxdist.plan`: memory, communication and step time of a model on a cluster, before renting it.

    python -m jaxdist.plan --config configs/llama2-70b.yaml --devices 128 --hardware h100-80gb
    python -m jaxdist.plan --config configs/llama2-70b.yaml --devices 128 --mesh pp=4,tp=8,fsdp=4 --json
    python -m jaxdist.plan --config configs/llama3-8b.yaml --devices 64 train.global_batch=256 --plot s.png
    python -m jaxdist.plan --calibrate here.json --mesh-search-steps 3   # measure this machine, then
    python -m jaxdist.plan --search --hardware here.json                 # plan with what was measured

Without --mesh every candidate family (DP, FSDP, HSDP, TPxFSDP, PPxFSDP, PPxTPxFSDP) is sized, with the
accumulation / pipeline micro-batches that make it fit fastest (on pp meshes under every pipeline.schedule),
and the best is recommended. The cost
model (jaxdist.planner) is checked against the compiled program in tests/test_plan.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from pathlib import Path

from jaxdist.distributed.platform import setup_platform
from jaxdist.errors import ArgumentParser, JaxdistError, command
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
    p.add_argument(
        "--hardware",
        default=None,
        help=f"one of {', '.join(hardware.HARDWARE)}, or a FILE.json that plan --calibrate wrote (default h100-80gb; "
        "with --search or --calibrate the devices present)",
    )
    p.add_argument(
        "--mesh",
        default=None,
        help="plan this mesh only (e.g. dp=2,fsdp=-1); uses the config's "
        "train.grad_accum_steps and pipeline settings as given",
    )
    p.add_argument(
        "--search",
        action="store_true",
        help="search every layout of the devices present (mesh, pipeline schedule and micro-batches, remat, "
        "accumulation): rank by the planner, compile the top --top-k, drop what the compiler says does not fit, "
        "time --mesh-search-steps steps of the best few, print the table and the choice",
    )
    p.add_argument(
        "--calibrate",
        default=None,
        metavar="FILE.json",
        help="measure the devices present (matmul FLOP/s at the config's shapes, all-gather latency and bandwidth) "
        "and write them as a hardware entry that --hardware FILE.json reads; with --mesh-search-steps N also time "
        "the search's top --top-k layouts and print the planner's error before and after",
    )
    p.add_argument("--top-k", type=int, default=3, help="with --search: layouts compiled ahead of time")
    p.add_argument(
        "--mesh-search-steps", type=int, default=0, help="with --search: steps timed per surviving layout (0: none)"
    )
    p.add_argument(
        "--mesh-search-budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="with --search (or --calibrate and --mesh-search-steps): stop compiling and timing once this many "
        "seconds are spent (the first candidate is always compiled); the candidates not reached are listed",
    )
    p.add_argument(
        "--memory-budget",
        default=None,
        metavar="BYTES",
        help="usable memory per device, e.g. 300MB or 2GiB, instead of the hardware's (a limit to test with)",
    )
    p.add_argument("--cpu-devices", type=int, default=8, help="with --search: simulated devices on CPU")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="write the scaling curves to this file")
    p.add_argument("--no-scaling", action="store_true", help="skip the 1..1024-device scaling curves")
    p.add_argument("overrides", nargs="*", help="section.key=value config overrides")
    args = p.parse_intermixed_args(argv)  # overrides may come before or after flags
    if not (args.search or args.calibrate):  # these default to the devices present; a plan to h100-80gb
        args.hardware = args.hardware or "h100-80gb"
    return args


@command
def main(argv=None) -> int:
    args = parse_args(argv)
    if args.calibrate:
        return calibrate(args)
    if args.search:
        return search(args)
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
    for note in (out["objective_note"], out["model_note"]):
        if note:
            print(f"({note})")
    if out["scaling"]:
        print()
        print(scaling_table(out["scaling"]))
    return 0


def search(args: argparse.Namespace) -> int:
    """`--search`: the layouts of the devices present, compiled and (optionally) timed; the table and choice."""
    if args.mesh:
        raise JaxdistError("--search chooses the mesh; drop --mesh (or drop --search to plan that mesh)")
    budget = hardware.parse_bytes(args.memory_budget) if args.memory_budget else None
    setup_platform(args.cpu_devices)
    # deferred: flax, jax, optax load on first use, not when python -m jaxdist.plan starts
    import jax

    from jaxdist.analysis import mesh_auto, mesh_search
    from jaxdist.observe import report
    from jaxdist.planner import search as searching
    from jaxdist.planner.plans import load_config, train_command

    cfg = load_config(args.config, args.overrides)
    hw = hardware.get(args.hardware) if args.hardware else report.hardware_for(jax.devices()[0])
    if hw is None:
        raise JaxdistError(f"no hardware entry for {jax.devices()[0].device_kind}; name one with --hardware")
    hw = searching.with_budget(hw, budget)
    say = functools.partial(print, file=sys.stderr, flush=True)
    hw = mesh_auto.ranking_entry(cfg, hw, args.mesh_search_steps, say)
    out = mesh_search.run(cfg, hw, top_k=args.top_k, steps=args.mesh_search_steps, budget_s=args.mesh_search_budget)
    if args.json:
        print(json.dumps(dict(out.as_dict(), command=train_command(args, cfg, out.chosen.est))))
        return 0
    print(f"{args.config or 'tiny'} on {len(jax.devices())} x {hw.name}: {out.summary()}\n")
    print(searching.table(out.rows, out.budget_bytes))
    print(f"\n{out.reason}")
    print(f"run it with:\n  {train_command(args, cfg, out.chosen.est)}")
    return 0


def calibrate(args: argparse.Namespace) -> int:
    """`--calibrate FILE.json`: the devices present measured, written as a hardware entry; with
    --mesh-search-steps, the search's top layouts timed and the planner's error before and after."""
    if args.mesh or args.search:
        raise JaxdistError("--calibrate measures the devices present; drop --mesh / --search (search later with "
                           "--hardware FILE.json)")  # fmt: skip
    path = Path(args.calibrate)
    if path.suffix != ".json" or not path.parent.is_dir():
        raise JaxdistError(f"--calibrate {path}: give a FILE.json in an existing folder")
    if args.mesh_search_budget is not None and args.mesh_search_budget <= 0:  # before anything is measured
        raise JaxdistError(f"--mesh-search-budget {args.mesh_search_budget:g}: give a positive number of seconds")
    budget = hardware.parse_bytes(args.memory_budget) if args.memory_budget else None
    setup_platform(args.cpu_devices)
    # deferred: flax, jax, optax load on first use, not when python -m jaxdist.plan starts
    import jax

    from jaxdist.analysis import calibrate as calibration
    from jaxdist.analysis import mesh_search
    from jaxdist.observe import report
    from jaxdist.planner import search as searching
    from jaxdist.planner.plans import load_config

    cfg = load_config(args.config, args.overrides)
    base = hardware.get(args.hardware) if args.hardware else report.hardware_for(jax.devices()[0])
    if base is None:
        raise JaxdistError(
            f"no hardware entry for {jax.devices()[0].device_kind} to start from; name one with --hardware"
        )
    measured = calibration.measure(cfg, jax.devices(), attention=not base.flash_attention)
    hw = calibration.entry(base, measured, path.stem)
    hardware.save(hw, path)
    doc: dict = dict(hardware=str(path), entry=dataclasses.asdict(hw), lines=measured.lines())
    if args.mesh_search_steps:
        out = mesh_search.run(
            cfg,
            searching.with_budget(hw, budget),
            top_k=args.top_k,
            steps=args.mesh_search_steps,
            timed=args.top_k,
            budget_s=args.mesh_search_budget,
        )
        found = calibration.compare(out.rows, base)
        doc.update(
            compared=[
                dict(layout=n, measured_s=m, before_s=b, after_s=a)
                for n, m, b, a in zip(found.names, found.measured, found.before, found.after)
            ],
            error_before=found.error(found.before),
            error_after=found.error(found.after),
            correlation_before=found.correlation(found.before),
            correlation_after=found.correlation(found.after),
        )
        doc["lines"] += ["", *found.lines(f"{base.name} entry", "calibrated")]
    if args.json:
        print(json.dumps(doc))
        return 0
    print(
        f"{len(jax.devices())} x {jax.devices()[0].device_kind}, measured from the {base.name} entry; written to {path}"
    )
    for line in doc["lines"]:
        print(line)
    print(f"plan with it: python -m jaxdist.plan --search --hardware {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
