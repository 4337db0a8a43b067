"""model.fp8 (jaxdist/parallel/fp8.py, matmul.fp8_weight_matmul, fp8_experts.py): the FP8 matmul and the
experts' FP8 SwiGLU against a numpy emulation of the same quantise-scale-multiply (ml_dtypes' float8
types), forward and backward; the compiled step's FP8 converts and FP8 all-gathers, and the experts'
chunk loop's; the same loss and gradients on one device and sharded (dense; MoE over ep, fsdp); an FP8
MoE trained near bf16; the refusals."""

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
    float32 matmuls the error is ~4% (e4m3 keeps 3 mantissa bits): the emulation is what is compared.
    LoRA's frozen base (fp8_frozen_matmul): the same y and dx, to the same bound, and a zero dw."""
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

    def frozen(x, w):  # LoRA's frozen base: the same forward and input gradient, no weight gradient
        with matmul.fp8_matmuls(mode):
            return matmul.fp8_frozen_matmul(x, w, ("embed", "heads", "head_dim"), 1, per)

    fy, fvjp = jax.vjp(frozen, jnp.asarray(x), jnp.asarray(w))
    fdx, fdw = fvjp(jnp.asarray(g))
    assert not np.asarray(fdw).any()
    for got, want in ((y, want_y), (dx, want_dx), (dw, want_dw), (fy, want_y), (fdx, want_dx)):
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
    """(mode, mesh, LoRA rank) -> (loss, gradients, compiled program) from the one-device run's initial
    params (per rank: LoRA's are the adapters'); memoised."""
    cache, params, batch = {}, {}, learnable_batches(fp8_cfg, 1)[0]

    def get(mode, mesh_text, lora=0):
        if (mode, mesh_text, lora) not in cache:
            n = 1 if mesh_text == "fsdp=1" else 8
            prog = program(fp8_cfg.replace(model=dict(fp8=mode), lora=dict(rank=lora, alpha=8.0)), mesh_text, n)
            if lora not in params:
                params[lora] = jax.device_get(prog.init_state(0).params)
                if lora:  # B starts at 0, which would leave A's gradients 0: give B values
                    params[lora] = jax.tree_util.tree_map_with_path(
                        lambda p, v: v + 0.05 if "_lora_b" in jax.tree_util.keystr(p) else v, params[lora]
                    )
            compiled = compiled_gradients(prog)
            grads, loss = compiled(
                jax.device_put(params[lora], prog.state_shardings.params), jax.device_put(batch, prog.batch_sharding)
            )
            cache[mode, mesh_text, lora] = float(loss), jax.device_get(grads), compiled
        return cache[mode, mesh_text, lora]

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


def test_lora_over_an_fp8_base_equals_on_one_device_and_sharded(gradients):
    """lora.rank=4 with model.fp8=tensorwise: the frozen base's matmuls in FP8 (no weight gradient), the
    adapters in the compute dtype (B set to 0.05, so A has gradients). fsdp=8 against one device: loss
    0 relative, adapter gradients <= 2.7e-5 of each tensor's largest entry (bounds 1e-5, 1e-2). The compiled step quantises the base to
    f8e4m3fn and the gradients to f8e5m2 and has no gradient for the base (only adapters)."""
    ref_loss, ref_grads, _ = gradients("tensorwise", "fsdp=1", 4)
    loss, grads, compiled = gradients("tensorwise", "fsdp=8", 4)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    leaves = jax.tree_util.tree_leaves_with_path(grads)
    assert leaves and all("_lora_" in jax.tree_util.keystr(p) for p, _ in leaves)
    for (path, g), r in zip(leaves, jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, r, rtol=0, atol=1e-2 * np.abs(r).max(), err_msg=jax.tree_util.keystr(path))
    text = compiled.as_text()
    assert "f8e4m3fn" in text and "f8e5m2" in text


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
        ({"model": {"moe_experts": 4, "fp8": "mxfp8"}}, {"fsdp": 8}, "model.fp8=mxfp8 with model.moe_experts > 0"),
        (
            {"model": {"family": "gpt_oss", "moe_experts": 4, "sliding_window": 4}},
            {"fsdp": 8},
            "model.fp8=tensorwise with model.family=gpt_oss",
        ),
        ({"lora": {"rank": 4}, "model": {"fp8": "mxfp8"}}, {"fsdp": 8}, "model.fp8=mxfp8 with lora.rank > 0"),
        ({}, {"cp": 2, "fsdp": 4}, "model.fp8=tensorwise with cp > 1"),
        ({"model": {"fp8": "mxfp8", "mlp_dim": 48}}, {"fsdp": 8}, "model.fp8=mxfp8 scales blocks of 32"),
    ],
    ids=["mxfp8 moe", "gpt_oss", "mxfp8 lora", "cp", "mxfp8 inner dims"],
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


