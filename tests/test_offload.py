"""offload.optimizer=host: the optimizer state lives in pinned host memory between steps, is streamed to
the device for the update, and training computes exactly what it computes without offload.

CPU has a `pinned_host` memory kind, so placement is checked in the compiled program (shardings, and
the HLO entry layout's host memory space S(5): the state's bytes move from device to host arguments);
on GPU the memory analysis also shows it (scripts/gpu_check.sh runs this file there, on one GPU).
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SMALL_MODEL

from jaxdist.distributed import hlo_memory, offload
from jaxdist.distributed import mesh as mesh_mod
from jaxdist.observe import metrics
from jaxdist.training import step

SMALL = dict(SMALL_MODEL, seq_len=16)
STEPS = 3


def mesh():
    devices = jax.devices()[:2]  # fsdp=2 on CPU; a single GPU runs it as fsdp=1
    return mesh_mod.mesh_from_string(f"fsdp={len(devices)}", devices)


@pytest.fixture(scope="module")
def cfg(tiny_cfg):
    # Two micro-batches per step: offloaded gradients are accumulated too.
    train = dict(steps=STEPS, global_batch=4, grad_accum_steps=2)
    return tiny_cfg.replace(model=SMALL, train=train, optim=dict(warmup_steps=1))


@pytest.fixture(scope="module")
def batches(cfg):
    rng = np.random.default_rng(3)
    return rng.integers(0, cfg.model.vocab_size, (STEPS, 4, cfg.model.seq_len + 1), dtype=np.int32)


# The checks are placement and numerics, not speed: compile without LLVM optimisation (much faster).


def train(cfg, init, batches, on=None):
    prog = step.build_program(cfg, on or mesh())
    tokens = jax.ShapeDtypeStruct(batches.shape[1:], jnp.int32, sharding=prog.batch_sharding)
    compiled = prog.train_step.lower(prog.abstract_state, tokens).compile()
    state, seen = jax.device_put(init, prog.state_shardings), []
    for b in batches:
        state, metrics = compiled(state, jax.device_put(b, prog.batch_sharding))
        seen.append((float(metrics["loss"]), float(metrics["grad_norm"])))
    return prog, compiled, state, seen  # seen: (loss, gradient norm) of every step


@pytest.fixture(scope="module")
def init_shardings(cfg):
    """Shardings of the state that `init_state` creates with offload (and that state, on the host)."""
    state = step.build_program(cfg.replace(offload=dict(optimizer="host")), mesh()).init_state(0)
    return jax.tree.map(lambda a: a.sharding, state), jax.device_get(state)


@pytest.fixture(scope="module")
def runs(cfg, batches, init_shardings):
    init = init_shardings[1]
    out = {kind: train(cfg.replace(offload=dict(optimizer=kind)), init, batches) for kind in ("none", "host")}
    out["params"] = train(cfg.replace(offload=dict(params="host")), init, batches)
    out["activations"] = train(cfg.replace(offload=dict(activations="host")), init, batches)
    out["dots"] = train(cfg.replace(model=dict(remat="dots_saveable")), init, batches)  # the same residuals, on device
    return out


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


def assert_same_run(seen, plain_seen, state, plain_state, rtol, atol, state_atol=None):
    """Two differently compiled programs' runs: every step's (loss, gradient norm) and every leaf of the
    final state within the tolerance (never ==: a fusion XLA may choose differently rounds differently);
    `state_atol` (default `atol`) for the state's leaves."""
    assert len(seen) == len(plain_seen)
    np.testing.assert_allclose(np.asarray(seen, float), np.asarray(plain_seen, float), rtol=rtol, atol=atol)
    leaves = zip(jax.tree.leaves(jax.device_get(plain_state)), jax.tree.leaves(jax.device_get(state)), strict=True)
    for a, b in leaves:
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol if state_atol is None else state_atol)


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


