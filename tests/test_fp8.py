"""model.fp8 (jaxdist/parallel/fp8.py, matmul.fp8_weight_matmul): the FP8 matmul against a numpy emulation
of the same quantise-scale-multiply (ml_dtypes' float8 types), forward and backward; the compiled step's
FP8 converts and FP8 all-gathers; the same loss and gradients on one device and sharded; the refusals."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import MICRO_MODEL, compiled_gradients, learnable_batches

from jaxdist.distributed import hlo
from jaxdist.distributed import mesh as mesh_mod
from jaxdist.distributed.sharding import make_rules
from jaxdist.errors import JaxdistError
from jaxdist.objectives import refusals
from jaxdist.parallel import matmul
from jaxdist.training import step

E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2


def quantize(a, dtype, axis):
    """numpy's q * scale: scale = amax / dtype's max over `axis` (kept), q rounded to `dtype`."""
    amax = np.max(np.abs(a), axis=axis, keepdims=True)
    top = np.float32(ml_dtypes.finfo(dtype).max)
    scale = np.where(amax > 0, amax / top, np.float32(1)).astype(np.float32)
    return np.clip(a / scale, -top, top).astype(dtype).astype(np.float32), scale


@pytest.mark.parametrize("mode", ["tensorwise", "rowwise"])
def test_fp8_matmul_equals_a_numpy_emulation(mode):
    """y = x @ w, dx = g @ w^T, dw = x^T @ g, each a dot of quantised operands (e4m3 forward, e5m2 for g)
    times the scales: per tensor, or per row of what the dot keeps. Measured: tensorwise 0 / 0 / 5.9e-9,
    rowwise 2.1e-7 / 2.4e-7 / 1.9e-7 of the largest entry (float32 summation order); bound 1e-6. Against
    float32 matmuls the error is ~4% (e4m3 keeps 3 mantissa bits): the emulation is what is compared."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 8, 32)).astype(np.float32)
    w = (rng.standard_normal((32, 4, 8)) * 0.1).astype(np.float32)
    g = rng.standard_normal((2, 8, 4, 8)).astype(np.float32)

    def f(x, w):
        with matmul.fp8_matmuls(mode):
            return matmul.weight_matmul(x, w, ("embed", "heads", "head_dim"))

    y, vjp = jax.vjp(f, jnp.asarray(x), jnp.asarray(w))
    dx, dw = vjp(jnp.asarray(g))
    per = mode == "rowwise"
    x2, w2, g2 = x.reshape(16, 32), w.reshape(32, 32), g.reshape(16, 32)
    xq, sx = quantize(x2, E4M3, 1 if per else None)
    wq, sw = quantize(w2, E4M3, 0 if per else None)
    want_y = (xq @ wq) * sx * sw
    gq, sg = quantize(g2, E5M2, 1 if per else None)
    wq, sw = quantize(w2, E4M3, 1 if per else None)
    want_dx = (gq @ wq.T) * sg * sw.reshape(1, -1)
    xq, sx = quantize(x2, E4M3, 0 if per else None)
    gq, sg = quantize(g2, E5M2, 0 if per else None)
    want_dw = (xq.T @ gq) * sx.reshape(-1, 1) * sg
    for got, want in ((y, want_y), (dx, want_dx), (dw, want_dw)):
        got = np.asarray(got).reshape(want.shape)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())
    # and it is FP8: float32 operands would be ~4% away from the emulation
    assert np.abs(x2 @ w2 - want_y).max() > 1e-2 * np.abs(want_y).max()


@pytest.fixture(scope="module")
def fp8_cfg(tiny_cfg):
    return tiny_cfg.replace(
        model=dict(MICRO_MODEL, num_layers=2, num_kv_heads=2, fp8="tensorwise"), train=dict(steps=1, global_batch=8)
    )


def program(cfg, mesh_text, n):
    return step.build_program(cfg, mesh_mod.mesh_from_string(mesh_text, jax.devices()[:n]))


@pytest.fixture(scope="module")
def gradients(fp8_cfg):
    """(mode, mesh) -> (loss, gradients, compiled program) from the one-device run's initial params; memoised."""
    cache, params, batch = {}, None, learnable_batches(fp8_cfg, 1)[0]

    def get(mode, mesh_text):
        nonlocal params
        if (mode, mesh_text) not in cache:
            n = 1 if mesh_text == "fsdp=1" else 8
            prog = program(fp8_cfg.replace(model=dict(fp8=mode)), mesh_text, n)
            params = jax.device_get(prog.init_state(0).params) if params is None else params
            compiled = compiled_gradients(prog)
            grads, loss = compiled(
                jax.device_put(params, prog.state_shardings.params), jax.device_put(batch, prog.batch_sharding)
            )
            cache[mode, mesh_text] = float(loss), jax.device_get(grads), compiled
        return cache[mode, mesh_text]

    return get


