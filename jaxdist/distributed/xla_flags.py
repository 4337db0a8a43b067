"""XLA flags that let GPU collectives run behind compute; set on GPU only, before the backend starts.

    from jaxdist.distributed import xla_flags
    xla_flags.apply()        # the CLIs call this first; library users call it before any JAX work

What each flag does (defaults checked in xla/debug_options_flags.cc of jaxlib 0.10):
- the latency-hiding scheduler orders async collectives so that compute runs while they are in
  flight (off by default on GPU); it also overlaps the pipeline's collective-permutes.
- pipelined all-gather / reduce-scatter / all-reduce move the collective of loop iteration i+1 into
  iteration i: with the layer scan, FSDP gathers the next layer's weights during this layer's compute
  (XLA defaults: all-gather and all-reduce off, reduce-scatter on).
- while-loop double buffering unrolls the layer scan by two so those prefetches have buffers to land in.
- combine thresholds merge a layer's many small collectives into one larger, faster one (256 MiB
  covers one layer of models up to ~8B parameters per collective).

Overriding: a flag you set in XLA_FLAGS yourself always wins over ours (matched by name);
JAXDIST_XLA_FLAGS=0 turns the whole set off. Flags are checked against the installed jaxlib first,
in a short subprocess, because XLA aborts the process on a flag it does not know (names change
between releases); unknown ones are dropped with a warning, never passed on.
"""

from __future__ import annotations

import importlib.metadata
import os
import pkgutil
import re
import subprocess
import sys
import warnings
from pathlib import Path

# What the test suite compiles with (tests/conftest.py) and the scripts that reproduce its numbers: numerics,
# HLO and memory, not speed. LLVM's expensive optimisations skipped (compiles ~2x faster on CPU), fusions
# by XLA:CPU's older IR emitters instead of the MLIR fusion emitters (a small train step's compile 5.4 ->
# 1.9 CPU-s; test_step + test_pipeline 190 -> 108 CPU-s; buffer assignment differs, so temp bytes are
# these flags' temp bytes), each module compiled in one LLVM piece (another ~15% on 2 busy cores).
FAST_CPU_COMPILE = [
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
    "--xla_cpu_use_fusion_emitters=false",
    "--xla_cpu_parallel_codegen_split_count=1",
]

GPU_FLAGS: dict[str, str] = {
    "xla_gpu_enable_latency_hiding_scheduler": "true",
    "xla_gpu_enable_pipelined_all_gather": "true",
    "xla_gpu_enable_pipelined_reduce_scatter": "true",
    "xla_gpu_enable_pipelined_all_reduce": "true",
    "xla_gpu_enable_while_loop_double_buffering": "true",
    "xla_gpu_all_gather_combine_threshold_bytes": str(256 * 2**20),
    "xla_gpu_reduce_scatter_combine_threshold_bytes": str(256 * 2**20),
    "xla_gpu_all_reduce_combine_threshold_bytes": str(256 * 2**20),
}

DISABLE_ENV = "JAXDIST_XLA_FLAGS"  # "0" / "false" / "off": leave XLA_FLAGS alone
_GPU_WORDS = ("cuda", "gpu", "rocm")
_FLAG_RE = re.compile(r"--([A-Za-z0-9_]+)")


def flag_names(xla_flags: str) -> set[str]:
    """Names of the flags in an XLA_FLAGS string ('--a=1 --b' -> {'a', 'b'})."""
    return set(_FLAG_RE.findall(xla_flags))


def format_flags(flags: dict[str, str]) -> str:
    return " ".join(f"--{name}={value}" for name, value in flags.items())


def merge(user_flags: str, ours: dict[str, str]) -> str:
    """The user's XLA_FLAGS followed by those of ours the user did not set (the user's value wins)."""
    taken = flag_names(user_flags)
    extra = format_flags({k: v for k, v in ours.items() if k not in taken})
    return " ".join(s for s in (user_flags.strip(), extra) if s)


