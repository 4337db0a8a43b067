"""GPU overlap flags: well-formed, known to the installed jaxlib, applied only on GPU, user's wins."""

import os
import subprocess
import sys

import pytest

from jaxdist.distributed import xla_flags


def test_every_flag_is_known_to_this_jaxlib():
    # The real probe (a child process): XLA would abort start-up on any flag it does not know.
    assert xla_flags.unknown_flags(xla_flags.GPU_FLAGS) == set()


def test_probe_finds_unknown_flags():
    flags = {"xla_gpu_enable_latency_hiding_scheduler": "true", "xla_jaxdist_no_such_flag": "1"}
    assert xla_flags.unknown_flags(flags) == {"xla_jaxdist_no_such_flag"}


def test_flags_are_well_formed():
    text = xla_flags.format_flags(xla_flags.GPU_FLAGS)
    assert xla_flags.flag_names(text) == set(xla_flags.GPU_FLAGS)
    for name, value in xla_flags.GPU_FLAGS.items():
        assert name.startswith("xla_gpu_")
        assert value in ("true", "false") or value.isdigit(), (name, value)
        assert f"--{name}={value}" in text.split()


def test_user_flags_win_and_unknown_ones_are_dropped():
    user = "--xla_gpu_enable_latency_hiding_scheduler=false --xla_dump_to=/tmp/x"
    ours = {
        "xla_gpu_enable_latency_hiding_scheduler": "true",
        "xla_gpu_enable_pipelined_all_gather": "true",
        "xla_gpu_renamed_flag": "1",
    }
    seen = {}

    def probe(flags):
        seen.update(flags)
        return {"xla_gpu_renamed_flag"}

    value, added, bad = xla_flags.resolve(user, ours, probe)
    assert "xla_gpu_enable_latency_hiding_scheduler" not in seen  # the user's setting is not even probed
    assert added == {"xla_gpu_enable_pipelined_all_gather": "true"} and bad == {"xla_gpu_renamed_flag"}
    assert value == user + " --xla_gpu_enable_pipelined_all_gather=true"


@pytest.mark.parametrize(
    "platforms,plugin,devices,expected",
    [
        ("cpu", True, True, False),  # explicit CPU wins over an installed plugin
        ("cuda", False, False, True),
        ("cuda,cpu", False, False, True),
        ("cpu,cuda", True, True, False),  # the first listed platform is the default backend
        ("", True, True, True),
        ("", True, False, False),  # plugin installed, no GPU visible: JAX falls back to CPU
        ("", False, True, False),
    ],
)
def test_gpu_detection(platforms, plugin, devices, expected):
    assert xla_flags.gpu_backend_expected(platforms, plugin, devices) is expected


def run_child(env_extra, code):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", xla_flags.DISABLE_ENV)}
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


APPLY = "import os; from jaxdist.distributed import xla_flags; print(xla_flags.apply()); print(os.environ.get('XLA_FLAGS', ''))"


def test_not_applied_on_cpu():
    added, value = run_child({"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_dump_to=/tmp/x"}, APPLY).splitlines()
    assert added == "{}" and value == "--xla_dump_to=/tmp/x"


def test_applied_before_backend_start_with_user_override():
    # JAX_PLATFORMS=cuda makes apply() act as on a GPU machine; nothing here starts a backend.
    user = "--xla_gpu_enable_pipelined_all_gather=false"
    added, value = run_child({"JAX_PLATFORMS": "cuda", "XLA_FLAGS": user}, APPLY).splitlines()
    names = xla_flags.flag_names(value)
    assert value.startswith(user) and value.count("xla_gpu_enable_pipelined_all_gather") == 1
    assert names == set(xla_flags.GPU_FLAGS)
    off = run_child({"JAX_PLATFORMS": "cuda", xla_flags.DISABLE_ENV: "0"}, APPLY).splitlines()
    assert off == ["{}"]


def test_too_late_warns_and_does_nothing():
    code = (
        "import os, warnings, jax; jax.devices(); from jaxdist.distributed import xla_flags\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always'); xla_flags.gpu_backend_expected = lambda: True\n"
        "    print(xla_flags.apply(), os.environ.get('XLA_FLAGS', ''), 'backend started' in str(w[0].message))"
    )
    assert run_child({"JAX_PLATFORMS": "cpu"}, code) == "{}  True"
