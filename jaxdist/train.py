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
import time
from pathlib import Path

from jaxdist import distributed
from jaxdist.errors import JaxdistError
from jaxdist.progress import Progress


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jaxdist.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="YAML config (default: configs/tiny.yaml)")
    p.add_argument("--mesh", default=None, help="mesh axes, e.g. dp=2,fsdp=4 (default: all devices on fsdp)")
    p.add_argument("--dcn-mesh", default=None, help="axes spanning hosts, e.g. dp=2 (multi-host)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (train.steps)")
    p.add_argument("--run-dir", default=None, help="output folder (default: a new folder under runs/)")
    p.add_argument("--restore", default=None, metavar="PATH",
                   help="start from another run's checkpoint (its run dir or checkpoints/STEP); with "
                        "checkpoint.params_only=true parameters only. A run dir with its own checkpoints resumes them")
    p.add_argument("--cpu-devices", type=int, default=8,
                   help="simulated devices when running on CPU (default 8)")
    multi = p.add_argument_group("multi-process (default: from JAX_* variables, SLURM, OpenMPI or Kubernetes)")
    multi.add_argument("--coordinator", default=None, help="HOST:PORT of process 0's coordination service")
    multi.add_argument("--num-processes", type=int, default=None, help="processes in the run")
    multi.add_argument("--process-id", type=int, default=None, help="this process's index, 0..N-1")
    multi.add_argument("--init-timeout", type=int, default=300,
                       help="seconds to wait for the coordinator and every peer (default 300)")
    multi.add_argument("--heartbeat-timeout", type=int, default=30,
                       help="seconds of silence after which a process counts as dead and the others stop (default 30)")
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


def prepare_run_dir(run_dir: str | None) -> Path:
    """Check (do not yet create) the run folder, so bad input writes nothing."""
    path = Path(run_dir) if run_dir else Path("runs") / time.strftime("%Y%m%d-%H%M%S")
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
    n = count_params(cfg.model)["total"]
    mesh = {a: int(s) for a, s in prog.mesh.shape.items()}
    lines = [
        f"mesh {format_mesh(mesh)} over {prog.mesh.size} {prog.mesh.devices.flat[0].platform} devices",
        f"model {n / 1e6:.2f}M params; per device: params {p_bytes / 2**20:.1f} MiB, "
        f"optimizer {o_bytes / 2**20:.1f} MiB; {flops_tok / 1e6:.1f} MFLOP/token",
        f"batch {cfg.train.global_batch} x {cfg.model.seq_len} tokens, {cfg.train.microbatches} micro-batch(es), "
        f"gradient stage {prog.gradients.name}, compute {step.compute_dtype(cfg.model)}",
    ]
    cp = int(prog.mesh.shape.get("cp", 1))
    if cp > 1:
        lines.append(f"context parallel cp={cp} ({cfg.model.context_impl}): {cfg.model.seq_len // cp} tokens of each "
                     f"sequence per device, load-balanced chunks of {cfg.model.seq_len // (2 * cp)}")
    if prog.pipeline is not None:
        from jaxdist.parallel import pipeline
        d = pipeline.describe(cfg, prog.mesh)
        lines.append(f"pipeline {d['schedule']}: {d['stages']} stages x {d['repeats']} repeats, "
                     f"{d['microbatches']} micro-batches, {d['iterations']} iterations, "
                     f"bubble {d['bubble_fraction']:.1%}")
    return lines


@dataclasses.dataclass
class RunResult:
    run_dir: Path
    final_loss: float
    eval_loss: float | None
    tokens_per_sec: float
    steps: int