@pytest.mark.parametrize("kind, reference", [("host", "none"), ("params", "none"), ("activations", "dots")])
def test_offload_trains_identically(runs, kind, reference):
    """3 steps with 2 micro-batches on fsdp=2: every step's loss and gradient norm, and the final
    parameters and AdamW moments (which hold the gradients), equal to the run without offload to 1e-6
    relative (measured: bit-identical on this CPU; two differently compiled programs are compared with a
    tolerance, never with ==).
    Activation offload is compared with model.remat=dots_saveable, which keeps the same residuals on the
    device (against no remat at all, the recomputation rounds differently: see the next test)."""
    _, _, plain, plain_seen = runs[reference]
    _, _, offloaded, seen = runs[kind]
    assert_same_run(seen, plain_seen, offloaded, plain, rtol=1e-6, atol=1e-8)


def test_device_memory_holds_no_optimizer_state(runs):
    """The compiled step's device-memory arguments are the plain step's minus exactly the optimizer
    state's bytes, which are host (S(5)) arguments instead: read from the program's entry layout
    (every platform). On GPU the memory analysis also splits host from device arguments (CPU's counts
    both memories together), and says the same."""
    _, compiled, state, _ = runs["host"]
    _, plain, _, _ = runs["none"]
    opt_bytes = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state.opt_state))
    host_args, plain_args = (
        hlo_memory.entry_bytes(compiled.as_text())["arguments"],
        hlo_memory.entry_bytes(plain.as_text())["arguments"],
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


def test_activation_offload_is_close_to_no_remat(runs):
    _, _, plain, plain_seen = runs["none"]
    _, _, offloaded, seen = runs["activations"]
    # Recomputation rounds differently: every step's loss and gradient norm to 1e-6 abs + 1e-4 rel
    # (measured: 4.2e-7 abs, 2.8e-5 rel at most; once 4.8e-7 on a step's loss); the final state to
    # 1e-5 abs + 1e-4 rel: Adam divides a near-zero gradient entry by its own root mean square, so a
    # rounding difference there moves the parameter by a share of the learning rate (measured once in
    # CI: 2.4e-6 on one of 16,384 entries of a 3-step run at lr up to 3e-3).
    assert_same_run(seen, plain_seen, offloaded, plain, rtol=1e-4, atol=1e-6, state_atol=1e-5)


def test_params_live_in_host_memory_between_steps(runs):
    """offload.params=host: the compiled step takes and returns the parameters in host memory (S(5)),
    the optimizer state on the device; bench's figures move exactly the parameters' bytes to host."""
    prog, compiled, state, _ = runs["params"]
    _, plain, _, _ = runs["none"]
    host, device = "pinned_host", jax.devices()[0].default_memory().kind
    assert kinds(state.params) == kinds(prog.state_shardings.params) == {host}
    assert kinds(state.opt_state) == {device}
    n_params = len(jax.tree.leaves(state.params))
    assert entry_layout(compiled).count("S(5)") == 2 * n_params
    param_bytes = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state.params))
    off, ref = metrics.compiled_memory(compiled), metrics.compiled_memory(plain)
    assert off["host_arguments"] == off["host_outputs"] == param_bytes > 0
    assert ref["arguments"] - off["arguments"] == param_bytes


def gpu_moves(cfg, **offload) -> tuple[step.Program, list[tuple[str, str]]]:
    """(program, [(memory kind, global shape 'AxB')] of every memory-space move in its train step)
    lowered for a GPU: XLA:CPU's lowering drops the moves inside a program, a GPU's keeps them."""
    prog = step.build_program(cfg.replace(offload=offload), mesh())
    tokens = jax.ShapeDtypeStruct((4, cfg.model.seq_len + 1), jnp.int32, sharding=prog.batch_sharding)
    with prog.activate():
        text = prog.train_step.fn.trace(prog.abstract_state, tokens).lower(lowering_platforms=("cuda",)).as_text()
    return prog, re.findall(r'_xla_buffer_placement = "(\w+)"\}\} : \(tensor<([\dx]+)xf32>', text)


