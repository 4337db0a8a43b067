"""`python -m jaxdist.train`: the command line (the run itself is `jaxdist.run`, `jaxdist.training.loop.run`).

python -m jaxdist.train                                  # configs/tiny.yaml on 8 simulated CPU devices
python -m jaxdist.train --mesh dp=2,fsdp=4 optim.lr=1e-3 train.steps=100
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from jaxdist import config
from jaxdist.cluster import elastic, peers, supervisor
from jaxdist.cluster import launch as launch_mod
from jaxdist.distributed.platform import enable_compilation_cache, setup_platform
from jaxdist.errors import ArgumentParser, JaxdistError
from jaxdist.hf import hub, mapping
from jaxdist.observe import quiet, trackers
from jaxdist.planner import hardware
from jaxdist.training.signals import StopSignal


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(
        prog="python -m jaxdist.train",
        description=__doc__,
        epilog=config.keys_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--config",
        default=None,
        help=f"YAML path or shipped config name ({', '.join(config.shipped_configs())}; default: tiny)",
    )
    p.add_argument(
        "--print-config", action="store_true", help="print the resolved config (mesh sizes resolved) as YAML and exit"
    )
    p.add_argument(
        "--mesh",
        default=None,
        help="mesh axes, e.g. dp=2,fsdp=4 (default: all devices on fsdp); auto: search the layouts (mesh, remat, "
        "accumulation, pipeline) as plan --search does and record the choice, which a resume keeps",
    )
    p.add_argument(
        "--mesh-search-steps", type=int, default=0, help="with --mesh auto: steps timed per candidate (0: planner)"
    )
    p.add_argument(
        "--mesh-search-budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="with --mesh auto: stop compiling and timing candidates once this many seconds are spent (the "
        "first is always compiled); the candidates not reached are listed",
    )
    p.add_argument(
        "--memory-budget",
        default=None,
        metavar="BYTES",
        help="with --mesh auto: usable memory per device, e.g. 300MB, instead of the hardware's",
    )
    p.add_argument(
        "--hardware",
        default=None,
        help="with --mesh auto: the planner's hardware entry, a name or a FILE.json that python -m jaxdist.plan "
        "--calibrate wrote (default: the entry of the devices present)",
    )
    p.add_argument("--dcn-mesh", default=None, help="axes spanning hosts, e.g. dp=2 (multi-host)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (train.steps)")
    p.add_argument(
        "--run-dir",
        default=None,
        help="output folder (default: runs/<config>-<hash of the config without train.steps, checkpoint, logging "
        "and mesh keys>, so the same command resumes the same run and --steps N extends it)",
    )
    p.add_argument(
        "--restore",
        default=None,
        metavar="PATH",
        help="start from another run's checkpoint (its run dir or checkpoints/STEP); with "
        "checkpoint.params_only=true parameters only. A run dir with its own checkpoints resumes them. "
        "hf:DIR or hf:ORG/NAME[@REV] (a Hub id, through the Hugging Face cache) fine-tunes a Hugging Face "
        "model of a family in docs/model-families.md (its shape from config.json)",
    )
    p.add_argument(
        "--extend-context",
        action="store_true",
        help="with --restore hf:, allow a model.seq_len beyond the model's max_position_embeddings",
    )
    p.add_argument("--cpu-devices", type=int, default=8, help="simulated devices when running on CPU (default 8)")
    p.add_argument(
        "--allow-config-change",
        default="",
        metavar="KEY,...",
        help="resume although these config keys differ from the checkpoint's, e.g. optim.lr,data.path "
        "(train.steps, checkpoint.*, logging and mesh keys may always change)",
    )
    multi = p.add_argument_group("multi-process (default: from JAX_* variables, SLURM, OpenMPI or Kubernetes)")
    multi.add_argument("--coordinator", default=None, help="HOST:PORT of process 0's coordination service")
    multi.add_argument("--num-processes", type=int, default=None, help="processes in the run")
    multi.add_argument("--process-id", type=int, default=None, help="this process's index, 0..N-1")
    multi.add_argument(
        "--elastic",
        default=None,
        metavar="MIN:MAX",
        help="when a process dies or freezes, continue on the survivors (MIN..MAX processes): the training "
        "processes restart on a re-planned mesh from the latest checkpoint (docs/multi-host.md)",
    )
    multi.add_argument(
        "--init-timeout", type=int, default=300, help="seconds to wait for the coordinator and every peer (default 300)"
    )
    multi.add_argument(
        "--heartbeat-timeout",
        type=int,
        default=30,
        help="seconds of silence after which a process counts as dead and the others stop (default 30)",
    )
    p.add_argument("overrides", nargs="*", help="section.key=value, e.g. optim.lr=1e-3 train.global_batch=16")
    args = p.parse_intermixed_args(argv)  # overrides may come before or after flags
    if args.elastic is not None:
        elastic.parse_span(args.elastic)  # a bad span is refused in one line
    for flag, value in (("--init-timeout", args.init_timeout), ("--heartbeat-timeout", args.heartbeat_timeout)):
        if value <= 0:
            raise JaxdistError(f"{flag} {value} must be a positive number of seconds")
    return args


def resolve_config(args: argparse.Namespace):
    """The config file <- overrides <- the shorthand flags (a flag and an override of one key: an error)."""
    overrides = list(args.overrides)
    for flag, key, value in (("--mesh", "mesh.shape", args.mesh), ("--dcn-mesh", "mesh.dcn", args.dcn_mesh)) + (
        ("--steps", "train.steps", args.steps),
    ):
        if value is None:
            continue
        given = [o for o in overrides if o.split("=", 1)[0].strip() == key]
        if given:  # the flag would silently hide the override (and a bad value in it)
            raise JaxdistError(f"{key} is given twice ({flag} {value} and {given[0]}); give one of them")
        overrides.append(f"{key}={value}")
    return config.load(args.config, overrides)


def eval_tasks(cfg):
    """train.eval_tasks' harness (`jaxdist.evaluation.in_training.task_evaluator`), None without tasks."""
    if not cfg.train.eval_tasks:
        return None
    # deferred: lm-eval is an optional extra, loaded only when train.eval_tasks names tasks
    from jaxdist.evaluation import in_training

    return in_training.task_evaluator