def _gpu_plugin_installed() -> bool:
    """Is a CUDA / ROCm PJRT plugin installed? (Found as JAX finds them, without importing JAX.)"""
    names = {ep.value for ep in importlib.metadata.entry_points(group="jax_plugins")}
    try:
        # deferred: jax_plugins exists only once a PJRT plugin is installed
        import jax_plugins  # pyright: ignore[reportMissingImports]  # namespace package of PJRT plugins

        names |= {m.name for m in pkgutil.iter_modules(jax_plugins.__path__)}
    except ImportError:
        pass
    return any(word in name for name in names for word in ("cuda", "rocm"))


def _gpu_device_nodes() -> bool:
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return any(Path(p).exists() for p in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/kfd"))


def _requested_platforms() -> str:
    """JAX_PLATFORMS, or jax.config's value if JAX is already imported and it was set there."""
    if "jax" in sys.modules:
        value = sys.modules["jax"].config.jax_platforms
        if value:
            return value
    return os.environ.get("JAX_PLATFORMS", "")


def gpu_backend_expected(platforms: str | None = None, plugin: bool | None = None, devices: bool | None = None) -> bool:
    """Will JAX pick a GPU backend? Decided before it starts: an explicit platform list says so;
    otherwise a GPU plugin must be installed and a GPU device node visible."""
    platforms = _requested_platforms() if platforms is None else platforms
    if platforms:
        return any(w in p.strip().lower() for p in platforms.split(",")[:1] for w in _GPU_WORDS)
    plugin = _gpu_plugin_installed() if plugin is None else plugin
    devices = _gpu_device_nodes() if devices is None else devices
    return plugin and devices


_PROBE = """
try:
    from jaxlib._jax import CompileOptions
except ImportError:
    from jaxlib.xla_extension import CompileOptions
CompileOptions()  # parses XLA_FLAGS: aborts, listing them, on unknown flags
"""


def unknown_flags(flags: dict[str, str], timeout_s: float = 60.0) -> set[str]:
    """Which of `flags` the installed jaxlib does not accept (XLA aborts on those, so ask a child)."""
    env = {**os.environ, "XLA_FLAGS": format_flags(flags), "JAX_PLATFORMS": "cpu", DISABLE_ENV: "0"}
    try:
        run = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return set(flags)  # cannot tell: pass nothing rather than risk an abort
    if run.returncode == 0:
        return set()
    m = re.search(r"Unknown flags? in XLA_FLAGS:(.*)", run.stderr)
    return flag_names(m.group(1)) & set(flags) if m else set(flags)


def resolve(user_flags: str, flags: dict[str, str], probe=unknown_flags) -> tuple[str, dict[str, str], set[str]]:
    """(new XLA_FLAGS, flags added, flags dropped as unknown): ours minus those the user set, minus
    those `probe` says this jaxlib rejects, appended to the user's own."""
    wanted = {k: v for k, v in flags.items() if k not in flag_names(user_flags)}
    bad = probe(wanted) if wanted else set()
    added = {k: v for k, v in wanted.items() if k not in bad}
    return merge(user_flags, added), added, bad


_applied: dict[str, str] | None = None


def apply() -> dict[str, str]:
    """Add the overlap flags to XLA_FLAGS when JAX will run on GPU. Returns the flags added ({} if none).

    Must run before the JAX backend starts (XLA reads its flags once); later it warns and does
    nothing. Idempotent: the jaxlib probe runs once per process.
    """
    global _applied
    if _applied is not None:
        return _applied
    if os.environ.get(DISABLE_ENV, "1").lower() in ("0", "false", "off", "no") or not gpu_backend_expected():
        return {}
    if "jax" in sys.modules:
        # deferred: JAX must not load before the platform set-up (XLA flags, CPU device count) has run
        from jax._src import xla_bridge

        if xla_bridge.backends_are_initialized():
            warnings.warn(
                "jaxdist.distributed.xla_flags.apply() ran after the JAX backend started, so its XLA flags "
                "cannot take effect; call it before any JAX computation"
            )
            return {}
    value, _applied, bad = resolve(os.environ.get("XLA_FLAGS", ""), GPU_FLAGS)
    if bad:
        warnings.warn(f"this jaxlib does not know the XLA flags {', '.join(sorted(bad))}: not set")
    os.environ["XLA_FLAGS"] = value
    return _applied
