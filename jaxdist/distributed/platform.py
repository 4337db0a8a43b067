"""The platform set-up every command does before JAX starts: simulated CPU devices, GPU overlap flags, and
the persistent compilation cache."""

from __future__ import annotations

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

    if "JAX_NUM_CPU_DEVICES" not in os.environ and "xla_force_host_platform_device_count" not in os.environ.get(
        "XLA_FLAGS", ""
    ):
        jax.config.update("jax_num_cpu_devices", cpu_devices)


def enable_compilation_cache() -> None:
    """Persistent compilation cache for single-process runs: a re-run of the same program loads it
    instead of compiling (~10x faster start on CPU). JAX_COMPILATION_CACHE_DIR, when set, wins — except
    for several CPU processes: two that both loaded their step from the cache hung in the first gloo
    collective (jax 0.10.2), so there the cache is off."""
    # deferred: JAX must not load before the platform set-up (XLA flags, CPU device count) has run
    import jax

    if jax.process_count() > 1:
        if jax.default_backend() == "cpu":
            jax.config.update("jax_compilation_cache_dir", None)
    elif not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser("~/.cache/jaxdist/xla"))