def main(argv: list[str] | None = None) -> int:
    supervised = supervisor.supervise(sys.argv[1:] if argv is None else list(argv))  # multi-process: names a dead peer
    if supervised is not None:
        return supervised
    quiet.libraries()
    with StopSignal() as stopper:
        return _main(argv, stopper)


def _search_flags(args: argparse.Namespace, cfg) -> tuple[bool, float | None]:
    """(--mesh auto?, --memory-budget in bytes): the flags that belong to the layout search, checked before
    anything starts."""
    auto = cfg.mesh.shape.strip() == "auto"
    budget = hardware.parse_bytes(args.memory_budget) if args.memory_budget else None
    if (args.mesh_search_steps or budget or args.hardware or args.mesh_search_budget is not None) and not auto:
        raise JaxdistError(
            "--mesh-search-steps, --mesh-search-budget, --memory-budget and --hardware belong to --mesh auto; "
            "add it or drop them"
        )
    if args.mesh_search_budget is not None and args.mesh_search_budget <= 0:
        raise JaxdistError(f"--mesh-search-budget {args.mesh_search_budget:g}: give a positive number of seconds")
    if args.hardware:
        hardware.get(args.hardware)  # an unknown name or a bad file fails before anything starts
    if auto and args.print_config:
        raise JaxdistError(
            "--mesh auto is decided when training starts; drop --print-config, or see the choice with "
            "python -m jaxdist.plan --search"
        )
    return auto, budget


def _main(argv: list[str] | None, stopper) -> int:
    try:
        args = parse_args(argv)
        cfg = resolve_config(args)
        auto, budget = _search_flags(args, cfg)
        typed_restore = args.restore  # names the default run dir: a new Hub revision does not move it
        if args.restore and args.restore.startswith("hf:"):  # the model shape comes from config.json
            args.restore = f"hf:{hub.local_dir(args.restore[3:])}"  # a Hub id -> its cached snapshot
            cfg = mapping.apply(cfg, Path(args.restore[3:]), mapping.model_overrides(args.overrides))
            if not args.extend_context:
                mapping.check_positions(cfg.model.seq_len, Path(args.restore[3:]))
        if not args.print_config:
            trackers.check_installed(cfg.train.trackers)  # before JAX starts: a missing extra is a quick error
            if cfg.train.eval_tasks and importlib.util.find_spec("lm_eval") is None:  # as trackers
                raise JaxdistError('train.eval_tasks needs lm-eval: pip install "jaxdist[eval]"')
        # The library, once, here: --help, a bad flag or a missing extra answers before it loads.
        # deferred: flax, grain, jax, optax, orbax load on first use, not when python -m jaxdist.train starts
        from jaxdist.data import data_rules
        from jaxdist.objectives import registry as objectives
        from jaxdist.training import loop, rundir, startup

        cfg = data_rules.resolve_token_dtype(cfg)  # the token dtype read: a prepared folder's manifest decides
        if args.print_config:
            setup_platform(args.cpu_devices)
            print(config.dump(startup.on_all_devices(cfg)), end="")
            return 0
        run_dir = rundir.prepare(args.run_dir, cfg, args.config, typed_restore)
        setup_platform(args.cpu_devices)
        tasks = eval_tasks(cfg)  # train.eval_tasks: the harness (the eval extra)
        allowed = rundir.allowed_changes(args.allow_config_change)
        launch = launch_mod.detect(args.coordinator, args.num_processes, args.process_id)
        launch_mod.initialize(launch, args.init_timeout, args.heartbeat_timeout)
        peers.join(launch, run_dir)  # the peers' supervisors, for naming one that dies
        stopper.install()  # back from XLA's preemption notifier, which initialize installs
        enable_compilation_cache()
        print(launch_mod.topology_line(), flush=True)
        if auto:
            # deferred: the search compiles candidate layouts (jax, the library), after the platform set-up
            from jaxdist.analysis import mesh_auto

            hw = mesh_auto.hardware_here(budget, args.hardware)
            cfg, changed = mesh_auto.auto_layout(
                cfg,
                run_dir,
                hw,
                steps=args.mesh_search_steps,
                budget_s=args.mesh_search_budget,
                cache=mesh_auto.cache_dir(),
            )
            allowed |= changed
        origin = (
            "--run-dir"
            if args.run_dir
            else "named by this config, train.steps aside: the same command resumes it, a larger --steps extends it"
        )
        rollouts = None
        if objectives.rollouts(cfg):
            # deferred: GRPO's driver (the decoder, above training) loads only for GRPO configs
            from jaxdist.inference import rollout

            rollouts = rollout.for_run
        loop.run(
            cfg,
            run_dir,
            restore=args.restore,
            stopper=stopper,
            allowed=allowed,
            origin=origin,
            tasks=tasks,
            rollouts=rollouts,
        )
    except JaxdistError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("aborted (second interrupt): no checkpoint written for the current step", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