def emulated_expert(x, wg, wu, wd, dy, chunk, per):
    """numpy's FP8 SwiGLU of one expert over `chunk`-row chunks of x (each chunk its own tensorwise
    scales), forward and backward, as grouped_ffn.expert_chunks computes it: -> y, dx, dwg, dwu, dwd."""
    ax = lambda i: i if per else None

    def fwd(a, w):
        (aq, sa), (wq, sw) = quantize(a, E4M3, ax(1)), quantize(w, E4M3, ax(0))
        return (aq @ wq) * sa * sw

    def dgrad(g, w):
        (gq, sg), (wq, sw) = quantize(g, E5M2, ax(1)), quantize(w, E4M3, ax(1))
        return (gq @ wq.T) * sg * sw.reshape(1, -1)

    def wgrad(a, g):
        (aq, sa), (gq, sg) = quantize(a, E4M3, ax(0)), quantize(g, E5M2, ax(0))
        return (aq.T @ gq) * sa.reshape(-1, 1) * sg

    y, dx = np.zeros_like(dy), np.zeros_like(x)
    dws = [np.zeros_like(w) for w in (wg, wu, wd)]
    for c in range(0, x.shape[0], chunk):
        xc, dyc = x[c : c + chunk], dy[c : c + chunk]
        g, u = fwd(xc, wg), fwd(xc, wu)
        sig = 1 / (1 + np.exp(-g))
        h = g * sig * u
        y[c : c + chunk] = fwd(h, wd)
        dh = dgrad(dyc, wd)
        dg, du = dh * u * sig * (1 + g * (1 - sig)), dh * g * sig
        dx[c : c + chunk] = dgrad(dg, wg) + dgrad(du, wu)
        for acc, d in zip(dws, (wgrad(xc, dg), wgrad(xc, du), wgrad(h, dyc))):
            acc += d
    return y, dx, *dws


@pytest.mark.parametrize("mode", ["tensorwise", "rowwise"])
def test_fp8_experts_equal_a_numpy_emulation(mode):
    """Two experts' SwiGLU in FP8 (parallel/fp8_experts.py), forward and backward, against numpy's
    quantise-scale-multiply: dropless (grouped_ffn.expert_chunks: chunks of 8 rows, each its own
    activation scale) and capacity (moe._swiglu under vmap: one scale per expert's buffer). Outputs,
    input and weight gradients to 1e-5 of the largest entry (float32 summation order; measured
    <= 6.8e-7); the output far from float32's (the emulation is what is compared)."""
    from jaxdist.parallel import grouped_ffn
    from jaxdist.parallel import moe as moe_parallel

    rng = np.random.default_rng(1)
    E, R, D, F, chunk = 2, 16, 32, 16, 8
    x = rng.standard_normal((E, R, D)).astype(np.float32)
    wg, wu = ((rng.standard_normal((E, D, F)) * 0.2).astype(np.float32) for _ in range(2))
    wd = (rng.standard_normal((E, F, D)) * 0.2).astype(np.float32)
    dy = rng.standard_normal((E, R, D)).astype(np.float32)
    per = mode == "rowwise"
    runs = {
        "dropless": (lambda *a: grouped_ffn.expert_chunks(a[0], jnp.full((E,), R), *a[1:], chunk, mode), chunk),
        "capacity": (jax.vmap(lambda *a: moe_parallel._swiglu(*a, fp8=mode)), R),
    }
    for name, (fn, rows) in runs.items():
        y, vjp = jax.vjp(jax.jit(fn), *map(jnp.asarray, (x, wg, wu, wd)))
        got = (y, *vjp(jnp.asarray(dy)))
        for e in range(E):
            want = emulated_expert(x[e], wg[e], wu[e], wd[e], dy[e], rows, per)
            for what, g, w in zip(("y", "dx", "dwg", "dwu", "dwd"), got, want):
                err = np.abs(np.asarray(g[e]) - w).max() / np.abs(w).max()
                assert err <= 1e-5, (name, e, what, err)
        f32 = np.einsum("erf,efd->erd", jax.nn.silu(x @ wg) * (x @ wu), wd)
        assert np.abs(f32 - np.asarray(got[0])).max() > 1e-2 * np.abs(f32).max()


