"""What `python -m jaxdist.plan` computes from its arguments: the config (a YAML file, a shipped name or a
Hugging Face model's config.json), every candidate mesh sized (or the given one), the recommendation, the
`python -m jaxdist.train` line that runs it, the offload options when nothing fits, the scaling curves.
The command (jaxdist/plan.py) parses the arguments and prints the tables."""

from __future__ import annotations

import argparse
import os
import shlex
from pathlib import Path

import yaml

from jaxdist import config
from jaxdist.distributed.mesh import format_mesh, parse_mesh
from jaxdist.errors import JaxdistError
from jaxdist.hf import hub, mapping
from jaxdist.models import registry
from jaxdist.objectives import refusals
from jaxdist.objectives import registry as objectives
from jaxdist.planner import hardware
from jaxdist.planner.candidates import candidates
from jaxdist.planner.estimate import Estimate, estimate
from jaxdist.planner.layout import Layout
from jaxdist.planner.recommend import recommend, scaling
from jaxdist.planner.tables import STEP_TIME_NOTE, offload_options

SCALING_DEVICES = [2**i for i in range(11)]  # 1 .. 1024


def run(args: argparse.Namespace) -> dict:
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
        "objective_note": objectives.plan_note(cfg),  # what the figures leave out for a non-lm objective
        "model_note": registry.of(cfg.model).planner_gap or None,  # what they leave out for this architecture
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
        hf_dir = hub.local_dir(spec.removeprefix("hf:"), patterns=["config.json"])
        return mapping.hf_config(None, overrides, hf_dir)
    return config.load(spec, overrides)


def _yaml_value(value) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10**9).removesuffix("\n...\n").strip()


def train_command(args: argparse.Namespace, cfg: config.Config, best: Estimate) -> str:
    """The `python -m jaxdist.train` line that runs `best`: the user's --config and overrides, the mesh, and
    every config key the planner chose differently (accumulation, pipeline micro-batches, rules)."""
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
