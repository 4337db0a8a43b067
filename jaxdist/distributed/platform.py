"""The platform set-up every command does before JAX starts: simulated CPU devices, GPU overlap flags, the
garbage collector, and the persistent compilation cache."""

from __future__ import annotations

import gc
import os

from jaxdist.distributed import xla_flags
from jaxdist.errors import JaxdistError


def setup_platform(cpu_devices: int) -> None:
    """Simulated CPU devices and GPU overlap flags must be configured before any JAX work."""
    env = os.environ.get("JAX_NUM_CPU_DEVICES")
    if env is not None and not (env.strip().isdigit() and int(env) > 0):
        raise JaxdistError(
            f"JAX_NUM_CPU_DEVICES={env!r} must be a positive whole number of simulated CPU devices; fix or unset it"
        )
    if cpu_devices < 1:
        raise JaxdistError(f"--cpu-devices {cpu_devices} must be at least 1")

    xla_flags.apply()  # GPU only: async collectives behind compute (see jaxdist/distributed/xla_flags.py)
    # deferred: JAX must not load before the platform set-up (XLA flags, CPU device count) has run
    import jax

    tune_gc()
    if "JAX_NUM_CPU_DEVICES" not in os.environ and "xla_force_host_platform_device_count" not in os.environ.get(
        "XLA_FLAGS", ""
    ):
        jax.config.update("jax_num_cpu_devices", cpu_devices)


GC_THRESHOLD = (20_000, 10, 10)  # Python's default is (700, 10, 10)


def tune_gc() -> None:
    """Python's cyclic garbage collector, for a process that traces JAX programs: tracing allocates
    millions of objects, and every full collection walked them all, the imported libraries' included.
    What is alive now (the libraries) moves to a permanent generation that is never walked again, and the
    young generation is collected every 20,000 allocations rather than 700; garbage still goes, a little
    later. tests/conftest.py does the same for the suite."""
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLD)


CACHE_FOLDER = "~/.cache/jaxdist/xla"  # the persistent compilation cache's default folder


def cache_folder() -> str:
    """Where jaxdist keeps what outlives a run on this machine: JAX_COMPILATION_CACHE_DIR, else
    CACHE_FOLDER (the compiled programs where enable_compilation_cache turns the cache on; `--mesh auto`'s
    decisions in its mesh_search/ either way)."""
    return os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.expanduser(CACHE_FOLDER)


def enable_compilation_cache() -> None:
    """Persistent compilation cache for single-process GPU/TPU runs and one-device CPU runs: a re-run of
    the same program loads it instead of compiling. Off wherever a loaded CPU program runs collectives,
    because there it can hang (jax 0.10.2, XLA:CPU):
    - several CPU processes: two that both loaded their step from the cache hung in the first gloo
      collective;
    - one CPU process with several devices: a step loaded from the cache deadlocked in its first
      collectives for some meshes (fsdp=2,cp=2,ep=2 and dp=2,fsdp=2,cp=2 of an 8-layer model: compiled, it
      runs; loaded, XLA aborts the step after its rendezvous time-out; scripts/checks/cpu_cache_deadlock.py).
    JAX_COMPILATION_CACHE_DIR, when set, wins in one process: the user asked for it (the test suite does,
    for its compile time)."""
    # deferred: JAX must not load before the platform set-up (XLA flags, CPU device count) has run
    import jax

    cpu = jax.default_backend() == "cpu"
    if jax.process_count() > 1:
        if cpu:
            jax.config.update("jax_compilation_cache_dir", None)
    elif not os.environ.get("JAX_COMPILATION_CACHE_DIR") and not (cpu and jax.device_count() > 1):
        jax.config.update("jax_compilation_cache_dir", cache_folder())
