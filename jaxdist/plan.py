"""`python -m jaxdist.plan`: memory, communication and step time of a model on a cluster, before renting it.

    python -m jaxdist.plan --config configs/llama2-70b.yaml --devices 128 --hardware h100-80gb
    python -m jaxdist.plan --config configs/llama2-70b.yaml --devices 128 --mesh pp=4,tp=8,fsdp=4 --json
    python -m jaxdist.plan --config configs/llama3-8b.yaml --devices 64 train.global_batch=256 --plot s.png

Without --mesh every candidate family (DP, FSDP, HSDP, TPxFSDP, PPxFSDP, PPxTPxFSDP) is sized, with the
accumulation / pipeline micro-batches that make it fit fastest, and the best is recommended. The cost
model (jaxdist.planner) is checked against the compiled program in tests/test_plan.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from jaxdist import config
from jaxdist.errors import ArgumentParser, JaxdistError, command
from jaxdist.planner import hardware

if TYPE_CHECKING:
    from jaxdist.planner.estimate import Estimate

SCALING_DEVICES = [2**i for i in range(11)]  # 1 .. 1024


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


def run(args: argparse.Namespace) -> dict:
    # deferred: flax, jax, optax load on first use, not when python -m jaxdist.plan starts (--help stays instant)
    from jaxdist.distributed.mesh import parse_mesh
    from jaxdist.objectives import refusals
    from jaxdist.planner.estimate import candidates, estimate, recommend, scaling
    from jaxdist.planner.layout import Layout
    from jaxdist.planner.tables import STEP_TIME_NOTE, offload_options

    cfg = load_config(args.config, args.overrides)
    hw = hardware.get(args.hardware)
    if args.plot:
        check_plot_path(args.plot)
    if args.devices < 1:
        raise JaxdistError(f"--devices must be positive, got {args.devices}")
    if args.mesh:
        ests = [estimate(Layout(cfg, parse_mesh(args.mesh, args.devices), hw), "given")]
        best, reason = (ests[0], "the given mesh") if ests[0].memory.fits else (None, "the given mesh does not fit")
    else:
        ests = candidates(cfg, args.devices, hw)
        if not ests:
            refusals.check_sizes(cfg, {"fsdp": args.devices})  # a config train refuses on any mesh says why
            raise JaxdistError(
                f"no mesh of {args.devices} devices can split this model and batch; "
                f"change --devices or train.global_batch"
            )
        best, reason = recommend(ests)
    curves = {}
    command_line = train_command(args, cfg, best) if best else None
    offload = [] if best or args.mesh else offload_options(cfg, args.devices, hw)
    if not args.no_scaling:
        curves = scaling(cfg, hw, SCALING_DEVICES, cfg.train.global_batch / args.devices)
    return {
        "config": args.config or "configs/tiny.yaml",
        "hardware": hw.name,
        "devices": args.devices,
        "candidates": ests,
        "recommended": best,
        "reason": reason,
        "command": command_line,
        "step_time_note": STEP_TIME_NOTE,
        "scaling": curves,
        "offload": offload,
    }


def is_hf(spec: str) -> bool:
    """`--config hf:...`, or a folder holding config.json: a Hugging Face model."""
    folder = Path(spec).expanduser()
    return spec.startswith("hf:") or (folder.is_dir() and (folder / "config.json").is_file())


def load_config(spec: str | None, overrides: list[str]) -> config.Config:
    """--config: a YAML path or shipped name, or a Hugging Face model (`hf:DIR`, `hf:ORG/NAME[@REV]`, or a
    folder holding config.json) whose shape comes from its config.json (only that file is fetched)."""
    if spec and is_hf(spec):
        # deferred: huggingface_hub, jax load on first use, not when python -m jaxdist.plan starts
        from jaxdist.hf import hub, mapping

        hf_dir = hub.local_dir(spec.removeprefix("hf:"), patterns=["config.json"])
        return mapping.hf_config(None, overrides, hf_dir)
    return config.load(spec, overrides)


def _yaml_value(value) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10**9).removesuffix("\n...\n").strip()


def train_command(args: argparse.Namespace, cfg: config.Config, best: Estimate) -> str:
    """The `python -m jaxdist.train` line that runs `best`: the user's --config and overrides, the mesh, and
    every config key the planner chose differently (accumulation, pipeline micro-batches, rules)."""
    # deferred: jax loads on first use, not when python -m jaxdist.plan starts
    from jaxdist.distributed.mesh import format_mesh

    chosen, given = best.layout.cfg.to_dict(), cfg.to_dict()
    changed = {
        f"{section}.{key}": value
        for section, values in chosen.items()
        for key, value in values.items()
        if given[section][key] != value
    }
    kept = [o for o in args.overrides if o.split("=", 1)[0] not in changed]
    start = ["--config", args.config] if args.config else []
    if args.config and is_hf(args.config):  # train reads a Hugging Face model's shape through --restore hf:
        start = ["--restore", "hf:" + args.config.removeprefix("hf:")]
    words = ["python", "-m", "jaxdist.train", *start]
    words += ["--mesh", format_mesh(best.layout.mesh), *kept]
    return shlex.join(words + [f"{k}={_yaml_value(v)}" for k, v in changed.items()])


def check_plot_path(path: str) -> None:
    """Before planning: the plot's folder must exist and be writable (matplotlib would fail at the end)."""
    folder = Path(path).absolute().parent
    if Path(path).is_dir():
        raise JaxdistError(f"--plot {path} is a folder; give a file name such as {Path(path) / 'scaling.png'}")
    if not folder.is_dir():
        raise JaxdistError(f"--plot {path}: folder {folder} does not exist; create it or write the plot elsewhere")
    if not os.access(folder, os.W_OK):
        raise JaxdistError(f"--plot {path}: folder {folder} is not writable; choose another path")


@command
def main(argv=None) -> int:
    args = parse_args(argv)
    # deferred: flax, jax, optax load on first use, not when python -m jaxdist.plan starts (--help stays instant)
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
    if out["scaling"]:
        print()
        print(scaling_table(out["scaling"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
