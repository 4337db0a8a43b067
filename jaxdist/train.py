"""`python -m jaxdist.train`: the command line and the training loop (thin: wires the modules together).

python -m jaxdist.train                                  # configs/tiny.yaml on 8 simulated CPU devices
python -m jaxdist.train --mesh dp=2,fsdp=4 optim.lr=1e-3 train.steps=100
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import sys
import threading
import time
from pathlib import Path

from jaxdist import distributed, plot, trackers
from jaxdist.errors import JaxdistError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from jaxdist import config

    p = argparse.ArgumentParser(
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
    p.add_argument("--mesh", default=None, help="mesh axes, e.g. dp=2,fsdp=4 (default: all devices on fsdp)")
    p.add_argument("--dcn-mesh", default=None, help="axes spanning hosts, e.g. dp=2 (multi-host)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (train.steps)")
    p.add_argument("--run-dir", default=None, help="output folder (default: a new folder under runs/)")
    p.add_argument(
        "--restore",
        default=None,
        metavar="PATH",
        help="start from another run's checkpoint (its run dir or checkpoints/STEP); with "
        "checkpoint.params_only=true parameters only. A run dir with its own checkpoints resumes them. "
        "hf:HF_DIR fine-tunes a Hugging Face Llama (model shape from its config.json)",
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
        "--init-timeout", type=int, default=300, help="seconds to wait for the coordinator and every peer (default 300)"
    )
    multi.add_argument(
        "--heartbeat-timeout",
        type=int,
        default=30,
        help="seconds of silence after which a process counts as dead and the others stop (default 30)",
    )
    p.add_argument("overrides", nargs="*", help="section.key=value, e.g. optim.lr=1e-3 train.global_batch=16")
    return p.parse_intermixed_args(argv)  # overrides may come before or after flags


def resolve_config(args: argparse.Namespace):
    from jaxdist import config

    overrides = list(args.overrides)
    if args.mesh is not None:
        overrides.append(f"mesh.shape={args.mesh}")
    if args.dcn_mesh is not None:
        overrides.append(f"mesh.dcn={args.dcn_mesh}")
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    return config.load(args.config, overrides)


def with_resolved_mesh(cfg, num_devices: int):
    """`cfg` with `mesh.shape` as the sizes it resolves to on `num_devices` (fsdp=-1 -> fsdp=8)."""
    from jaxdist import mesh as mesh_mod

    return cfg.replace(mesh=dict(shape=mesh_mod.format_mesh(mesh_mod.parse_mesh(cfg.mesh.shape, num_devices))))


def print_config(cfg) -> str:
    import jax

    from jaxdist import config

    return config.dump(with_resolved_mesh(cfg, jax.device_count()))


def prepare_run_dir(run_dir: str | None) -> Path:
    """Check (do not yet create) the run folder, so bad input writes nothing."""
    from jaxdist import rundir

    path = Path(run_dir) if run_dir else Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    rundir.check_storable(path)
    if path.exists() and not path.is_dir():
        raise JaxdistError(f"--run-dir {path} is a file; pass a folder path")
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK):
        raise JaxdistError(f"--run-dir {path}: {probe} is not writable; choose a folder you can write to")
    return path


def param_and_state_bytes(prog) -> tuple[int, int]:
    """Bytes per device of parameters and of optimizer state (the largest shard, from shardings)."""
    import jax

    def per_device(abstract, shardings):
        total = 0
        for a, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)):
            total += math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize
        return total

    st, sh = prog.abstract_state, prog.state_shardings
    return per_device(st.params, sh.params), per_device(st.opt_state, sh.opt_state)


def summary_lines(cfg, prog, flops_tok: float) -> list[str]:
    from jaxdist import step
    from jaxdist.mesh import format_mesh
    from jaxdist.models.llama import count_params

    p_bytes, o_bytes = param_and_state_bytes(prog)
    counts = count_params(cfg.model)
    n = counts["total"]
    mesh = {a: int(s) for a, s in prog.mesh.shape.items()}
    active = (
        f" ({counts['active'] / 1e6:.2f}M active: {cfg.model.moe_experts} experts, top-"
        f"{cfg.model.moe_topk}, {cfg.model.moe_dispatch}; FLOPs and MFU count active)"
        if cfg.model.moe_experts
        else ""
    )
    lines = [
        f"mesh {format_mesh(mesh)} over {prog.mesh.size} {prog.mesh.devices.flat[0].platform} devices",
        f"model {n / 1e6:.2f}M params{active}; per device: params {p_bytes / 2**20:.1f} MiB, "
        f"optimizer {o_bytes / 2**20:.1f} MiB; {flops_tok / 1e6:.1f} MFLOP/token",
        f"batch {cfg.train.global_batch} x {cfg.model.seq_len} tokens, {cfg.train.grad_accum_steps} micro-batch(es), "
        f"gradient stage {prog.gradients.name}, compute {step.compute_dtype(cfg.model)}",
    ]
    cp = int(prog.mesh.shape.get("cp", 1))
    if cp > 1:
        lines.append(
            f"context parallel cp={cp} ({cfg.model.context_impl}): {cfg.model.seq_len // cp} tokens of each "
            f"sequence per device, load-balanced chunks of {cfg.model.seq_len // (2 * cp)}"
        )
    if prog.pipeline is not None:
        from jaxdist.parallel import pipeline

        d = pipeline.describe(cfg, prog.mesh)
        lines.append(
            f"pipeline {d['schedule']}: {d['stages']} stages x {d['repeats']} repeats, "
            f"{d['microbatches']} micro-batches, {d['iterations']} iterations, "
            f"bubble {d['bubble_fraction']:.1%}"
        )
    return lines


@dataclasses.dataclass
class RunResult:
    run_dir: Path
    final_loss: float
    eval_loss: float | None
    tokens_per_sec: float
    steps: int


def run(
    cfg, run_dir: Path, log=print, restore: str | None = None, stopper=None, allowed: frozenset[str] = frozenset()
) -> RunResult:
    """Train `cfg` and write the run folder. Everything that can fail on input fails before writing.

    Starts from this run dir's latest checkpoint if it has one, else from `restore` (another run's
    checkpoint), else from scratch. SIGTERM / SIGINT stop after the current step with a checkpoint
    (before the first step, if they come during start-up: `stopper` is installed by `main`).
    `allowed`: config keys that may differ from the resumed checkpoint's.
    """
    from jaxdist import checkpoint, rundir

    own = stopper is None
    stopper = stopper or checkpoint.StopSignal()
    lock = rundir.RunLock(run_dir)
    # `closers`: the progress bar and metric writers, closed however the run ends (a failed save must
    # leave its one error line on a line of its own, and no flush traceback at exit).
    with stopper if own else contextlib.nullcontext(), contextlib.ExitStack() as closers:
        try:
            return _run(cfg, Path(run_dir), log, restore, stopper, allowed, lock, closers)
        finally:
            lock.release()


def _quietly(close):
    def call():
        try:
            close()
        except OSError:  # e.g. a full disk: the run's own error says so
            pass

    return call


def _stopped_before_training(stopper, run_dir: Path, log) -> RunResult | None:
    if not stopper.requested():
        return None
    log(
        f"stopped by {stopper.received} during start-up: no step was taken and nothing was saved; "
        "run the same command to start"
    )
    return RunResult(run_dir, float("nan"), None, 0.0, 0)


def _run(cfg, run_dir: Path, log, restore, stopper, allowed, lock, closers) -> RunResult:
    import jax

    from jaxdist import checkpoint, data, hooks, metrics, optim, profiling, report, rundir, step
    from jaxdist import config as config_mod
    from jaxdist import mesh as mesh_mod

    rundir.check_storable(run_dir)
    lock.check()  # another trainer on this run dir: refused before anything is read or written
    trackers.check_installed(cfg.train.trackers)  # a missing extra fails before any work
    # matplotlib loads while the step compiles, so a SIGTERM only waits for drawing loss.png, not for imports
    threading.Thread(target=plot.pyplot, daemon=True).start()
    mesh = mesh_mod.mesh_from_string(cfg.mesh.shape, dcn_text=cfg.mesh.dcn)
    cfg = with_resolved_mesh(cfg, mesh.size)  # config.yaml records the sizes used, not -1
    prog = step.build_program(cfg, mesh)
    loader = data.Loader(cfg, prog.batch_sharding)
    is_main = jax.process_index() == 0
    log = log if is_main else (lambda *a, **k: None)  # multi-process: only process 0 speaks
    no_eval = data.no_eval_reason(cfg, loader)
    if no_eval:  # decided now, not at the first evaluation
        log(f"warning: {no_eval}; evaluation is off")
        cfg = cfg.replace(train=dict(eval_every=0))
    flops_tok = metrics.flops_per_token(cfg.model)
    tokens_per_step = cfg.train.global_batch * cfg.model.seq_len
    peak, peak_source, mfu_approx = metrics.peak_flops(
        list(mesh.devices.flat), str(step.compute_dtype(cfg.model)), cfg.train.peak_flops
    )

    resuming = checkpoint.has_checkpoints(run_dir / checkpoint.SUBDIR)
    if not resuming:
        checkpoint.check_run_dir_model(run_dir, cfg)
    restored = None
    from_hf = bool(restore and restore.startswith("hf:")) and not resuming
    if from_hf:  # fine-tune a Hugging Face checkpoint: its weights, a fresh optimizer
        from jaxdist import hf_io

        restored = hf_io.restore_for_training(restore[3:], prog, cfg)
    elif resuming or restore:
        if resuming and restore and is_main:
            log(f"{run_dir} has its own checkpoints: resuming them (--restore {restore} ignored)")
        restored = checkpoint.restore(
            run_dir if resuming else Path(restore),
            prog,
            loader,
            cfg,
            params_only=cfg.checkpoint.params_only and not resuming,
            log=log,
            allowed=allowed,
            drift=resuming,
        )
    start = restored.step if restored else 0
    if (stopped := _stopped_before_training(stopper, run_dir, log)) is not None:
        return stopped
    if start >= cfg.train.steps:
        log(
            f"nothing to do: {restored.path} is already at step {start} of train.steps={cfg.train.steps} "
            "(raise --steps to train further)"
        )
        return RunResult(run_dir, float("nan"), None, 0.0, start)

    # Input is valid: from here on we write.
    if not checkpoint.all_agree(not is_main or _take(lock, log)):
        raise lock.refused()
    run_dir.mkdir(parents=True, exist_ok=True)
    changes = restored.changes if restored is not None else {}
    if is_main:
        rundir.record_config(run_dir, config_mod.dump(cfg), start, changes)
        for line in [
            *summary_lines(cfg, prog, flops_tok),
            report.data_line(cfg, loader),
            report.units_line(cfg),
            report.peak_line(peak, peak_source, mfu_approx),
            *report.artefact_lines(cfg, run_dir),
        ]:
            log(line)
        for line in optim.schedule_notes(cfg, start, changes):
            log(line)
    tracked = trackers.Trackers(cfg.train.trackers, run_dir, cfg.to_dict(), config_mod.dump(cfg)) if is_main else None
    writer = metrics.MetricWriter(run_dir, enabled=is_main, resume_step=start if resuming else None, trackers=tracked)
    closers.callback(_quietly(writer.close))
    if restored is not None:
        if resuming:
            checkpoint.set_aside_newer(run_dir, restored.step, log)
        if from_hf and is_main:
            from jaxdist import hf_io

            hf_io.keep_source(restored.path, run_dir)  # token ids and tokenizer for a later export
        log(
            f"restored {'parameters' if (cfg.checkpoint.params_only or from_hf) and not resuming else 'step ' + str(start)} "
            f"from {restored.path} in {restored.seconds:.1f}s"
        )
    saver = checkpoint.Saver(run_dir, cfg, log=log if is_main else lambda *a: None)

    t0 = time.perf_counter()
    state = restored.state if restored else prog.init_state(cfg.train.seed)
    first = next(loader)
    compiled = prog.train_step.lower(state, first).compile()
    compile_s = time.perf_counter() - t0
    predicted = report.predicted_bytes(cfg, mesh)
    if is_main:
        log(
            f"compiled in {compile_s:.1f}s; {report.compiled_line(compiled)}"
            + (f"; planner predicts {predicted / 2**20:,.1f} MiB per device" if predicted else "")
        )

    eval_arrays = loader.eval_arrays()

    def evaluate(params) -> float:
        sums = [prog.eval_step(params, b) for b in eval_arrays]
        return float(sum(float(s) for s, _ in sums) / sum(float(c) for _, c in sums))

    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    from jaxdist.progress import Progress  # imports JAX: not before main() has its signal handlers

    progress = Progress(
        cfg,
        writer,
        tokens_per_step,
        flops_tok,
        peak,
        start=start,
        enabled=is_main,
        skipped_in_a_row=int(jax.device_get(state.skipped)),
        mfu_approx=mfu_approx,
        memory=lambda: metrics.device_memory(local),
        log=log,
    )
    closers.callback(progress.close)
    saver.log = progress.say  # checkpoint messages go above the progress bar, not into it
    if (stopped := _stopped_before_training(stopper, run_dir, log)) is not None:
        saver.close()
        return stopped
    stopper.training = True
    batches = hooks.Batches(loader, first)
    per_step = [
        hooks.Profile(profiling.StepTrace(cfg.train.profile_steps, run_dir / "profile", progress.say)),
        hooks.Checkpoint(saver, loader),
        batches,
        hooks.Metrics(progress, evaluate, cfg.train.eval_every),
    ]
    steps_done = start
    try:
        with contextlib.closing(saver):
            state, steps_done = hooks.run_steps(
                lambda st: compiled(st, batches.current), state, start, cfg.train.steps, stopper.requested, per_step
            )
        for h in per_step:
            h.close(state)
    finally:  # also on a stop, a crash or a second Ctrl-C: the picture of what was done
        progress.close()
        if is_main:
            with contextlib.suppress(Exception):  # a picture must never hide the real error
                plot.loss_png(run_dir)

    summary = progress.summary(steps_done, compile_s)
    summary.update(report.memory_summary(compiled, predicted, metrics.device_memory(local)))
    writer.write(summary)
    writer.close()
    ev = f", eval loss {summary['eval_loss']:.4f}" if summary["eval_loss"] is not None else ""
    log(report.memory_line(summary))
    log(
        f"done: {steps_done} steps, loss {summary['final_loss']:.4f} (smoothed {summary['final_loss_smooth']:.4f})"
        f"{ev} nats/token, {summary['tokens_per_sec']:,.0f} tokens/s, MFU {progress.mfu_mark}{summary['mfu']:.1%}, "
        f"run dir {run_dir}, loss plot {run_dir / 'loss.png'}"
    )
    if stopper.received:
        log(
            f"stopped by {stopper.received} at step {steps_done}; latest checkpoint: step {saver.last_saved} "
            f"in {saver.directory}; run the same command to resume"
        )
    return RunResult(run_dir, summary["final_loss"], summary["eval_loss"], summary["tokens_per_sec"], steps_done)


def _take(lock, log) -> bool:
    try:
        note = lock.acquire()
    except JaxdistError:
        return False
    if note:
        log(note)
    return True


def setup_platform(cpu_devices: int) -> None:
    """Simulated CPU devices and GPU overlap flags must be configured before any JAX work."""
    env = os.environ.get("JAX_NUM_CPU_DEVICES")
    if env is not None and not (env.strip().isdigit() and int(env) > 0):
        raise JaxdistError(
            f"JAX_NUM_CPU_DEVICES={env!r} must be a positive whole number of simulated CPU devices; fix or unset it"
        )
    if cpu_devices < 1:
        raise JaxdistError(f"--cpu-devices {cpu_devices} must be at least 1")
    from jaxdist import xla_flags

    xla_flags.apply()  # GPU only: async collectives behind compute (see jaxdist/xla_flags.py)
    import jax

    if "JAX_NUM_CPU_DEVICES" not in os.environ and "xla_force_host_platform_device_count" not in os.environ.get(
        "XLA_FLAGS", ""
    ):
        jax.config.update("jax_num_cpu_devices", cpu_devices)


def enable_compilation_cache() -> None:
    """Persistent compilation cache for single-process runs: a re-run of the same program loads it
    instead of compiling (~10x faster start on CPU). JAX_COMPILATION_CACHE_DIR, when set, wins — except
    for several CPU processes: two that both loaded their step from the cache hung in the first gloo
    collective (jax 0.10.2), so there the cache is off."""
    import jax

    if jax.process_count() > 1:
        if jax.default_backend() == "cpu":
            jax.config.update("jax_compilation_cache_dir", None)
    elif not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser("~/.cache/jaxdist/xla"))


def allowed_changes(text: str) -> frozenset[str]:
    from jaxdist.checkpoint.compat import check_allowed_keys

    keys = frozenset(k.strip() for k in text.split(",") if k.strip())
    check_allowed_keys(keys)
    return keys


def main(argv: list[str] | None = None) -> int:
    from jaxdist import quiet
    from jaxdist.checkpoint.signals import StopSignal  # light: SIGTERM from here on stops cleanly

    quiet.libraries()
    with StopSignal() as stopper:
        return _main(argv, stopper)


def _main(argv: list[str] | None, stopper) -> int:
    try:
        args = parse_args(argv)
        cfg = resolve_config(args)
        if args.restore and args.restore.startswith("hf:"):  # the model shape comes from config.json
            from jaxdist import hf

            cfg = hf.apply(cfg, Path(args.restore[3:]), hf.model_overrides(args.overrides))
        if args.print_config:
            setup_platform(args.cpu_devices)
            print(print_config(cfg), end="")
            return 0
        trackers.check_installed(cfg.train.trackers)  # before JAX starts: a missing extra is a quick error
        run_dir = prepare_run_dir(args.run_dir)
        setup_platform(args.cpu_devices)
        allowed = allowed_changes(args.allow_config_change)
        launch = distributed.detect(args.coordinator, args.num_processes, args.process_id)
        distributed.initialize(launch, args.init_timeout, args.heartbeat_timeout)
        enable_compilation_cache()
        print(distributed.topology_line(), flush=True)
        run(cfg, run_dir, restore=args.restore, stopper=stopper, allowed=allowed)
    except JaxdistError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("aborted (second interrupt): no checkpoint written for the current step", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