def test_each_layer_is_fetched_inside_the_scan(cfg):
    """Each stacked layer matrix is brought to the device one layer slice at a time (a device
    placement of the per-layer shape), and its gradient slice stays on the device (no host placement of
    that shape: the gradients are taken with respect to device zeros beside the fetched copies)."""
    from collections import Counter

    prog, moves = gpu_moves(cfg, params="host")
    for name, leaf in jax.tree_util.tree_flatten_with_path(prog.abstract_state.params["blocks"])[0]:
        layer = "x".join(map(str, leaf.shape[1:]))  # global shape of one layer's slice
        assert ("device", layer) in moves, (name, layer)
    # What goes to host memory is the updated parameters, once each (the step's results), nothing else.
    results = Counter("x".join(map(str, a.shape)) for a in jax.tree.leaves(prog.abstract_state.params))
    assert Counter(shape for kind, shape in moves if kind == "pinned_host") == results


def test_offload_refusals(cfg):
    """One-line errors: the old key names the new one; reducers that keep per-replica state refuse."""
    from jaxdist import config
    from jaxdist.errors import JaxdistError

    with pytest.raises(JaxdistError, match=r"optim.offload was renamed offload.optimizer"):
        config.load(None, ["optim.offload=host"])
    bad = cfg.replace(offload=dict(params="host"), reduce=dict(method="powersgd"))
    with pytest.raises(JaxdistError, match=r"offload.params=host is not supported with reduce.method=powersgd"):
        step.build_program(bad, mesh_mod.mesh_from_string("dp=2", jax.devices()[:2]))


def test_resume_with_offload_on_or_off(runs, tmp_path):
    """A checkpoint saved with parameters (and nothing else) in host memory restores bitwise onto the
    same program without offload, and back: the layout is the same, only the memory kind differs."""
    from jaxdist import checkpoint
    from jaxdist.data import loader as loader_mod

    prog, _, state, _ = runs["params"]
    plain_prog = runs["none"][0]
    loader = loader_mod.Loader(prog.cfg, prog.batch_sharding)
    saver = checkpoint.Saver(tmp_path, prog.cfg, log=lambda *a: None)
    saver.save(state, STEPS, loader)
    saver.close()
    device = jax.devices()[0].default_memory().kind
    for target, kind in ((plain_prog, device), (prog, "pinned_host")):
        restored = checkpoint.restore(tmp_path, target, loader, target.cfg, log=lambda *a: None).state
        assert kinds(restored.params) == {kind}
        for x, y in zip(jax.tree.leaves(jax.device_get(state)), jax.tree.leaves(jax.device_get(restored)), strict=True):
            np.testing.assert_array_equal(x, y)


def test_activation_offload_moves_residuals_to_host(cfg):
    """offload.activations=host: the layer's saved matmul outputs (activation shapes, not parameter
    ones) go to pinned host memory and come back, in the program lowered for a GPU. (XLA:CPU strips
    memory spaces inside a program, so its temp cannot show the saving; measured once there, not
    asserted: 876,072 B, as model.remat=dots_saveable, vs 1,148,440 B without remat.)"""
    prog, moves = gpu_moves(cfg, activations="host")
    params = {"x".join(map(str, a.shape)) for a in jax.tree.leaves(prog.abstract_state.params)}
    params |= {"x".join(map(str, a.shape[1:])) for a in jax.tree.leaves(prog.abstract_state.params["blocks"])}
    to_host = {shape for kind, shape in moves if kind == "pinned_host"} - params
    assert to_host and all(("device", shape) in moves for shape in to_host)
    _, plain_moves = gpu_moves(cfg)
    assert "pinned_host" not in {kind for kind, _ in plain_moves}


def test_start_up_line_names_each_offload_and_its_bytes(cfg):
    """The start-up line's bytes are counted from the step (2 micro-batches: (2 + 1) x the parameters
    in, once out, and the optimizer state once each way)."""
    from jaxdist.observe import report

    assert report.offload_line(cfg, None) is None
    both = cfg.replace(offload=dict(optimizer="host", params="host"))
    prog = step.build_program(both, mesh())
    p, o = report.param_and_state_bytes(prog)
    line = next(x for x in report.summary_lines(both, prog, 1.0) if x.startswith("offload"))
    mib = lambda n: f"{n / 2**20:,.1f} MiB"
    assert line == (
        f"offload: optimizer=host, params=host, activations=none; per device per step {mib(3 * p + o)} "
        f"host->device, {mib(p + o)} device->host (counted from the step's moves)"
    )


