"""CPU page faults per train step, with and without glibc's huge-page malloc (docs/performance.md).

    nice -n 10 python scripts/bench/cpu_page_faults.py [--steps 20] [--repeats 2] [--config configs/tiny.yaml]

XLA's CPU runtime allocates each step's temporary buffer afresh and glibc maps it anew, so each step
page-faults it in. For each setting (GLIBC_TUNABLES unset, then glibc.malloc.hugetlb=1: transparent
huge pages in `madvise` mode, glibc >= 2.35) a child process compiles the config's train step on one
CPU device, runs 3 warm-up steps, then --steps timed steps, and prints one JSON line: the compiled
temp bytes, minor page faults per step (getrusage over the timed steps) and the median step time.
Then the speed-up (median step time without / with), per repeat. Timings are noisy on a shared
machine; the fault counts are not.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

TUNABLE = "glibc.malloc.hugetlb=1"


def child(config: str, steps: int) -> dict:
    import resource

    import jax
    import jax.numpy as jnp

    from jaxdist import config as config_mod
    from jaxdist.distributed.mesh import mesh_from_string
    from jaxdist.training import step

    cfg = config_mod.load(config, [])
    prog = step.build_program(cfg, mesh_from_string("fsdp=1", jax.devices()[:1]))
    shape = (cfg.train.global_batch, cfg.model.seq_len + 1)
    tokens = jax.device_put(jax.random.randint(jax.random.key(0), shape, 0, cfg.model.vocab_size, jnp.int32))
    state = prog.init_state(0)
    compiled = prog.train_step.lower(state, tokens).compile()
    for _ in range(3):
        state, m = compiled(state, tokens)
    jax.block_until_ready(state)
    before, times = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, []
    for _ in range(steps):
        t = time.perf_counter()
        state, m = compiled(state, tokens)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    return {
        "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
        "faults_per_step": faults / steps,
        "step_time_s": statistics.median(times),
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.config, args.steps)))
        return 0
    base = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    base.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1")
    for _ in range(args.repeats):
        times = {}
        for name, extra in (("default", {}), (TUNABLE, {"GLIBC_TUNABLES": TUNABLE})):
            cmd = [sys.executable, __file__, "--child", "--config", args.config, "--steps", str(args.steps)]
            out = subprocess.run(cmd, env={**base, **extra}, capture_output=True, text=True, check=True)
            record = {"malloc": name, **json.loads(out.stdout.strip().splitlines()[-1])}
            times[name] = record["step_time_s"]
            print(json.dumps(record), flush=True)
        print(json.dumps({"speedup": times["default"] / times[TUNABLE]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
