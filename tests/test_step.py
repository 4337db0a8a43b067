"""Equivalence: every mesh computes the loss, gradients and 10-step curve of the single-device run.

Tolerance: fp32 on CPU; only the order of reductions differs, so each gradient tensor matches to
1e-5 of its largest entry and losses to a relative 1e-5.
"""

import jax
import numpy as np
import pytest
from conftest import learnable_batches, tokens_spec

from jaxdist.distributed import mesh as mesh_mod
from jaxdist.training import step

SMALL = dict(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128, seq_len=32)
MESHES = ["dp=8", "fsdp=8", "tp=2,fsdp=4", "dp=2,fsdp=2,tp=2"]
STEPS = 10


@pytest.fixture(scope="module")
def cfg(tiny_cfg):
    return tiny_cfg.replace(model=SMALL, train=dict(steps=STEPS), optim=dict(warmup_steps=2, lr=1e-3))


@pytest.fixture(scope="module")
def batches(cfg):
    return learnable_batches(cfg, STEPS)


def compile_step(prog, cfg):
    return prog.train_step.lower(prog.abstract_state, tokens_spec(prog)).compile()


def loss_grads_and_curve(cfg, mesh, batches):
    prog = step.build_program(cfg, mesh)
    state = prog.init_state(0)
    put = lambda b: jax.device_put(b, prog.batch_sharding)
    grads_fn = jax.jit(lambda p, t: prog.gradients.apply(p, t, (), 0)[:2])
    with prog.activate():
        grads, loss = grads_fn(state.params, put(batches[0]))
    grads = jax.device_get(grads)
    if len(batches) == 1:
        return float(loss), grads, None, None
    compiled = compile_step(prog, cfg)
    curve = []
    for b in batches:
        state, m = compiled(state, put(b))
        curve.append(float(m["loss"]))
    RESULTS[str(mesh.shape)] = (prog, compiled)
    return float(loss), grads, curve, jax.device_get(state.params)


RESULTS = {}  # mesh -> (program, compiled step), reused by later tests to avoid recompiling


def fsdp8(cfg):
    key = str(mesh_mod.mesh_from_string("fsdp=8").shape)
    if key not in RESULTS:
        prog = step.build_program(cfg, mesh_mod.mesh_from_string("fsdp=8"))
        RESULTS[key] = (prog, compile_step(prog, cfg))
    return RESULTS[key]


@pytest.fixture(scope="module")
def reference(cfg, batches):
    return loss_grads_and_curve(cfg, mesh_mod.mesh_from_string("fsdp=1", jax.devices()[:1]), batches)


@pytest.mark.parametrize("mesh_text", MESHES)
def test_matches_single_device(cfg, batches, reference, mesh_text):
    ref_loss, ref_grads, ref_curve, ref_params = reference
    loss, grads, curve, params = loss_grads_and_curve(cfg, mesh_mod.mesh_from_string(mesh_text), batches)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, r, atol=1e-5 * np.abs(r).max(), rtol=0)
    np.testing.assert_allclose(curve, ref_curve, rtol=1e-5)
    assert curve[-1] < curve[0]  # it learns


def test_microbatches_match_full_batch(cfg, batches, reference):
    """Token-weighted accumulation over 4 micro-batches gives the full-batch loss and gradients."""
    ref_loss, ref_grads, _, _ = reference
    loss, grads, _, _ = loss_grads_and_curve(
        cfg.replace(train=dict(grad_accum_steps=4, steps=1)),
        mesh_mod.mesh_from_string("dp=2,fsdp=1,tp=1", jax.devices()[:2]),
        batches[:1],
    )
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, r, atol=1e-5 * np.abs(r).max(), rtol=0)


def test_fsdp_shards_parameters_and_optimizer(cfg):
    """Compiled argument bytes under fsdp=8 are 1/8 of the state (plus the batch shard and scalars), but for
    the norm scales and their moments, which the default `norm` rule replicates."""
    prog, compiled = fsdp8(cfg)
    args = compiled.memory_analysis().argument_size_in_bytes
    leaves = jax.tree_util.tree_leaves_with_path(prog.abstract_state)
    state_bytes = sum(x.size * x.dtype.itemsize for _, x in leaves)
    scalars = sum(x.dtype.itemsize for _, x in leaves if x.ndim == 0)
    norms = sum(x.size * x.dtype.itemsize for p, x in leaves if x.ndim and "norm" in jax.tree_util.keystr(p))
    batch_shard = cfg.train.global_batch * (cfg.model.seq_len + 1) * 4 // 8
    assert norms and args == (state_bytes - scalars - norms) // 8 + norms + scalars + batch_shard


def test_non_finite_step_is_skipped(cfg, batches):
    prog, compiled = fsdp8(cfg)
    state = prog.init_state(0)
    before = jax.device_get(state.params)
    poisoned = np.full_like(batches[0], cfg.model.vocab_size)  # out-of-vocabulary ids: NaN embeddings
    state, m = compiled(state, jax.device_put(poisoned, prog.batch_sharding))
    assert int(m["skipped"]) == 1 and int(state.skipped) == 1 and int(state.step) == 1
    for a, b in zip(jax.tree.leaves(jax.device_get(state.params)), jax.tree.leaves(before)):
        np.testing.assert_array_equal(a, b)
    state, m = compiled(state, jax.device_put(batches[0], prog.batch_sharding))
    assert int(m["skipped"]) == 0 and int(state.skipped) == 0


def test_parameter_init_is_one_program_per_model_and_mesh(cfg):
    """init_state draws the parameters in a program that depends on the model, the mesh and the seed
    only (another optimizer's run finds it in the compilation cache), in their shards, the parameters one
    device draws (to 1e-6: another program); the state around them is the optimizer's zeros."""
    prog, _ = fsdp8(cfg)
    made = []
    with pytest.MonkeyPatch.context() as m:  # build_program draws its parameters with model_init
        m.setattr(step, "model_init", lambda *a, real=step.model_init: made.append(a) or real(*a))
        lion = step.build_program(cfg.replace(optim=dict(name="lion")), prog.mesh)
    assert len(made) == 1

    def init_text(p):
        with p.activate():
            return step.model_init(p.cfg, p.model, p.state_shardings.params).lower(0).as_text()

    assert init_text(lion) == init_text(prog)
    state = prog.init_state(0)
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    alone = jax.jit(lambda: prog.model.init_params(cfg, 0), out_shardings=one_device)()
    assert jax.tree.map(lambda a: a.sharding, state.params) == prog.state_shardings.params
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(alone), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=0)
    assert not any(np.asarray(m).any() for m in jax.tree.leaves(state.opt_state))