@pytest.mark.parametrize("mode, mesh_text", [("tensorwise", "fsdp=8"), ("rowwise", "fsdp=4,tp=2")])
def test_fp8_loss_and_gradients_equal_on_one_device_and_sharded(gradients, mode, mesh_text):
    """Sharded against one device, same FP8 mode: the scales are global amaxes (a max across shards), so
    the quantised operands are the same and only float32 summation order differs — unless it moves a
    value across an FP8 rounding boundary (e4m3's steps are 1/8 to 1/16 of a value). Measured: loss
    2.6e-7 / 1.7e-7 relative, gradients 6.0e-7 / 4.2e-3 of the largest entry (tensorwise on fsdp=8 /
    rowwise on fsdp=4,tp=2, where one row crossed a boundary). Bound: loss 1e-5, gradients 1e-2."""
    ref_loss, ref_grads, _ = gradients(mode, "fsdp=1")
    loss, grads, _ = gradients(mode, mesh_text)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, r, rtol=0, atol=1e-2 * np.abs(r).max())


def test_the_compiled_step_gathers_weights_quantised_and_converts_gradients_to_e5m2(fp8_cfg, gradients):
    """fsdp=8, no remat: each layer's 7 matrices are gathered in the forward and again in the backward
    (14 gathers per layer, as with model.fp8=off), each quantised to f8e4m3fn on its shard first. XLA:CPU
    has no FP8 collectives and widens them to f16 around the gather (the convert it adds carries no jax
    metadata), so on CPU they move 2 bytes per entry, half of float32's; on a GPU, 1 byte
    (scripts/gpu_check.sh reads it). The backward converts the gradient to f8e5m2."""
    text = gradients("tensorwise", "fsdp=8")[2].as_text()
    layer_gathers = [  # inside the layer scan (once per layer: count 2), the matrices (not the norms)
        c for c in hlo.collectives(text) if c.kind == "all-gather" and c.count == 2 and c.full_bytes >= 1024
    ]
    assert [c.line.split("=", 1)[1].split("[", 1)[0].strip() for c in layer_gathers] == ["f16"] * 14
    m = fp8_cfg.model
    entries = m.d_model * m.head_dim * (2 * m.num_heads + 2 * m.num_kv_heads) + 3 * m.d_model * m.mlp_dim
    assert sum(c.full_bytes for c in layer_gathers) == 2 * 2 * entries  # 2 passes x 2 bytes
    assert "f8e4m3fn" in text and "f8e5m2" in text


@pytest.mark.parametrize(
    "overrides, sizes, message",
    [
        ({"model": {"moe_experts": 4}}, {"fsdp": 8}, "model.fp8=tensorwise with model.moe_experts > 0"),
        ({"lora": {"rank": 4}}, {"fsdp": 8}, "model.fp8=tensorwise with lora.rank > 0"),
        ({}, {"cp": 2, "fsdp": 4}, "model.fp8=tensorwise with cp > 1"),
        ({"model": {"fp8": "mxfp8", "mlp_dim": 48}}, {"fsdp": 8}, "model.fp8=mxfp8 scales blocks of 32"),
    ],
    ids=["moe", "lora", "cp", "mxfp8 inner dims"],
)
def test_fp8_refusals_are_one_line(fp8_cfg, overrides, sizes, message):
    with pytest.raises(JaxdistError, match=message.replace(".", r"\.").replace("+", r"\+")):
        refusals.check_sizes(fp8_cfg.replace(**overrides), sizes)


def test_mxfp8_is_refused_on_devices_without_it(fp8_cfg):
    """Block-scaled FP8 needs Blackwell (compute capability 10.0+); on this CPU the trainer says so. The
    planner (an abstract mesh: no devices) sizes it without refusing."""
    cfg = fp8_cfg.replace(model=dict(fp8="mxfp8"))
    refusals.check_sizes(cfg, {"fsdp": 8})
    with pytest.raises(JaxdistError, match=r"model\.fp8=mxfp8 needs block-scaled FP8 matmuls in hardware.* cpu"):
        refusals.check(cfg, mesh_mod.mesh_from_string("fsdp=8", jax.devices()[:8]), make_rules(cfg.mesh.rules))
