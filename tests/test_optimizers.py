"""The optimizer registry (jaxdist/optim/registry.py), Muon against torch.optim.Muon and across meshes,
Lion, and the WSD schedule against its formula.

Muon's reference is `torch.optim.Muon` through a committed fixture (scripts/fixtures/make_muon_fixture.py):
jaxdist's float32 Newton–Schulz matches torch's code run with a float32 Newton–Schulz to 1e-5 (absolute,
on parameters of size ~0.1, after 4 steps), and torch as shipped (bfloat16 Newton–Schulz) to 2e-3.
Across meshes: fsdp=8, tp=2×fsdp=4 and dp=2×fsdp=4 give the one-device run with 2 accumulated
micro-batches (losses to a relative 1e-5, Muon's matrices to 1e-5 of each tensor's largest entry,
AdamW's tensors to 1e-4). Combined, with the same tolerances against the same one-device run: Muon
with a pipeline (pp=2 × fsdp=4), with offload.optimizer=host and offload.params=host, with a
compressed reducer (dp=8, chunked top-k, error feedback, ratio 1), and LoRA + Muon on fsdp=8 against
LoRA + Muon on one device.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import learnable_batches, tokens_spec

from jaxdist import checkpoint, config
from jaxdist.checkpoint import compat
from jaxdist.config import OptimConfig, relative
from jaxdist.data import loader as loader_mod
from jaxdist.distributed import hlo, sharding
from jaxdist.distributed import mesh as mesh_mod
from jaxdist.distributed.mesh import parse_mesh
from jaxdist.errors import JaxdistError
from jaxdist.optim import adamw, muon, registry
from jaxdist.parallel import pipeline
from jaxdist.planner import comms, hardware, memory, optimizer_traffic
from jaxdist.planner.layout import Layout
from jaxdist.planner.traffic import by_kind
from jaxdist.reduce import registry as reducers
from jaxdist.training import rundir, step

FIXTURE = Path(__file__).parent / "fixtures" / "muon" / "torch_muon.npz"
# The fixture's tensors: logical names as jaxdist's model would give them.
NAMES = {
    "w_DF": ("embed", "mlp"),
    "w_FD": ("mlp", "embed"),
    "stack_LDF": ("layers", "embed", "mlp"),
    "wo_LNHD": ("layers", "heads", "head_dim", "embed"),
}


def test_registry_is_what_the_config_accepts():
    accepted = typing.get_args(typing.get_type_hints(OptimConfig)["name"])
    assert tuple(registry.OPTIMIZERS) == accepted
    with pytest.raises(JaxdistError, match="optim.name='sgd' is not one of adamw, muon, lion"):
        registry.entry(OptimConfig(name="sgd"))


def test_adamw_is_the_chain_it_always_was():
    """optim.name=adamw builds adamw.make_optimizer's chain: the same updates, bit for bit."""
    cfg = OptimConfig(warmup_steps=2)
    names = {"w": ("embed", "mlp"), "s": ("embed",)}
    params = {"w": jnp.linspace(-1, 1, 12).reshape(3, 4), "s": jnp.ones(4)}
    grads = jax.tree.map(lambda x: jnp.cos(x * 7), params)
    old, _ = adamw.make_optimizer(cfg, 10, 8, adamw.decay_mask(names))
    new, _ = registry.make(cfg, 10, 8, names)
    a, b = old.init(params), new.init(params)
    old_update, new_update = jax.jit(old.update), jax.jit(new.update)
    for _ in range(3):
        ua, a = old_update(grads, a, params)
        ub, b = new_update(grads, b, params)
        for x, y in zip(jax.tree.leaves(ua), jax.tree.leaves(ub)):
            assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