MOE_STEPS = 8


@pytest.fixture(scope="module")
def moe_runs(tiny_cfg):
    """(mode, mesh, compute dtype) -> (loss and gradients of batch 0, the MOE_STEPS loss curve, compiled):
    a one-layer MoE (4 experts, top-2, dropless) trained MOE_STEPS optimizer steps in one compiled
    program from the same initial parameters; memoised."""
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    cfg = tiny_cfg.replace(
        model=dict(MICRO_MODEL, moe_experts=4, moe_topk=2, moe_mlp_dim=32),
        train=dict(steps=MOE_STEPS, global_batch=8),
        optim=dict(warmup_steps=2, lr=2e-2),
    )
    batches, cache, state0 = learnable_batches(cfg, MOE_STEPS), {}, None

    def get(mode, mesh_text, dtype="float32"):
        nonlocal state0
        if (mode, mesh_text, dtype) in cache:
            return cache[mode, mesh_text, dtype]
        prog = program(
            cfg.replace(model=dict(fp8=mode, compute_dtype=dtype)), mesh_text, 1 if mesh_text == "fsdp=1" else 8
        )
        state0 = jax.device_get(prog.init_state(0)) if state0 is None else state0

        def fn(state, tokens):
            def one(carry, t):
                params, opt_state = carry
                grads, loss = prog.gradients.apply(params, t, (), 0)[:2]
                updates, opt_state = prog.tx.update(grads, opt_state, params)
                return (optax.apply_updates(params, updates), opt_state), (loss, grads)

            _, (losses, grads) = jax.lax.scan(one, (state.params, state.opt_state), tokens)
            return jax.tree.map(lambda g: g[0], grads), losses

        tokens = jax.device_put(batches, NamedSharding(prog.mesh, P(None, *prog.batch_sharding.spec)))
        state = jax.device_put(state0, prog.state_shardings)
        with prog.activate():
            compiled = jax.jit(fn).lower(state, tokens).compile()
            grads, losses = jax.device_get(compiled(state, tokens))
        cache[mode, mesh_text, dtype] = grads, np.asarray(losses), compiled
        return cache[mode, mesh_text, dtype]

    return get


