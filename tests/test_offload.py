"""optim.offload=host: the optimizer state lives in pinned host memory between steps, is streamed to
the device for the update, and training computes exactly what it computes without offload.

CPU has a `pinned_host` memory kind, so placement is checked in the compiled program (shardings, and
the HLO entry layout's host memory space S(5): the state's bytes move from device to host arguments);
on GPU the memory analysis also shows it (scripts/gpu_check.sh runs this file there, on one GPU).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SMALL_MODEL

from jaxdist import hlo, metrics, step
from jaxdist import mesh as mesh_mod

SMALL = dict(SMALL_MODEL, seq_len=16)
STEPS = 3


def mesh():
    devices = jax.devices()[:2]  # fsdp=2 on CPU; a single GPU runs it as fsdp=1
    return mesh_mod.mesh_from_string(f"fsdp={len(devices)}", devices)


@pytest.fixture(scope="module")
def cfg(tiny_cfg):
    return tiny_cfg.replace(model=SMALL, train=dict(steps=STEPS, global_batch=4), optim=dict(warmup_steps=1))


@pytest.fixture(scope="module")
def batches(cfg):
    rng = np.random.default_rng(3)
    return rng.integers(0, cfg.model.vocab_size, (STEPS, 4, cfg.model.seq_len + 1), dtype=np.int32)


# The checks are placement and numerics, not speed: compile without LLVM optimisation (much faster).


def train(cfg, init, batches):
    prog = step.build_program(cfg, mesh())
    tokens = jax.ShapeDtypeStruct(batches.shape[1:], jnp.int32, sharding=prog.batch_sharding)
    compiled = prog.train_step.lower(prog.abstract_state, tokens).compile()
    state = jax.device_put(init, prog.state_shardings)
    for b in batches:
        state, metrics = compiled(state, jax.device_put(b, prog.batch_sharding))
    return prog, compiled, state, float(metrics["loss"])


@pytest.fixture(scope="module")
def init_shardings(cfg):
    """Shardings of the state that `init_state` creates with offload (and that state, on the host)."""
    state = step.build_program(cfg.replace(optim=dict(offload="host")), mesh()).init_state(0)
    return jax.tree.map(lambda a: a.sharding, state), jax.device_get(state)


@pytest.fixture(scope="module")
def runs(cfg, batches, init_shardings):
    init = init_shardings[1]
    return {kind: train(cfg.replace(optim=dict(offload=kind)), init, batches) for kind in ("none", "host")}


def kinds(tree):
    """Memory kinds of a tree of shardings or arrays."""
    return set(jax.tree.leaves(jax.tree.map(lambda s: getattr(s, "sharding", s).memory_kind, tree)))


def test_state_is_placed_in_host_memory(runs, init_shardings):
    prog, compiled, state, _ = runs["host"]
    init_shardings = init_shardings[0]
    host, device = "pinned_host", jax.devices()[0].default_memory().kind
    assert kinds(prog.state_shardings.opt_state) == {host}
    assert kinds(prog.state_shardings.params) == {device}
    assert kinds(init_shardings.opt_state) == {host}  # created there, not copied later
    assert kinds(init_shardings.params) == {device}
    # The compiled step takes and returns the optimizer state in host memory, everything else on device.
    (state_in, _), _ = compiled.input_shardings
    state_out, _ = compiled.output_shardings
    for shardings in (state_in, state_out):
        assert kinds(shardings.opt_state) == {host}
        assert kinds(shardings.params) == kinds(shardings.reducer_state) | {device} == {device}
    assert kinds(state.opt_state) == {host}


def entry_layout(compiled) -> str:
    """The HLO module header: `entry_computation_layout={(inputs)->(outputs)}` with memory spaces."""
    header = compiled.as_text().split("\n", 1)[0]
    assert header.startswith("HloModule") and "entry_computation_layout" in header
    return header


def test_hlo_entry_layout_uses_host_memory_space(runs):
    _, compiled, state, _ = runs["host"]
    n_opt = len(jax.tree.leaves(state.opt_state))
    # Memory space 5 is host memory: each optimizer leaf once as input and once as output.
    assert entry_layout(compiled).count("S(5)") == 2 * n_opt
    assert "S(5)" not in entry_layout(runs["none"][1])


def test_offload_trains_identically(runs):
    _, _, plain, plain_loss = runs["none"]
    _, _, offloaded, host_loss = runs["host"]
    assert host_loss == plain_loss
    for a, b in zip(jax.tree.leaves(jax.device_get(plain)), jax.tree.leaves(jax.device_get(offloaded))):
        np.testing.assert_array_equal(a, b)


def test_device_memory_holds_no_optimizer_state(runs):
    """The compiled step's device-memory arguments are the plain step's minus exactly the optimizer
    state's bytes, which are host (S(5)) arguments instead: read from the program's entry layout
    (every platform). On GPU the memory analysis also splits host from device arguments (CPU's counts
    both memories together), and says the same."""
    _, compiled, state, _ = runs["host"]
    _, plain, _, _ = runs["none"]
    opt_bytes = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state.opt_state))
    host_args, plain_args = (
        hlo.entry_bytes(compiled.as_text())["arguments"],
        hlo.entry_bytes(plain.as_text())["arguments"],
    )
    assert plain_args == {"host": 0, "device": plain.memory_analysis().argument_size_in_bytes}
    assert host_args == {"host": opt_bytes, "device": plain_args["device"] - opt_bytes}
    if jax.devices()[0].platform != "cpu":
        host, dev = compiled.memory_analysis(), plain.memory_analysis()
        assert host.host_argument_size_in_bytes == opt_bytes
        assert dev.argument_size_in_bytes - host.argument_size_in_bytes == opt_bytes


def test_compiled_memory_reports_the_state_as_host_bytes(runs):
    """metrics.compiled_memory (bench's bytes_per_device): the optimizer state's bytes are host
    arguments and outputs, and the device arguments drop by exactly those bytes, against the plain step."""
    _, compiled, state, _ = runs["host"]
    _, plain, _, _ = runs["none"]
    opt_bytes = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state.opt_state))
    off, ref = metrics.compiled_memory(compiled), metrics.compiled_memory(plain)
    assert off["host_arguments"] == off["host_outputs"] == opt_bytes > 0
    assert ref["host_arguments"] == ref["host_outputs"] == 0
    assert ref["arguments"] - off["arguments"] == opt_bytes
    assert ref["outputs"] - off["outputs"] == opt_bytes
    assert ref["total"] - off["total"] == opt_bytes, (ref, off)  # the donated state leaves too