def test_default_run_names_do_not_change():
    """The keys the optimizer registry added (and every key added since) leave a run's folder name as it
    was: the hashes are the ones rundir.identity gave at 3df9193, before any of them existed."""
    added = ["optim.name", "optim.decay_fraction", "optim.decay_steps", "optim.decay_shape"]
    added += [f"optim.muon_{k}" for k in ("momentum", "nesterov", "ns_steps", "scale")]
    for cfg, before in ((config.load(None, []), "bef0e0b4"), (config.load("llama3-8b", ["optim.lr=1e-4"]), "c238dddd")):
        assert set(added) <= set(compat.flat(cfg.to_dict()))
        assert rundir.identity(cfg) == before
    assert rundir.identity(config.load(None, ["optim.decay_steps=7"])) == rundir.identity(config.load(None, []))
    assert rundir.identity(config.load(None, ["optim.name=muon"])) != rundir.identity(config.load(None, []))


def test_muon_takes_the_layer_matrices(small_cfg):
    """Per layer and per expert: the projections (and LoRA's adapters); AdamW: embeddings, head,
    norms, biases and the router."""
    cfg = small_cfg.replace(model=dict(moe_experts=4, qkv_bias=True, qk_norm=True))
    one = mesh_mod.mesh_from_string("fsdp=1", jax.devices()[:1])
    model = step.resolve(cfg, one, sharding.make_rules(cfg.mesh.rules))
    labels = {muon.path_key(p): v for p, v in jax.tree_util.tree_flatten_with_path(muon.labels(model.names))[0]}
    takes = sorted(k for k, v in labels.items() if v == "muon")
    assert takes == [
        f"blocks/{k}"
        for k in ["attn/wk_DKH", "attn/wo_NHD", "attn/wq_DNH", "attn/wv_DKH"]
        + ["mlp/w_down_EFD", "mlp/w_gate_EDF", "mlp/w_up_EDF"]
    ], takes
    assert {"embed_VD", "head_DV", "final_norm/scale", "blocks/mlp/router_DE", "blocks/attn/bq_NH"} <= {
        k for k, v in labels.items() if v == "adamw"
    }
    assert muon.matrix_axes("blocks/mlp/w_up_EDF", ("layers", "expert", "embed", "mlp")) == ((0, 1), (2,), (3,))
    assert muon.matrix_axes("blocks/attn/wo_NHD", ("layers", "heads", "head_dim", "embed")) == ((0,), (1, 2), (3,))
    lora = small_cfg.replace(lora=dict(rank=4))
    names = step.trained_part(lora, step.resolve(lora, one, sharding.make_rules(lora.mesh.rules)).names)
    assert set(jax.tree.leaves(muon.labels(names))) == {"muon"}  # every adapter is a matrix per layer


def _muon_run(scale: str, nesterov: bool, data):
    cfg = OptimConfig(name="muon", weight_decay=0.1, muon_scale=scale, muon_nesterov=nesterov, clip_norm=0.0)
    lr, wd, steps = data["lr_wd_steps"]
    tx = muon.muon(cfg, float(lr), NAMES, optax.adamw(float(lr)))
    params = {k: jnp.asarray(data[f"param0/{k}"]) for k in NAMES}
    state, out = tx.init(params), []
    step_fn = jax.jit(lambda g, s, p: (lambda u, s: (optax.apply_updates(p, u), s))(*tx.update(g, s, p)))
    for t in range(int(steps)):
        params, state = step_fn({k: jnp.asarray(data[f"grad{t}/{k}"]) for k in NAMES}, state, params)
        out.append(params)
    return out