@pytest.mark.parametrize("kind", ["none", "host", "params"])
def test_planner_predicts_the_device_arguments(runs, kind):
    """The planner's device arguments leave out what offload keeps in host memory: equal to the compiled
    step's device arguments (metrics.compiled_memory) within 1%, as for the planner's other pairs."""
    from jaxdist.planner import memory
    from jaxdist.planner.hardware import HARDWARE
    from jaxdist.planner.layout import Layout

    prog, compiled, _, _ = runs[kind]
    lay = Layout(prog.cfg, {a: int(n) for a, n in prog.mesh.shape.items()}, HARDWARE["cpu"])
    predicted = memory.estimate(lay)
    assert predicted.arguments == pytest.approx(metrics.compiled_memory(compiled)["arguments"], rel=0.01)
    assert (predicted.host > 0) == (kind != "none")


@pytest.fixture(scope="module")
def tp_runs(cfg, batches, init_shardings):
    """Parameter offload on a mesh with tensor parallelism: fsdp=2, tp=2 (needs 4 devices)."""
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices")
    on = mesh_mod.mesh_from_string("fsdp=2,tp=2", jax.devices()[:4])
    init = init_shardings[1]
    return {kind: train(cfg.replace(offload=dict(params=kind)), init, batches, on) for kind in ("none", "host")}


def test_params_offload_trains_identically_under_tp(tp_runs):
    """3 steps, 2 micro-batches, fsdp=2 x tp=2: every step's loss and gradient norm and the final state
    equal to 1e-6 relative with parameters in host memory or not (measured: bit-identical on this CPU)."""
    _, _, plain, plain_seen = tp_runs["none"]
    prog, _, offloaded, seen = tp_runs["host"]
    assert kinds(prog.state_shardings.params) == {"pinned_host"}
    assert_same_run(seen, plain_seen, offloaded, plain, rtol=1e-6, atol=1e-8)


TRANSFER_CASES = {
    "optimizer": dict(offload=dict(optimizer="host")),
    "params": dict(offload=dict(params="host")),
    "params, remat full": dict(offload=dict(params="host"), model=dict(remat="full")),
    "params, 1 micro-batch": dict(offload=dict(params="host"), train=dict(grad_accum_steps=1)),
    "params + optimizer, fsdp=2 x tp=2": dict(offload=dict(params="host", optimizer="host"), mesh="fsdp=2,tp=2"),
}


@pytest.mark.parametrize("case", list(TRANSFER_CASES))
def test_planner_predicts_the_counted_host_transfers(cfg, case):
    """The planner's host<->device bytes per device per step (jaxdist.planner.transfers) against those
    counted from the traced step's memory-space moves (jaxdist.distributed.offload.host_transfers), each direction
    within 1% either way. Measured: equal to the byte."""
    from jaxdist.planner import transfers
    from jaxdist.planner.hardware import HARDWARE
    from jaxdist.planner.layout import Layout

    over = dict(TRANSFER_CASES[case])
    text = over.pop("mesh", "fsdp=2")
    n = math.prod(int(part.split("=")[1]) for part in text.split(","))
    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} devices")
    c = cfg.replace(**over)
    prog = step.build_program(c, mesh_mod.mesh_from_string(text, jax.devices()[:n]))
    counted = offload.host_transfers(prog)
    lay = Layout(c, {a: int(k) for a, k in prog.mesh.shape.items()}, HARDWARE["cpu"])
    predicted = transfers.host_traffic(lay)
    assert counted["assumed_bytes"] == 0 and counted["host_to_device_bytes"] > 0
    assert predicted.host_to_device == pytest.approx(counted["host_to_device_bytes"], rel=0.01)
    assert predicted.device_to_host == pytest.approx(counted["device_to_host_bytes"], rel=0.01)


