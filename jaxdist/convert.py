"""`python -m jaxdist.convert`: Hugging Face checkpoints (the families in docs/model-families.md) in and out.

    python -m jaxdist.convert from-hf HF_DIR OUT_RUN_DIR [--mesh fsdp=8] [section.key=value ...]
    python -m jaxdist.convert to-hf RUN_DIR_OR_CHECKPOINT HF_DIR [--dtype bfloat16|float32] [--peft]

from-hf writes a run dir (config.yaml + checkpoints/0 with parameters only) that
`python -m jaxdist.train --config OUT_RUN_DIR/config.yaml --restore OUT_RUN_DIR checkpoint.params_only=true`
fine-tunes; `--restore hf:HF_DIR` on the train command does the same without the intermediate folder.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from jaxdist.cluster import launch
from jaxdist.distributed.platform import setup_platform
from jaxdist.errors import ArgumentParser, JaxdistError, command
from jaxdist.hf.hub import local_dir
from jaxdist.hf.mapping import hf_config


def parse_args(argv):
    argv = list(sys.argv[1:] if argv is None else argv)
    top = ArgumentParser(
        prog="python -m jaxdist.convert", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    top.add_argument("command", choices=("from-hf", "to-hf"))
    if not argv or argv[0] not in ("from-hf", "to-hf"):
        top.parse_args(argv[:1])  # prints usage / the choices, exits 2
    command, rest = argv[0], argv[1:]
    p = ArgumentParser(prog=f"python -m jaxdist.convert {command}")
    if command == "from-hf":
        p.description = (
            "Hugging Face model (a directory or a Hub id ORG/NAME[@REV]) -> jaxdist run dir (parameters only)"
        )
        p.add_argument("hf_dir")
        p.add_argument("out_run_dir")
        p.add_argument("--mesh", default=None, help="mesh to load onto, e.g. fsdp=4,tp=2 (default fsdp=-1)")
        p.add_argument("--config", default=None, help="YAML for the non-model sections (default configs/tiny.yaml)")
        p.add_argument("overrides", nargs="*", help="section.key=value written into the run's config.yaml")
    else:
        p.description = "jaxdist run dir or checkpoint -> Hugging Face model directory"
        p.add_argument("path")
        p.add_argument("hf_dir")
        p.add_argument(
            "--dtype",
            default="float32",
            choices=("float32", "bfloat16"),
            help="dtype of the written tensors (default float32, whatever the run computed in; bfloat16 halves the files)",
        )
        p.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors file (default 5 GB)")
        p.add_argument(
            "--peft",
            action="store_true",
            help="LoRA runs: write the adapter alone in PEFT's format (default: adapters merged into the weights)",
        )
        p.add_argument(
            "--allow-base-mismatch",
            action="store_true",
            help="--peft for an int8/nf4 (QLoRA) base: write the adapter although peft applies it to the original "
            "float weights, not the quantised base it was trained against (a warning states the difference)",
        )
    p.add_argument("--cpu-devices", type=int, default=8, help="simulated devices on CPU (default 8)")
    multi = p.add_argument_group("multi-process (default: from JAX_* variables, SLURM, OpenMPI or Kubernetes)")
    multi.add_argument("--coordinator", default=None, help="HOST:PORT of process 0's coordination service")
    multi.add_argument("--num-processes", type=int, default=None)
    multi.add_argument("--process-id", type=int, default=None)
    args = p.parse_intermixed_args(rest)
    args.command = command
    if command == "to-hf" and not (math.isfinite(args.max_shard_gb) and args.max_shard_gb > 0):
        raise JaxdistError(f"--max-shard-gb {args.max_shard_gb} must be a positive number of gigabytes (default 5)")
    return args


@command
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_platform(args.cpu_devices)
    launch.initialize(launch.detect(args.coordinator, args.num_processes, args.process_id))
    # deferred: flax, grain, jax, optax, orbax load after the platform set-up, not when python -m jaxdist.convert starts
    from jaxdist.hf.convert import from_hf, to_hf

    if args.command == "from-hf":
        hf_dir = local_dir(args.hf_dir)  # a directory, or a Hub id through the Hugging Face cache
        cfg = hf_config(args.config, args.overrides, hf_dir, args.mesh)
        from_hf(hf_dir, Path(args.out_run_dir), cfg)
    else:
        files = to_hf(
            Path(args.path),
            Path(args.hf_dir),
            args.dtype,
            int(args.max_shard_gb * 1e9),
            peft=args.peft,
            allow_base_mismatch=args.allow_base_mismatch,
        )
        print(f"exported {len(files)} file(s) to {args.hf_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