@pytest.mark.parametrize("scale", ["match_rms_adamw", "original"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_matches_torch(scale, nesterov):
    """jaxdist's Muon = torch.optim.Muon, step for step (weights transposed: torch's are (out, in))."""
    data = np.load(FIXTURE)
    case = f"{scale}/{'nesterov' if nesterov else 'plain'}"
    worst = {"f32": 0.0, "bf16": 0.0}
    for t, params in enumerate(_muon_run(scale, nesterov, data)):
        for k in NAMES:
            moved = np.abs(data[f"{case}/f32/step{t}/{k}"] - data[f"param0/{k}"]).max()
            assert moved > 3e-3  # each step moves the weights far more than the tolerance
            for ns in worst:
                worst[ns] = max(
                    worst[ns], float(np.abs(np.asarray(params[k]) - data[f"{case}/{ns}/step{t}/{k}"]).max())
                )
    assert worst["f32"] < 1e-5, worst
    assert worst["bf16"] < 2e-3, worst


def test_optax_contrib_muon_is_not_torchs():
    """Why jaxdist has its own transformation: optax.contrib.muon's bias-corrected Nesterov leaves
    torch.optim.Muon's direction after the first step (the docstring of jaxdist/optim/muon.py)."""
    data = np.load(FIXTURE)
    dims = {k: optax.contrib.MuonDimensionNumbers(reduction_axis=(-2,), output_axis=(-1,)) for k in ["w_DF"]}
    tx = optax.contrib.muon(0.02, weight_decay=0.1, consistent_rms=0.2, muon_weight_dimension_numbers=dims)
    params = {"w_DF": jnp.asarray(data["param0/w_DF"])}
    state = tx.init(params)
    for t in range(2):
        updates, state = tx.update({"w_DF": jnp.asarray(data[f"grad{t}/w_DF"])}, state, params)
        params = optax.apply_updates(params, updates)
        gap = np.abs(np.asarray(params["w_DF"]) - data[f"match_rms_adamw/nesterov/f32/step{t}/w_DF"]).max()
        assert (gap < 1e-5) if t == 0 else (gap > 1e-4), (t, gap)


# ---------------------------------------------------------------------------------------------------
# WSD


def _formula(t, peak, end, warm, total, decay, shape):
    """Hand-written: linear warm-up (peak/warm at step 0, peak at warm - 1), the peak, then the decay."""
    if t < warm:
        return peak * (t + 1) / warm
    start = total - decay
    if t < start:
        return peak
    p = min((t - start) / decay, 1.0)
    f = {"linear": 1 - p, "cosine": 0.5 * (1 + math.cos(math.pi * p)), "sqrt": 1 - math.sqrt(p)}[shape]
    return end + (peak - end) * f


@pytest.mark.parametrize("shape", ["linear", "cosine", "sqrt"])
def test_wsd_is_its_formula_at_every_phase_boundary(shape):
    cfg = OptimConfig(
        lr=1e-3, schedule="wsd", warmup_steps=10, decay_fraction=0.25, decay_shape=shape, min_lr_ratio=0.1
    )
    total, decay = 100, 25
    lr = adamw.schedule(cfg, total, 8)
    for t in [0, 1, 8, 9, 10, 11, 50, 74, 75, 76, 80, 87, 98, 99, 100, 150]:
        assert float(lr(t)) == pytest.approx(_formula(t, 1e-3, 1e-4, 10, total, decay, shape), rel=1e-6, abs=1e-12), t
    # A longer run (--steps 200) is the same schedule until its own decay: the stable phase continues.
    longer = adamw.schedule(cfg, 200, 8)
    assert all(float(longer(t)) == float(lr(t)) for t in range(0, 75))
    assert float(longer(120)) == pytest.approx(1e-3) and float(lr(120)) == pytest.approx(1e-4)
    # A cool-down from step 60: --steps 80 optim.decay_steps=20 decays over 60..80.
    cool = adamw.schedule(dataclasses.replace(cfg, decay_steps=20), 80, 8)
    assert [float(cool(t)) for t in (59, 60)] == pytest.approx([1e-3, 1e-3])
    assert float(cool(70)) == pytest.approx(_formula(70, 1e-3, 1e-4, 10, 80, 20, shape), rel=1e-6)


def test_wsd_resume_notes():
    """Extending a WSD run in its stable phase says nothing (the LR is unchanged); a cool-down says
    where the decay now runs."""
    cfg = config.load(None, ["optim.schedule=wsd", "optim.warmup_steps=5", "train.steps=200"])
    assert adamw.schedule_notes(cfg, 50, {"train.steps": (100, 200)}) == []
    cool = cfg.replace(train=dict(steps=120), optim=dict(decay_steps=20))
    notes = adamw.schedule_notes(cool, 100, {"train.steps": (200, 120), "optim.decay_steps": (0, 20)})
    assert notes == [
        "note: optim.decay_steps changed: the LR now decays (linear) over steps 100..120 to 0.1 x its peak"
    ]
    assert "wsd decay to 0.1 x lr over the last 40 steps from step 160 (optim.decay_fraction=0.2, linear)" in (
        relative.cadence_line(cfg)
    )
    cosine = cfg.replace(optim=dict(schedule="cosine"))
    assert adamw.schedule_notes(cosine, 50, {"train.steps": (100, 200)})  # cosine's LR moves: said


# ---------------------------------------------------------------------------------------------------
# Composition with the reducers


@pytest.mark.parametrize("method", ["demo", "topk"])
def test_reducers_with_their_own_update_refuse_another_optimizer(method):
    cfg = config.load(None, [f"reduce.method={method}", "optim.name=muon"])
    with pytest.raises(JaxdistError, match=f"optim.name=muon with reduce.method={method}: that method applies") as e:
        reducers.check(cfg, mesh_mod.mesh_from_string("dp=8"))
    assert "\n" not in str(e.value)
    reducers.check(cfg.replace(reduce=dict(method="topk", topk=dict(dgc="off"))), mesh_mod.mesh_from_string("dp=8"))
    reducers.check(cfg.replace(optim=dict(name="adamw")), mesh_mod.mesh_from_string("dp=8"))


# ---------------------------------------------------------------------------------------------------
# Muon across meshes, resume, any-mesh restore

STEPS = 4
MESHES = ["fsdp=8", "tp=2,fsdp=4", "dp=2,fsdp=4"]
# Muon combined with the other features, each against the same one-device run: a pipeline (the stage
# axis: each stage's stack of matrices is a matrix per layer), the optimizer state and the parameters
# in host memory, and a compressed reducer (chunked top-k keeping every entry: the codec's path, with
# its error-feedback state, delivering the exact mean).
COMBINED = {
    "pp=2,fsdp=4": ("pp=2,fsdp=4", dict(pipeline=dict(microbatches=2))),
    "offload=host": ("fsdp=8", dict(offload=dict(optimizer="host", params="host"))),
    "topk ratio=1": ("dp=8", dict(reduce=dict(method="topk", topk=dict(dgc="off"), ratio=1.0, warmup_fraction=0.0))),
}
LORA = dict(lora=dict(rank=4))  # Muon on the adapters (every one a matrix per layer), against LoRA on one device
COMBINED["lora"] = ("fsdp=8", LORA)


@pytest.fixture(scope="module")
def muon_cfg(small_cfg):
    # 4 layers: the stack divides over dp=2 x fsdp=4's fsdp (Newton-Schulz on whole matrices split over
    # fsdp), not over fsdp=8 nor fsdp x tp (whole matrices gathered): both of muon.spread's layouts.
    muon = dict(name="muon", warmup_steps=1, lr=3e-3)
    return small_cfg.replace(model=dict(num_layers=4), train=dict(steps=STEPS), optim=muon)


@pytest.fixture(scope="module")
def muon_runs(muon_cfg):
    """mesh -> (program, state after STEPS steps, loss curve); the reference: one device, 2 micro-batches."""
    batches, runs = learnable_batches(muon_cfg, STEPS), {}
    cases = {"one": ("fsdp=1", jax.devices()[:1], 2, {}), **{m: (m, None, 1, {}) for m in MESHES}}
    cases.update({k: (text, None, 1, over) for k, (text, over) in COMBINED.items()})
    cases["lora one"] = ("fsdp=1", jax.devices()[:1], 2, LORA)  # LoRA's own one-device reference
    initial = None  # the one-device run's step-0 state on the host: the plain meshes start from it
    for key, (text, devices, accum, over) in cases.items():
        cfg = muon_cfg.replace(train=dict(grad_accum_steps=accum), **over)
        prog = step.build_program(cfg, mesh_mod.mesh_from_string(text, devices))
        compiled = prog.train_step.lower(prog.abstract_state, tokens_spec(prog)).compile()
        if key in MESHES:  # placed, not initialised again: one init program fewer per mesh (~1 CPU-s each)
            state, curve = jax.device_put(initial, prog.state_shardings), []
        else:
            state, curve = prog.init_state(0), []
        if key == "one":
            initial = jax.device_get(state)
        for b in batches:
            state, m = compiled(state, jax.device_put(b, prog.batch_sharding))
            curve.append(float(m["loss"]))
        runs[key] = (prog, state, curve, compiled)
    return runs


@pytest.mark.parametrize("mesh_text", MESHES + list(COMBINED))
def test_muon_matches_single_device(muon_runs, mesh_text):
    ref_prog, ref_state, ref_curve, _ = muon_runs["lora one" if mesh_text == "lora" else "one"]
    prog, state, curve, _ = muon_runs[mesh_text]
    np.testing.assert_allclose(curve, ref_curve, rtol=1e-5)
    assert curve[-1] < curve[0]
    # Muon's matrices to 1e-5 of each tensor's largest entry; AdamW's tensors (the embedding: a rare
    # token's row moves by ~lr·sign of a near-zero gradient, which summation order can flip) to 1e-4.
    params, ref = jax.device_get(state.params), jax.device_get(ref_state.params)
    if prog.pipeline is not None:  # the stack by stage -> the model's layer order
        params = pipeline.from_stages(params, prog.pipeline)
    params, ref = step.trained_part(prog.cfg, params), step.trained_part(ref_prog.cfg, ref)  # LoRA: the adapters
    labels = jax.tree.leaves(muon.labels(step.trained_part(ref_prog.cfg, ref_prog.model.names)))
    params, ref = jax.tree.leaves(params), jax.tree.leaves(ref)
    for a, r, label in zip(params, ref, labels, strict=True):
        np.testing.assert_allclose(a, r, atol=(1e-5 if label == "muon" else 1e-4) * np.abs(r).max(), rtol=0)
    mu = jax.tree.leaves(state.opt_state)
    assert any(x.ndim and float(jnp.abs(x).max()) > 0 for x in mu)


@pytest.mark.parametrize("mesh_text", MESHES)
def test_planner_predicts_muons_memory_and_collectives(muon_runs, mesh_text):
    """The planner's argument bytes (Muon's state: one momentum per matrix entry, AdamW's two elsewhere)
    and collective bytes per kind (Muon's all-to-alls or gathers, planner/optimizer_traffic.py) are the
    compiled step's."""
    prog, _, _, compiled = muon_runs[mesh_text]
    lay = Layout(prog.cfg, parse_mesh(mesh_text, 8), hardware.get("cpu"))
    assert memory.estimate(lay).arguments == compiled.memory_analysis().argument_size_in_bytes
    measured = {k: v["bytes"] for k, v in hlo.summarize(hlo.collectives(compiled.as_text())).items()}
    predicted = by_kind(comms.step_traffic(lay))
    assert set(predicted) == set(measured)
    for kind, sent in measured.items():  # scalar all-reduces (loss, norms) are not modelled: <= 300 bytes
        assert predicted[kind] == pytest.approx(sent, abs=300), kind
    moved = sum(t.bytes for t in optimizer_traffic.optimizer_traffic(lay))
    assert moved > 0.1 * predicted["all-to-all" if mesh_text == "dp=2,fsdp=4" else "all-gather"]


def test_muon_state_is_sharded_like_its_parameters(muon_runs):
    prog, state, _, _ = muon_runs["fsdp=8"]
    momentum = state.opt_state[1].inner_states["muon"].inner_state[0].mu
    wq = momentum["blocks"]["attn"]["wq_DNH"]
    assert wq.sharding == state.params["blocks"]["attn"]["wq_DNH"].sharding
    assert isinstance(momentum["embed_VD"], optax.MaskedNode)  # the embedding's moments are AdamW's


def test_muon_resumes_bit_exact_and_restores_on_another_mesh(muon_runs, tmp_path):
    prog, state, _, _ = muon_runs["fsdp=8"]
    saved = [np.asarray(x).tobytes() for x in jax.tree.leaves(state)]
    loader = loader_mod.Loader(prog.cfg, prog.batch_sharding)
    saver = checkpoint.Saver(tmp_path, prog.cfg, log=lambda *a: None)
    saver.save(state, STEPS, loader)
    saver.close()
    restored = checkpoint.restore(tmp_path, prog, loader, prog.cfg).state
    for x, y, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored), saved):
        assert x.sharding == y.sharding and np.asarray(y).tobytes() == b
    batch = next(loader)
    (a, _), (b, _) = prog.train_step(jax.tree.map(lambda x: x.copy(), state), batch), prog.train_step(restored, batch)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
    other, _, _, _ = muon_runs["tp=2,fsdp=4"]
    moved = checkpoint.restore(tmp_path, other, loader_mod.Loader(other.cfg, other.batch_sharding), other.cfg).state
    for y, b, s in zip(jax.tree.leaves(moved), saved, jax.tree.leaves(other.state_shardings)):
        assert y.sharding == s and np.asarray(y).tobytes() == b