def run(cfg, run_dir: Path, log=print, restore: str | None = None) -> RunResult:
    """Train `cfg` and write the run folder. Everything that can fail on input fails before writing.

    Starts from this run dir's latest checkpoint if it has one, else from `restore` (another run's
    checkpoint), else from scratch. SIGTERM / SIGINT stop after the current step with a checkpoint.
    """
    import jax
    from tqdm import tqdm

    from jaxdist import checkpoint, config as config_mod, data, mesh as mesh_mod, metrics, profiling, step

    mesh = mesh_mod.mesh_from_string(cfg.mesh.shape, dcn_text=cfg.mesh.dcn)
    prog = step.build_program(cfg, mesh)
    loader = data.Loader(cfg, prog.batch_sharding)
    is_main = jax.process_index() == 0
    log = log if is_main else (lambda *a, **k: None)  # multi-process: only process 0 speaks
    flops_tok = metrics.flops_per_token(cfg.model)
    tokens_per_step = cfg.train.global_batch * cfg.model.seq_len
    peak = metrics.peak_flops_total(list(mesh.devices.flat), str(step.compute_dtype(cfg.model)), cfg.train.peak_flops)

    resuming = checkpoint.has_checkpoints(run_dir / checkpoint.SUBDIR)
    if not resuming:
        checkpoint.check_run_dir_model(run_dir, cfg)
    restored = None
    if resuming or restore:
        if resuming and restore and is_main:
            log(f"{run_dir} has its own checkpoints: resuming them (--restore {restore} ignored)")
        restored = checkpoint.restore(run_dir if resuming else Path(restore), prog, loader, cfg,
                                      params_only=cfg.checkpoint.params_only and not resuming, log=log)
    start = restored.step if restored else 0
    if start >= cfg.train.steps:
        log(f"nothing to do: {restored.path} is already at step {start} of train.steps={cfg.train.steps} "
            "(raise --steps to train further)")
        return RunResult(run_dir, float("nan"), None, 0.0, start)

    # Input is valid: from here on we write.
    run_dir.mkdir(parents=True, exist_ok=True)
    if is_main:
        (run_dir / "config.yaml").write_text(config_mod.dump(cfg))
        for line in summary_lines(cfg, prog, flops_tok):
            log(line)
    writer = metrics.MetricWriter(run_dir, enabled=is_main, resume_step=start if resuming else None)
    if restored is not None:
        if resuming:
            checkpoint.set_aside_newer(run_dir, restored.step, log)
        log(f"restored {'parameters' if cfg.checkpoint.params_only and not resuming else 'step ' + str(start)} "
            f"from {restored.path} in {restored.seconds:.1f}s")
    saver = checkpoint.Saver(run_dir, cfg, log=log if is_main else lambda *a: None)

    t0 = time.perf_counter()
    state = restored.state if restored else prog.init_state(cfg.train.seed)
    first = next(loader)
    compiled = prog.train_step.lower(state, first).compile()
    compile_s = time.perf_counter() - t0
    if is_main:
        log(f"compiled in {compile_s:.1f}s")

    eval_arrays = loader.eval_arrays()

    def evaluate(params) -> float:
        sums = [prog.eval_step(params, b) for b in eval_arrays]
        return float(sum(float(s) for s, _ in sums) / sum(float(c) for _, c in sums))

    def eval_due(done: int) -> bool:
        return bool(cfg.train.eval_every) and (done % cfg.train.eval_every == 0 or done == cfg.train.steps)

    trace = profiling.StepTrace(cfg.train.profile_steps, run_dir / "profile", log)
    bar = tqdm(total=cfg.train.steps, initial=start, disable=not is_main, dynamic_ncols=True, mininterval=1.0)
    progress = Progress(cfg, writer, bar, tokens_per_step, flops_tok, peak,
                        skipped_in_a_row=int(jax.device_get(state.skipped)))
    batch, steps_done, pending, stopper = first, start, None, checkpoint.StopSignal()
    with stopper, contextlib.closing(saver):
        for s in range(start, cfg.train.steps):
            trace.at_step(s, state)
            state, m = compiled(state, batch)
            steps_done = s + 1
            stop = stopper.requested()
            last = stop or steps_done == cfg.train.steps
            if stop or saver.due(steps_done, last):
                saver.save(state, steps_done, loader)  # before the next batch is drawn: the iterator is at this step
            saver.poll()
            batch = next(loader) if not last else None
            if pending is not None:
                progress.record(*pending)  # the previous step, read while this one runs
            pending = (s, m)
            if last or eval_due(steps_done):  # evaluate the state this step produced: read it now
                params = state.params
                progress.record(s, m, evaluate=(lambda: evaluate(params)) if eval_due(steps_done) else None,
                                final=last)
                pending = None
            if stop:
                break
    trace.close(state)
    bar.close()

    summary = progress.summary(steps_done, compile_s)
    writer.write(summary)
    writer.close()
    ev = f", eval loss {summary['eval_loss']:.4f}" if summary["eval_loss"] is not None else ""
    log(f"done: {steps_done} steps, loss {summary['final_loss']:.4f}{ev}, {summary['tokens_per_sec']:,.0f} "
        f"tokens/s, MFU {summary['mfu']:.1%}, run dir {run_dir}")
    if stopper.received:
        log(f"stopped by {stopper.received} at step {steps_done}; latest checkpoint: step {saver.last_saved} "
            f"in {saver.directory}; run the same command to resume")
    return RunResult(run_dir, summary["final_loss"], summary["eval_loss"], summary["tokens_per_sec"], steps_done)


def setup_platform(cpu_devices: int) -> None:
    """Simulated CPU devices and GPU overlap flags must be configured before any JAX work."""
    from jaxdist import xla_flags
    xla_flags.apply()  # GPU only: async collectives behind compute (see jaxdist/xla_flags.py)
    import jax
    if "JAX_NUM_CPU_DEVICES" not in os.environ and "xla_force_host_platform_device_count" not in \
            os.environ.get("XLA_FLAGS", ""):
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


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        cfg = resolve_config(args)
        run_dir = prepare_run_dir(args.run_dir)
        setup_platform(args.cpu_devices)
        launch = distributed.detect(args.coordinator, args.num_processes, args.process_id)
        distributed.initialize(launch, args.init_timeout, args.heartbeat_timeout)
        enable_compilation_cache()
        print(distributed.topology_line(), flush=True)
        run(cfg, run_dir, restore=args.restore)
    except JaxdistError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("aborted (second interrupt): no checkpoint written for the current step", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
