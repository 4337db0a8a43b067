"""Why jaxdist keeps JAX's persistent compilation cache off on CPU with several devices
(jaxdist/distributed/platform.py `enable_compilation_cache`): a train step loaded from that cache can
deadlock in its first collectives where the same step, compiled, runs.

    python scripts/checks/cpu_cache_deadlock.py                       # fsdp=2,cp=2,ep=2, ~2 minutes
    python scripts/checks/cpu_cache_deadlock.py --mesh dp=2,fsdp=4    # a mesh that loads fine

Runs one step of the 8-layer deep-narrow model (scripts/bench/mesh_sweep.py's) on 8 simulated CPU devices
twice, each time in a fresh process sharing a new, empty cache folder (JAX_COMPILATION_CACHE_DIR, every
program cached): the first compiles and writes the cache, the second loads the step from it. Prints each
run's exit status and step seconds. Seen on jax 0.10.2 (2026-12-05): fsdp=2,cp=2,ep=2 and
dp=2,fsdp=2,cp=2 ran when compiled (3.4-3.5 s a step) and, loaded, waited in all-gathers and all-reduces
until XLA aborted the process (SIGABRT: exit -6 here, 134 in a shell; `Termination timeout` in
rendezvous.cc) about 40 s later;
fsdp=4,cp=2, dp=2,fsdp=4, dp=2,fsdp=2,ep=2, dp=2,cp=2,ep=2 and cp=8 loaded and ran. Exit status: 0 when
the loaded run fails while the compiled one ran (the deadlock reproduced), 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ENV = dict(os.environ)  # before mesh_sweep's import, which raises XLA's collective time-out for its sweeps
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from mesh_sweep import DEEP_NARROW  # noqa: E402 (the sweep's model, defined once)


def child(mesh: str) -> None:
    """One step of deep-narrow on `mesh`, compiled or loaded from the cache the environment names."""
    os.environ["XLA_FLAGS"] = ENV.get("XLA_FLAGS", "")  # XLA's own collective time-out, not the sweep's
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    from jaxdist import config
    from jaxdist.analysis import bench
    from jaxdist.distributed.mesh import mesh_from_string
    from jaxdist.training import step

    cfg = config.load("tiny", DEEP_NARROW).replace(mesh=dict(shape=mesh))
    prog = step.build_program(cfg, mesh_from_string(mesh, jax.devices()))
    tokens = bench.random_batch(prog, cfg)
    state = jax.block_until_ready(prog.init_state(0))
    compiled = prog.train_step.lower(state, tokens).compile()
    t0 = time.perf_counter()
    _, metrics = compiled(state, tokens)
    jax.block_until_ready(metrics)
    print(f"step {time.perf_counter() - t0:.2f} s", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mesh", default="fsdp=2,cp=2,ep=2")
    p.add_argument("--timeout", type=float, default=300, help="seconds before a run counts as hung")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.mesh)
        return 0
    env = {**ENV, "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": tempfile.mkdtemp(prefix="cache-")}
    ok = []
    for label in ("compiled", "loaded from the cache"):
        cmd = [sys.executable, __file__, "--child", "--mesh", args.mesh]
        try:
            run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
            said = [line for line in run.stdout.splitlines() if line.startswith("step")]
            stuck = run.stderr.count("may be stuck")
            print(
                f"{args.mesh}, {label}: exit {run.returncode}, {said[-1] if said else 'no step'}, {stuck} stuck lines"
            )
            ok.append(run.returncode == 0)
        except subprocess.TimeoutExpired:
            print(f"{args.mesh}, {label}: still running after {args.timeout:g} s (hung)")
            ok.append(False)
    return 0 if ok == [True, False] else 1


if __name__ == "__main__":
    sys.exit(main())