def test_lion_is_its_formula_and_keeps_one_moment(small_cfg):
    """optim.name=lion (optax.lion, Chen et al. 2023): the clipped gradient's update is
    -lr·(sign(b1·m + (1 − b1)·g) + wd·w) with m ← b2·m + (1 − b2)·g, decay on matrices only; its
    state is one momentum per parameter (what the planner counts)."""
    cfg = small_cfg.replace(optim=dict(name="lion", schedule="constant", warmup_steps=0, lr=1e-3, clip_norm=1.0))
    names = {"w": ("embed", "mlp"), "s": ("embed",)}
    params = {"w": jnp.linspace(-1, 1, 12).reshape(3, 4), "s": jnp.linspace(0.5, 1, 4)}
    tx, _ = registry.make(cfg.optim, 10, 8, names)
    state, m, o = tx.init(params), jax.tree.map(jnp.zeros_like, params), cfg.optim
    for t in range(3):
        grads = {k: jnp.sin(x * (t + 3)) for k, x in params.items()}
        clip = jnp.minimum(1.0, o.clip_norm / optax.tree.norm(grads))
        g = {k: x * clip for k, x in grads.items()}
        want = {
            k: -o.lr * (jnp.sign(o.b1 * m[k] + (1 - o.b1) * g[k]) + (o.weight_decay * params[k] if k == "w" else 0))
            for k in params
        }
        m = jax.tree.map(lambda a, b: o.b2 * a + (1 - o.b2) * b, m, g)
        updates, state = tx.update(grads, state, params)
        for k in params:
            np.testing.assert_allclose(updates[k], want[k], rtol=1e-6, atol=1e-9)
        params = optax.apply_updates(params, updates)
    prog = step.build_program(cfg, mesh_mod.mesh_from_string("fsdp=8"))  # traced, not compiled
    trained = sum(x.size for x in jax.tree.leaves(prog.abstract_state.params))
    assert sum(x.size for x in jax.tree.leaves(prog.abstract_state.opt_state) if x.ndim) == trained