def test_fp8_moe_step_equals_on_one_device_and_over_ep_fsdp(moe_runs):
    """The rowwise FP8 MoE step on ep=4,fsdp=2 against one device. Every forward and input-gradient
    scale is per token or per weight row/column, the same whatever the mesh, so the loss and the
    gradients upstream of the experts differ by float32 summation order only. The expert weights'
    gradients scale per column over a dropless chunk of rows, and a chunk is 2·N·K/E of the device's N
    tokens (grouped_ffn.chunk_rows): other rows per chunk on another mesh, so other e5m2/e4m3 roundings.
    Measured: first loss 8.6e-8 relative, the 8-step curve 9.1e-4, non-expert gradients <= 4.4e-7 of
    each tensor's largest entry, expert weight gradients <= 7.3e-2 (FP8 noise: e4m3 steps are 6-12% of
    a value). Bounds: 1e-5, 5e-3, 1e-3, 1.5e-1."""
    ref_grads, ref_curve, _ = moe_runs("rowwise", "fsdp=1")
    grads, curve, _ = moe_runs("rowwise", "ep=4,fsdp=2")
    assert curve[0] == pytest.approx(ref_curve[0], rel=1e-5)
    np.testing.assert_allclose(curve, ref_curve, rtol=5e-3)
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
        name = jax.tree_util.keystr(path)
        bound = 1.5e-1 if "_E" in name.rsplit("[", 1)[1] and "router" not in name else 1e-3
        np.testing.assert_allclose(g, r, rtol=0, atol=bound * np.abs(r).max(), err_msg=name)


def test_fp8_moe_training_ends_near_bf16(moe_runs):
    """8 optimizer steps of the one-layer MoE from the same initial parameters: rowwise FP8 matmuls
    (float32 elsewhere) against model.fp8=off in bfloat16 compute, lr 2e-2. Measured: 5.546 -> 4.856
    vs 5.546 -> 4.849, final losses 0.15% apart. Bound: 1% (one seed; the curves' step-to-step
    moves are ~2%)."""
    fp8_curve = moe_runs("rowwise", "fsdp=1")[1]
    bf16_curve = moe_runs("off", "fsdp=1", "bfloat16")[1]
    assert fp8_curve[-1] < fp8_curve[0] - 0.5  # it learns
    assert fp8_curve[-1] == pytest.approx(bf16_curve[-1], rel=1e-2)


def test_fp8_moe_step_quantises_inside_the_expert_chunk_loop(moe_runs):
    """The compiled ep=4,fsdp=2 MoE step: inside the dropless chunk loops (while loops whose trip count
    is each expert's load, unknown to the compiler, and the fusions they call) operands are converted to
    f8e4m3fn, gradients to f8e5m2, and dots taken (XLA:CPU widens the FP8 codes back for its dot)."""
    comps, entry = hlo._computations(moe_runs("rowwise", "ep=4,fsdp=2")[2].as_text())
    _, unknown, _ = hlo._execution_counts(comps, entry)
    loops = "\n".join("\n".join(comps[c]) for c in unknown)
    counts = [loops.count(f"{t}[") for t in ("f8e4m3fn", "f8e5m2")] + [loops.count(" dot(")]
    assert all(counts), counts


def test_fp8_shared_experts_take_the_dense_fp8_matmul(tiny_cfg):
    """Shared experts (models/moe.py, DeepSeek-style) under model.fp8 run the dense layers' FP8 matmul:
    the traced MoE block's forward and backward hold 6 more e4m3 conversions (x and w of each of the
    3 matmuls) and at least 3 more e5m2 ones (their gradients) with one shared expert than without, and
    none without model.fp8 (traced only: no compile)."""
    from flax import nnx

    from jaxdist.models import moe

    def converts(shared, mode):
        m = tiny_cfg.replace(
            model=dict(MICRO_MODEL, moe_experts=4, moe_topk=2, moe_mlp_dim=32, moe_shared_experts=shared)
        ).model
        block, x = moe.MoE(m, nnx.Rngs(0)), jnp.ones((2, 8, m.d_model), jnp.float32)
        with matmul.fp8_matmuls(mode):
            text = str(jax.make_jaxpr(jax.grad(lambda x: block(x)[0].sum()))(x))
        return text.count("new_dtype=float8_e4m3fn"), text.count("new_dtype=float8_e5m2")

    (e4_0, e5_0), (e4_1, e5_1) = converts(0, "tensorwise"), converts(1, "tensorwise")
    assert e4_1 - e4_0 == 6 and e5_1 - e5_0 >= 3, (e4_0, e5_0, e4_1, e5_1)
    assert converts(1, "off") == (0, 0)