def test_counted_moves_are_the_gpu_lowering_placements(cfg):
    """Each move offload.host_transfers counts is a placement of the program lowered for a GPU (what
    XLA:GPU turns into copies; XLA:CPU strips them before partitioning): the host placements of float32
    arrays, by shape, are exactly the traced moves to host plus the results kept in host memory."""
    from collections import Counter

    from jaxdist.distributed import offload

    prog, placed = gpu_moves(cfg, params="host")
    tokens = jax.ShapeDtypeStruct((4, cfg.model.seq_len + 1), jnp.int32, sharding=prog.batch_sharding)
    with prog.activate():
        found = offload.moves(prog.train_step.fn.trace(prog.abstract_state, tokens).jaxpr.jaxpr)
    shape = lambda dims: "x".join(map(str, dims))
    to_host = Counter(shape(m.shape) for m in found if m.to_host)
    to_host += Counter(shape(a.shape) for a in jax.tree.leaves(prog.abstract_state.params))
    assert Counter(s for kind, s in placed if kind == "pinned_host") == to_host
    assert {shape(m.shape) for m in found if not m.to_host} <= {s for kind, s in placed if kind == "device"}


def test_a_carried_prefetch_would_keep_every_layer_on_the_device():
    """Why the layer scan does not prefetch layer i+1 through its carry: under remat a scan saves each
    iteration's carry for the backward, so the carried device copies of all L layers become a residual
    stack (L x D x D in device memory), where fetching inside the body saves only activations."""
    d, layers = 8, 4
    host = jax.ShapeDtypeStruct(
        (layers, d, d),
        jnp.float32,
        sharding=jax.sharding.NamedSharding(mesh(), jax.sharding.PartitionSpec(), memory_kind="pinned_host"),
    )
    x = jnp.ones((2, d))
    dev = lambda a: jax.device_put(a, jax.memory.Space.Device)
    remat = lambda f: jax.checkpoint(f, policy=jax.checkpoint_policies.nothing_saveable)

    def carried(w, x):
        def body(carry, w_next):
            x, w_now = carry
            return (jnp.tanh(x @ w_now), dev(w_next)), None

        return jax.lax.scan(remat(body), (x, dev(w[0])), jnp.roll(w, -1, axis=0))[0][0].sum()

    def fetched(w, x):
        return jax.lax.scan(remat(lambda x, w_i: (jnp.tanh(x @ dev(w_i)), None)), x, w)[0].sum()

    def saved(f):  # the forward scan's stacked outputs: what it keeps for the backward
        eqn = next(e for e in jax.jit(jax.grad(f)).trace(host, x).jaxpr.jaxpr.eqns if e.primitive.name == "scan")
        return [tuple(v.aval.shape) for v in eqn.outvars if len(v.aval.shape) == 3]

    assert saved(carried) == [(layers, 2, d), (layers, d, d)]
    assert saved(fetched) == [(layers, 2, d)]


def test_planner_keeps_the_fetched_layers_on_the_device_without_remat(cfg):
    """Without remat the backward keeps every fetched layer (no second fetch, as counted): the planner
    adds the layer stack to the device total; with a remat policy one layer at a time (nothing added)."""
    from jaxdist.distributed.mesh import parse_mesh
    from jaxdist.planner import memory, state_memory
    from jaxdist.planner.hardware import HARDWARE
    from jaxdist.planner.layout import Layout

    def planned(remat):
        c = cfg.replace(offload=dict(params="host"), model=dict(remat=remat))
        return memory.estimate(Layout(c, parse_mesh("fsdp=2", 2), HARDWARE["h100-80gb"]))

    lay = Layout(cfg, parse_mesh("fsdp=2", 2), HARDWARE["h100-80gb"])
    layers = state_memory.stored_bytes(lay, lambda g: g.role == "layer")
    none, full = planned("none"), planned("full")
    assert none.fetched == layers > 0 and full.fetched == 0
    assert none.total - none.compiled_temp - none.arguments == layers
