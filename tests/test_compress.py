"""Compression that converges and byte counts that are exact (issue 15), 8 CPU devices.

Bytes: for each codec the compiled reduction's dp bytes (hlo.py's reading of the compiled program)
must equal the codec's own `bytes_sent` summed over the tensors it compresses plus a dense float32
all-reduce of those it does not — two-sided, exact. Chunked top-k must cost 4 bytes per kept entry and
peer. The frozen-variance Adam is checked against optax.adamw; DiLoCo against ordinary data
parallelism (H=1, outer SGD lr 1) and against a direct re-implementation of its outer step.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxdist import checkpoint
from jaxdist.analysis import measure
from jaxdist.data import loader as loader_mod
from jaxdist.distributed.mesh import mesh_from_string
from jaxdist.errors import JaxdistError
from jaxdist.optim import adamw
from jaxdist.reduce import compress, demo, dgc, diloco, explicit, registry
from jaxdist.reduce.gradients import accumulate_gradients
from jaxdist.training import step

SMALL_MODEL = dict(num_layers=2, d_model=128, num_heads=4, num_kv_heads=2, head_dim=32, mlp_dim=512, seq_len=16)
# DiLoCo compiles whole train steps: the smallest model that has every kind of tensor.
MINI_MODEL = dict(num_layers=1, d_model=64, num_heads=2, num_kv_heads=1, head_dim=32, mlp_dim=128, seq_len=8)


@pytest.fixture(scope="module")
def small_cfg(tiny_cfg):
    return tiny_cfg.replace(model=SMALL_MODEL, train=dict(global_batch=16, steps=100))


@pytest.fixture(scope="module")
def dp8():
    return mesh_from_string("dp=8")


_TEXTS = {}  # compiled reductions shared across tests (compiles dominate this file's time)


def reduction_text(cfg, mesh, **knobs):
    key = (repr(cfg.model), repr(mesh), repr(sorted(knobs.items())))
    if key not in _TEXTS:
        _TEXTS[key] = measure.compile_reduction(cfg.replace(reduce=knobs), mesh).as_text()
    return _TEXTS[key]


def expected_bytes(codec, abstract, batch_dims, n):
    """What the codec says it sends, tensor by tensor; dense float32 for the tensors it leaves alone."""
    total = 0.0
    for a, b in zip(jax.tree.leaves(abstract), jax.tree.leaves(batch_dims)):
        own, dense = codec.bytes_sent(a.shape, b, n), compress.dense_bytes(a.shape, n)
        total += own if own < dense else dense
    return total


@pytest.mark.parametrize(
    "knobs,codec",
    [
        (dict(method="topk", ratio=0.001, topk=dict(dgc="off")), compress.topk(0.001)),  # plain: a dense warm-up
        (dict(method="int8"), compress.int8(256)),
        (dict(method="powersgd", powersgd=dict(rank=4)), compress.powersgd(4)),
    ],
    ids=["topk0.001", "int8", "powersgd4"],
)
def test_codec_bytes_are_exact(small_cfg, dp8, knobs, codec):
    """Two-sided: the compiled reduction sends exactly what the codec accounts for (steady state),
    and its dense warm-up branch exactly a dense float32 all-reduce of every tensor."""
    model = step.resolve(small_cfg, dp8, step.sharding.DEFAULT_RULES)
    text = reduction_text(small_cfg, dp8, **knobs)
    want = expected_bytes(codec, model.abstract, model.stacked_dims, 8)
    assert measure.dp_bytes_per_step(text, dp8) == pytest.approx(want, rel=1e-12, abs=0)
    dense = sum(compress.dense_bytes(a.shape, 8) for a in jax.tree.leaves(model.abstract))
    if registry.METHODS[knobs["method"]].warms_up:  # warm-up branch: the dense reduction, to the byte
        assert measure.dp_bytes_per_step(text, dp8, phase="warmup") == pytest.approx(dense, rel=1e-12)
    assert (
        dense / want > {"topk": 15 if knobs.get("ratio") == 0.01 else 100, "int8": 3.5, "powersgd": 8}[knobs["method"]]
    )


def test_dgc_warmup_stages():
    """The sparsity warm-up: 10% of the steps in 4 near-equal stages whose density falls from 6.25%
    (or 25x the target, where lower) by (target / start)^(1/4) per stage; fewer stages when the
    warm-up has fewer steps; none when the target is not below the start density."""
    cfg = step.Config().replace(reduce=dict(method="topk", ratio=0.01), train=dict(steps=100))
    stages = dgc.stages(cfg)
    assert [(a, b) for a, b, _ in stages] == [(0, 2), (2, 5), (5, 7), (7, 10)]
    np.testing.assert_allclose([d for _, _, d in stages], [0.0625, 0.039528, 0.025, 0.015811], rtol=1e-4)
    assert dgc.stages(cfg.replace(train=dict(steps=20))) == [(0, 1, 0.0625), (1, 2, 0.025)]
    assert dgc.stages(cfg.replace(reduce=dict(ratio=0.1))) == []
    # a 0.1% target starts at 25x itself (2.5%), not 6.25%: four stages of 2.5% / 1.12% / 0.5% / 0.22%
    low = dgc.stages(cfg.replace(reduce=dict(ratio=0.001)))
    np.testing.assert_allclose([d for _, _, d in low], [0.025, 0.011180, 0.005, 0.002236], rtol=1e-4)


def test_dgc_bytes_are_exact_per_stage_and_four_per_kept_entry(tiny_cfg, dp8):
    """topk 1% (DGC, the default) over 20 steps: a 2-step sparsity warm-up in 2 stages (6.25%,
    2.5%). The compiled reduction sends, in each stage's branch and in the steady state, exactly
    top-k's bytes at that density (dense float32 for tensors top-k would not shrink), falling stage
    by stage; the run average weighs each by its steps. Each kept entry is one uint32 (bfloat16
    value over its 16-bit in-chunk position): the measured bytes per kept entry per peer are 4.0,
    against 8 for float32 value + int32 index."""
    cfg = tiny_cfg.replace(model=MINI_MODEL, reduce=dict(method="topk", ratio=0.01), train=dict(steps=20))
    model = step.resolve(cfg, dp8, step.sharding.DEFAULT_RULES)
    text = measure.compile_reduction(cfg, dp8).as_text()
    dense = sum(compress.dense_bytes(a.shape, 8) for a in jax.tree.leaves(model.abstract))
    measured = [measure.dp_bytes_per_step(text, dp8, phase=i) for i in range(2)] + [
        measure.dp_bytes_per_step(text, dp8)
    ]
    for got, density in zip(measured, [0.0625, 0.025, 0.01]):
        want = expected_bytes(compress.topk(density), model.abstract, model.stacked_dims, 8)
        assert got == pytest.approx(want, rel=1e-12, abs=0)
    assert dense > measured[0] > measured[1] > measured[2] and dense / measured[2] > 15
    run = (measured[0] + measured[1] + 18 * measured[2]) / 20
    assert measure.run_bytes_per_step(cfg, dp8, text) == pytest.approx((measured[2], run), rel=1e-12)
    kept, dense_part = 0, 0.0
    for a in jax.tree.leaves(model.abstract):
        chunks, chunk = compress.chunking(a.size)
        if dgc.compressible(a.shape, 0.01, 8):
            kept += chunks * max(1, int(np.ceil(0.01 * chunk)))
        else:
            dense_part += compress.dense_bytes(a.shape, 8)
    assert kept > 0 and (measured[2] - dense_part) / (7 * kept) == pytest.approx(4.0, rel=1e-12)


def test_run_average_mixes_the_dense_warm_up(small_cfg, dp8):
    """PowerSGD's run average over train.steps mixes its dense warm-up steps in: the default 10-step
    warm-up (10%) of 100 steps at the dense branch's bytes, 90 at the compressed branch's (the
    whole train step's extra psum is held exactly in the DGC and DeMo step tests)."""
    cfg = small_cfg.replace(reduce=dict(method="powersgd", powersgd=dict(rank=4)))
    text = reduction_text(small_cfg, dp8, method="powersgd", powersgd=dict(rank=4))  # shared with the byte test
    steady, run = measure.run_bytes_per_step(cfg, dp8, text)
    warm = measure.dp_bytes_per_step(text, dp8, phase="warmup")
    model = step.resolve(small_cfg, dp8, step.sharding.DEFAULT_RULES)
    dense = sum(compress.dense_bytes(a.shape, 8) for a in jax.tree.leaves(model.abstract))
    assert warm == pytest.approx(dense, rel=1e-12)
    assert steady == pytest.approx(
        expected_bytes(compress.powersgd(4), model.abstract, model.stacked_dims, 8), rel=1e-12
    )
    assert registry.warmup_steps(cfg) == 10
    assert run == pytest.approx((10 * warm + 90 * steady) / 100, rel=1e-12) and steady < run < warm


# ---------------------------------------------------------------------------------------------------
# Chunked top-k on its own: exactness across chunk boundaries


def test_chunked_topk_error_feedback_is_exact(dp8):
    """A tensor of 3 chunks: per chunk exactly k entries are sent, the largest of that chunk; sent +
    new residual == gradient + old residual; every replica receives the sum of what was sent."""
    shape, ratio = (3, 50_000), 0.001
    abstract = {"w": jax.ShapeDtypeStruct(shape, jnp.float32)}
    reducer = explicit.compressed(compress.topk(ratio), "dp", 8, abstract, {"w": 0})
    grads = {"w": jax.random.normal(jax.random.key(0), (8,) + shape)}
    old = {"w": 0.1 * jax.random.normal(jax.random.key(1), (8,) + shape)}

    def body(g, e):
        total, s = reducer.update({"w": g[0]}, explicit.CompressedState({"w": e[0]}, ((),)), None)
        return total["w"], s.residual["w"][None]

    fn = jax.shard_map(body, mesh=dp8, in_specs=(P("dp"), P("dp")), out_specs=(P(), P("dp")), check_vma=False)
    total, residual = jax.jit(fn)(grads["w"], old["w"])
    x = np.asarray(grads["w"] + old["w"]).reshape(8, -1)
    sent = x - np.asarray(residual).reshape(8, -1)
    np.testing.assert_allclose(np.asarray(total).reshape(-1), sent.sum(0), rtol=1e-5, atol=1e-5)
    chunks, chunk = compress.chunking(x.shape[1])
    assert chunks == 3 and chunk == 50_000
    k = int(np.ceil(ratio * chunk))
    for c in range(chunks):
        xs, ss = x[:, c * chunk : (c + 1) * chunk], sent[:, c * chunk : (c + 1) * chunk]
        assert ((ss != 0).sum(1) == k).all()
        kth = -np.sort(-np.abs(xs), axis=1)[:, k - 1 : k]
        np.testing.assert_array_equal(ss != 0, np.abs(xs) >= kth)
        np.testing.assert_allclose(ss[ss != 0], xs[ss != 0], rtol=2**-8)  # bfloat16-rounded values


# ---------------------------------------------------------------------------------------------------
# DGC: momentum correction, momentum factor masking, local clipping, sparsity warm-up

DGC_SHAPES = {"w": (96, 128), "b": (3,)}  # top-k'd (one chunk of 12,288: k = 123 at 1%); dense (3 entries)


@pytest.mark.parametrize("mode", ["update", "gradient"])
def test_dgc_exchange_is_exact_per_replica(tiny_cfg, dp8, mode):
    """Per replica, against numpy: share clipped to optim.clip_norm/sqrt(8) locally; (update) scaled by
    the mean gradient's scale estimated from its own moments, v' = b2 v + (1-b2)(8 share)^2 and
    m' = b1 m + (1-b1) 8 share: sqrt(7/8 m̂'^2 + v̂'/8) + eps; u' = b1 u + (1-b1) p; a' = a + c u'
    (update: c = 1/(1 - b1^t), Adam's bias correction; gradient: c = 1). What
    it sent (a' - new a) is exactly the k largest |a'| (bfloat16-rounded), nothing else; new u is u'
    with the sent entries zeroed (masking); the sum every replica receives is the sum of what all
    sent; the 3-entry tensor goes dense: the sum of c u', a unchanged. At step 0 the density is the
    warm-up's first stage (6.25%: k = 768), at step 10 the target (1%: k = 123)."""
    cfg = tiny_cfg.replace(reduce=dict(method="topk", ratio=0.01, topk=dict(dgc=mode)), train=dict(steps=100))
    o = cfg.optim
    update = dgc.replica_update(cfg, 8)
    keys = iter(jax.random.split(jax.random.key(5), 12))
    rnd = lambda scale: {k: scale * jax.random.normal(next(keys), (8,) + v) for k, v in DGC_SHAPES.items()}
    share, u, a, v, m = rnd(0.1), rnd(0.01), rnd(0.01), jax.tree.map(jnp.abs, rnd(0.01)), rnd(0.01)
    moments = mode == "update"
    state = dgc.DgcState(u, a, v if moments else (), m if moments else ())
    spec = {k: P("dp") for k in DGC_SHAPES}
    state_spec = dgc.DgcState(spec, spec, spec if moments else (), spec if moments else ())

    def body(g, s, i):
        total, new = update(jax.tree.map(lambda x: x[0], g), jax.tree.map(lambda x: x[0], s), i)
        return jax.tree.map(lambda x: x[None], total), jax.tree.map(lambda x: x[None], new)

    fn = jax.jit(
        jax.shard_map(body, mesh=dp8, in_specs=(spec, state_spec, P()), out_specs=(spec, state_spec), check_vma=False)
    )
    for i, k in ((0, 768), (10, 123)):
        total, new = fn(share, state, jnp.int32(i))
        sent_sum = {key: 0.0 for key in DGC_SHAPES}
        for r in range(8):
            g = {key: np.asarray(x[r], np.float64) for key, x in share.items()}
            norm = np.sqrt(sum((x**2).sum() for x in g.values()))
            assert norm > 1 / np.sqrt(8)  # the local clip is active
            g = {key: x * (1 / np.sqrt(8)) / norm for key, x in g.items()}
            for key in DGC_SHAPES:
                p = g[key]
                if mode == "update":
                    v_new = o.b2 * np.asarray(v[key][r]) + (1 - o.b2) * (8 * p) ** 2
                    m_new = o.b1 * np.asarray(m[key][r]) + (1 - o.b1) * 8 * p
                    np.testing.assert_allclose(new.variance[key][r], v_new, rtol=1e-5)
                    np.testing.assert_allclose(new.mean[key][r], m_new, rtol=1e-5, atol=1e-9)
                    m_hat, v_hat = m_new / (1 - o.b1 ** (i + 1)), v_new / (1 - o.b2 ** (i + 1))
                    p = p / (np.sqrt(7 / 8 * m_hat**2 + v_hat / 8) + o.eps)
                u_new = o.b1 * np.asarray(u[key][r]) + (1 - o.b1) * p
                c = 1 / (1 - o.b1 ** (i + 1)) if mode == "update" else 1.0  # Adam's m̂ = m / (1 - b1^t)
                a_new = np.asarray(a[key][r]) + c * u_new
                if key == "b":  # dense: the momentum itself is summed, nothing held back
                    np.testing.assert_allclose(new.accum[key][r], a[key][r], rtol=0)
                    np.testing.assert_allclose(new.momentum[key][r], u_new, rtol=1e-4, atol=1e-8)
                    sent_sum[key] = sent_sum[key] + c * u_new
                    continue
                sent = a_new.reshape(-1) - np.asarray(new.accum[key][r], np.float64).reshape(-1)
                score = np.abs(a_new).reshape(-1)
                top = score >= -np.sort(-score)[k - 1]
                assert top.sum() == k
                np.testing.assert_allclose(sent[~top], 0, atol=1e-7)
                np.testing.assert_allclose(sent[top], a_new.reshape(-1)[top], rtol=2**-8)  # bfloat16 values
                want_u = np.where(top, 0.0, u_new.reshape(-1))  # momentum factor masking
                np.testing.assert_allclose(np.asarray(new.momentum[key][r]).reshape(-1), want_u, rtol=1e-4, atol=1e-8)
                sent_sum[key] = sent_sum[key] + sent.reshape(a_new.shape)
        for key in DGC_SHAPES:
            for r in range(8):
                np.testing.assert_allclose(total[key][r], sent_sum[key], rtol=1e-4, atol=1e-6)


def test_dgc_masks_the_kept_positions_even_where_the_value_is_zero(dp8):
    """Momentum factor masking zeroes u where top-k *kept* an entry, not where the sent value is
    nonzero: a chunk with 30 nonzero accumulated entries and k = 41 keeps 11 zeros too, and all 41
    positions leave the momentum (sent != 0 would have masked 30)."""
    n, k = 4096, 41  # one chunk; 1% keeps ceil(40.96) = 41
    u = (1 + jax.random.randint(jax.random.key(1), (8, n), 0, 100)) / 1024  # nonzero, exact in fp32
    hot = jnp.zeros(n, bool).at[jnp.arange(0, 300, 10)].set(True)  # 30 entries accumulate to 1.0
    a = jnp.where(hot, 1.0 - u, -u)  # elsewhere a + u is exactly zero

    def body(a, u):
        total, accum, momentum = dgc.exchange(a[0], u[0], 0.01, "dp", 8)
        return total[None], accum[None], momentum[None]

    spec = P("dp")
    fn = jax.jit(jax.shard_map(body, mesh=dp8, in_specs=(spec, spec), out_specs=(spec,) * 3, check_vma=False))
    total, accum, momentum = (np.asarray(x) for x in fn(a, u))
    masked = momentum == 0
    assert (masked.sum(1) == k).all() and masked[:, np.asarray(hot)].all()
    np.testing.assert_array_equal(momentum[~masked], np.asarray(u)[~masked])
    np.testing.assert_array_equal(accum, 0)  # all of a + u was kept and sent (1.0 is exact in bfloat16)
    np.testing.assert_array_equal(total, np.broadcast_to(np.where(hot, 8.0, 0.0), (8, n)))


# ---------------------------------------------------------------------------------------------------
# Adam with a frozen second moment (1-bit Adam): what lets error feedback telescope through Adam


def test_frozen_variance_adam_matches_optax_then_freezes():
    cfg = step.Config().optim
    params = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}
    grads = [jax.tree.map(lambda p, i=i: jnp.sin(p + i) + 0.1 * i, params) for i in range(6)]
    ref, _ = adamw.make_optimizer(cfg, 100, 8)
    frozen, _ = adamw.make_optimizer(cfg, 100, 8, freeze_variance_at=3)
    s_ref, s_fr = ref.init(params), frozen.init(params)
    assert jax.tree.structure(s_ref) == jax.tree.structure(s_fr)  # checkpoints interchangeable
    ref_update, frozen_update = jax.jit(ref.update), jax.jit(frozen.update)  # two compiles, not many eager ops
    for i, g in enumerate(grads):
        u_ref, s_ref = ref_update(g, s_ref, params)
        u_fr, s_fr = frozen_update(g, s_fr, params)
        nu = s_fr[1][0].nu
        if i < 3:  # optax.adamw's updates through the warm-up (rtol 1e-6)
            for a, b in zip(jax.tree.leaves(u_ref), jax.tree.leaves(u_fr)):
                np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)
            nu_at_freeze = nu
        else:  # the second moment no longer moves; the first still does
            for a, b in zip(jax.tree.leaves(nu), jax.tree.leaves(nu_at_freeze)):
                np.testing.assert_array_equal(a, b)
            assert not np.allclose(jax.tree.leaves(u_ref)[1], jax.tree.leaves(u_fr)[1])


def test_variance_frozen_only_where_compressing(small_cfg, dp8):
    """Off by default (measured worse on the study); when on, from the end of the dense warm-up, and
    only where a method compresses."""
    on = dict(freeze_variance=True)
    assert registry.variance_freeze_step(small_cfg.replace(reduce=dict(method="topk")), dp8) is None
    assert (
        registry.variance_freeze_step(small_cfg.replace(reduce=dict(method="topk", topk=dict(dgc="off"), **on)), dp8)
        == 10
    )
    assert registry.variance_freeze_step(small_cfg.replace(reduce=dict(method="topk", **on)), dp8) is None  # DGC
    assert registry.variance_freeze_step(small_cfg.replace(reduce=dict(method="int8", **on)), dp8) is None
    assert (
        registry.variance_freeze_step(small_cfg.replace(reduce=dict(method="topk", **on)), mesh_from_string("fsdp=8"))
        is None
    )


# ---------------------------------------------------------------------------------------------------
# DiLoCo


@pytest.fixture(scope="module")
def mini_cfg(tiny_cfg):
    # optim.eps=1e-4 keeps Adam's first steps linear enough that summation order does not matter (as in
    # test_reduce); no warm-up schedule surprises: 3 steps.
    return tiny_cfg.replace(model=MINI_MODEL, train=dict(global_batch=16, steps=3), optim=dict(eps=1e-4))


def run_steps(cfg, mesh, batches):
    prog = step.build_program(cfg, mesh)
    state = prog.init_state(0)
    tokens = [jax.device_put(b, prog.batch_sharding) for b in batches]
    compiled = prog.train_step.lower(state, tokens[0]).compile()
    losses, metrics = [], []
    for t in tokens:
        state, m = compiled(state, t)
        losses.append(float(m["loss"]))
        metrics.append(m)
    run_steps.metrics = metrics  # the last run's per-step metrics
    return prog, state, losses, compiled.as_text()


def replica_grad_rms(prog, params, rows, replicas=8):
    """RMS over replicas of each replica's own mean-gradient norm (replica r holds rows 2r, 2r+1)."""
    per = len(rows) // replicas

    @jax.jit
    def norm(rows):
        g, _, count = accumulate_gradients(prog.apply_fn, params, rows, 1)
        return optax.tree.norm(jax.tree.map(lambda x: x / count, g))

    with prog.activate():
        return float(np.sqrt(np.mean([float(norm(rows[r * per : (r + 1) * per])) ** 2 for r in range(replicas)])))


def test_diloco_h1_sgd_outer_equals_data_parallel(mini_cfg, dp8):
    """H=1, outer SGD with lr 1 and no momentum: each outer step is the mean of one inner AdamW step
    per replica. With every replica on the same rows the inner states agree, so this is exactly
    ordinary data parallelism with that AdamW (same loss and parameters, 1e-5)."""
    rows = [jax.random.randint(jax.random.key(i), (2, 9), 0, 256) for i in range(3)]
    batches = [jnp.tile(r, (8, 1)) for r in rows]  # replica i gets rows 2i, 2i+1: the same two
    _, dense, dense_losses, _ = run_steps(mini_cfg.replace(reduce=dict(method="dense")), dp8, batches)
    knobs = dict(method="diloco", diloco=dict(sync_every=1, outer_lr=1.0, outer_momentum=0.0))
    _, dl, dl_losses, _ = run_steps(mini_cfg.replace(reduce=knobs), dp8, batches)
    np.testing.assert_allclose(dl_losses, dense_losses, atol=1e-5, rtol=0)
    for a, b in zip(jax.tree.leaves(dl.params), jax.tree.leaves(dense.params)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def diloco_run(mini_cfg, dp8):
    cfg = mini_cfg.replace(reduce=dict(method="diloco", diloco=dict(sync_every=2, outer_lr=0.7, outer_momentum=0.9)))
    batches = [jax.random.randint(jax.random.key(10 + i), (16, 9), 0, 256) for i in range(3)]
    prog, state, _, text = run_steps(cfg, dp8, batches)  # train.steps=3: the last step syncs too
    return cfg, prog, state, batches, text


def test_diloco_matches_reference(diloco_run):
    """H=2 with outer Nesterov momentum on distinct rows per replica, 3 steps, against a direct
    computation: each replica takes two AdamW steps on its own rows from θ; Δ = mean(θ − θ_r); m = Δ;
    θ' = θ − 0.7 (Δ + 0.9 m); every replica restarts from θ' (keeping its AdamW state). The third
    step is the run's last (train.steps=3): its local step is not lost but synced, mid-period:
    Δ' = mean(θ' − θ'_r), m' = 0.9 m + Δ', θ'' = θ' − 0.7 (Δ' + 0.9 m')."""
    cfg, prog, state, batches, _ = diloco_run
    theta = prog.init_state(0).params
    inner, _ = adamw.make_optimizer(cfg.optim, cfg.train.steps, 2, adamw.decay_mask(prog.param_names))

    @jax.jit
    def inner_step(p, s, rows):
        g, _, count = accumulate_gradients(prog.apply_fn, p, rows, 1)
        u, s = inner.update(jax.tree.map(lambda x: x / count, g), s, p)
        return optax.apply_updates(p, u), s

    @jax.jit  # one compiled outer move (eager tree ops on the 8-device arrays once aborted XLA in CI)
    def outer_move(theta, locals_, momentum=None):  # None: the first outer step, m = Δ
        delta = jax.tree.map(lambda t, *ps: t - sum(ps) / 8, theta, *locals_)
        momentum = delta if momentum is None else jax.tree.map(lambda m, d: 0.9 * m + d, momentum, delta)
        return jax.tree.map(lambda t, d, m: t - 0.7 * (d + 0.9 * m), theta, delta, momentum), momentum

    with prog.activate():
        states, locals_ = [inner.init(theta) for _ in range(8)], []
        for r in range(8):
            p = theta
            for b in batches[:2]:
                p, states[r] = inner_step(p, states[r], b[2 * r : 2 * r + 2])
            locals_.append(p)
        first, momentum = outer_move(theta, locals_)
        locals_ = []
        for r in range(8):
            p, states[r] = inner_step(first, states[r], batches[2][2 * r : 2 * r + 2])
            locals_.append(p)
        want, momentum = outer_move(first, locals_, momentum)
    assert not np.allclose(jax.tree.leaves(want)[0], jax.tree.leaves(first)[0], atol=1e-4)  # the last step moved
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    for a, b in zip(jax.tree.leaves(state.reducer_state.params), jax.tree.leaves(want)):  # replicas restart
        np.testing.assert_allclose(a, np.broadcast_to(b, a.shape), atol=1e-5, rtol=0)
    for a, d in zip(jax.tree.leaves(state.reducer_state.momentum), jax.tree.leaves(momentum)):
        np.testing.assert_allclose(a, np.broadcast_to(d, a.shape), atol=1e-6, rtol=0)


def test_diloco_bytes_are_one_dense_exchange_per_period(diloco_run, dp8):
    """Averaged over the sync period: a dense float32 all-reduce of every tensor every H=2 steps, plus
    the logged loss's psum every step."""
    cfg, prog, _, _, text = diloco_run
    dense = sum(compress.dense_bytes(a.shape, 8) for a in jax.tree.leaves(prog.model.abstract))
    assert measure.dp_bytes_per_step(text, dp8, sync_every=2) == pytest.approx(dense / 2 + 2 * 7 / 8 * 8, rel=1e-12)
    assert measure.dp_bytes_per_step(text, dp8) == pytest.approx(dense + 2 * 7 / 8 * 8, rel=1e-12)
    # The run (train.steps=3) syncs twice, at steps 2 and 3: 2 exchanges over 3 steps, not 1.5.
    steady, run = measure.run_bytes_per_step(cfg, dp8, text)
    assert (steady, run) == pytest.approx((dense / 2 + 2 * 7 / 8 * 8, 2 * dense / 3 + 2 * 7 / 8 * 8), rel=1e-12)
    assert diloco.syncs(cfg.replace(train=dict(steps=300), reduce=dict(diloco=dict(sync_every=16)))) == 19


@pytest.fixture(scope="module", params=["int8", "topk"])
def diloco_codec_run(request, mini_cfg, dp8):
    """DiLoCo with a lossy outer codec, H=2, outer SGD lr 1 without momentum (the outer step is the
    mean of what the codec delivers), 2 steps on distinct rows: one sync, at step 2."""
    knobs = dict(
        method="diloco", diloco=dict(sync_every=2, outer_lr=1.0, outer_momentum=0.0, outer_codec=request.param)
    )
    cfg = mini_cfg.replace(train=dict(steps=2), reduce=knobs)
    batches = [jax.random.randint(jax.random.key(40 + i), (16, 9), 0, 256) for i in range(2)]
    prog, state, _, text = run_steps(cfg, dp8, batches)
    return cfg, prog, state, batches, text


def replica_deltas(cfg, prog, batches):
    """Δ_r = θ − θ_r after each replica's own AdamW steps on its rows (2r, 2r+1), computed directly."""
    theta = prog.init_state(0).params
    inner, _ = adamw.make_optimizer(cfg.optim, cfg.train.steps, 2, adamw.decay_mask(prog.param_names))

    @jax.jit
    def local(rows_SB):
        p, s = theta, inner.init(theta)
        for rows in rows_SB:
            g, _, count = accumulate_gradients(prog.apply_fn, p, rows, 1)
            u, s = inner.update(jax.tree.map(lambda x, c=count: x / c, g), s, p)
            p = optax.apply_updates(p, u)
        return jax.tree.map(jnp.subtract, theta, p)

    with prog.activate():
        rows = jnp.stack(batches)
        return theta, [jax.device_get(local(rows[:, 2 * r : 2 * r + 2])) for r in range(8)]


def test_diloco_outer_codec_delivers_what_it_kept_back(diloco_codec_run):
    """Against Δ_r computed directly: each replica keeps as its codec residual what the codec did not
    send of Δ_r (topk: all but the k largest entries of each chunk; int8: within half an int8 step of
    each block), and the outer step moves θ by the mean of what was sent (int8: plus what
    requantising the sum lost, kept by its owner replica). Tensors the codec would not shrink go dense."""
    cfg, prog, state, batches, _ = diloco_codec_run
    theta, deltas = replica_deltas(cfg, prog, batches)
    codec = cfg.reduce.diloco.outer_codec
    moved = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), theta, state.params)
    residual = jax.device_get(state.reducer_state.codec.residual)
    chunk_err = [c for c in state.reducer_state.codec.codec]
    compressed = 0
    for i, (mv, res) in enumerate(zip(jax.tree.leaves(moved), jax.tree.leaves(residual))):
        d = np.stack([jax.tree.leaves(x)[i] for x in deltas]).reshape(8, -1)
        res, mv = np.asarray(res).reshape(8, -1), mv.reshape(-1)
        scale = np.abs(d).max()
        assert scale > 1e-4  # every tensor moved
        sent = d - res
        if not np.abs(res).max():  # sent dense: the outer step is the plain mean
            np.testing.assert_allclose(mv, d.mean(0), atol=1e-4 * scale, rtol=0)
            continue
        compressed += 1
        if codec == "topk":
            chunks, chunk, k = compress.topk_k(d.shape[1], cfg.reduce.ratio)
            kept = np.pad(np.abs(sent) > 1e-3 * scale, ((0, 0), (0, chunks * chunk - d.shape[1])))
            assert (kept.reshape(8, chunks, chunk).sum(-1) == k).all()
            np.testing.assert_allclose(8 * mv, sent.sum(0), atol=1e-4 * scale, rtol=0)
        else:
            block = cfg.reduce.int8.block_size
            pad = -d.shape[1] % (8 * block)
            blocks = np.pad(d, ((0, 0), (0, pad))).reshape(8, -1, block)
            half_step = np.repeat(np.abs(blocks).max(-1) / 127 / 2, block, axis=-1).reshape(8, -1)[:, : d.shape[1]]
            assert (np.abs(res) <= half_step * 1.001 + 1e-9).all()
            assert np.abs(res).max() > 0.1 * half_step.max()  # rounding lost something, and it was kept
            err = np.asarray(chunk_err[i]).reshape(-1)[: d.shape[1]]  # replica j's chunk j, in order
            np.testing.assert_allclose(8 * mv + err, sent.sum(0), atol=1e-4 * scale, rtol=0)
    assert compressed >= 3, compressed  # the embedding and the stacked matrices at least


def test_diloco_outer_codec_bytes(diloco_codec_run, dp8):
    """The compiled step's dp bytes: the codec's exchange of every tensor it shrinks (dense float32 for
    the others) once per H=2 steps, plus the logged loss's psum every step; and the codec's exchange is
    what makes it cheaper than DiLoCo's dense one (int8 ~3.9x, topk 1% ~16x fewer bytes per sync)."""
    cfg, prog, _, _, text = diloco_codec_run
    model = step.resolve(cfg, dp8, step.sharding.DEFAULT_RULES)
    r = cfg.reduce
    codec = compress.int8(r.int8.block_size, 8) if r.diloco.outer_codec == "int8" else compress.topk(r.ratio)
    sync = expected_bytes(codec, model.abstract, model.stacked_dims, 8)
    loss = 2 * 7 / 8 * 8
    assert measure.dp_bytes_per_step(text, dp8, sync_every=2) == pytest.approx(sync / 2 + loss, rel=1e-12)
    dense = sum(compress.dense_bytes(a.shape, 8) for a in jax.tree.leaves(model.abstract))
    assert dense / sync > {"int8": 3.5, "topk": 8}[r.diloco.outer_codec], dense / sync


@pytest.fixture(scope="module")
def demo_run(mini_cfg, dp8):
    cfg = mini_cfg.replace(reduce=dict(method="demo"))
    batches = [jax.random.randint(jax.random.key(20), (16, 9), 0, 256)]
    prog, state, losses, text = run_steps(cfg, dp8, batches)
    return cfg, prog, state, losses, text, batches, run_steps.metrics


@pytest.fixture(scope="module")
def dgc_run(mini_cfg, dp8):
    """topk 1% (DGC, the default) for 3 steps, without the sparsity warm-up (one compiled branch; the
    stages' bytes are held in the reduction's own test)."""
    cfg = mini_cfg.replace(reduce=dict(method="topk", warmup_fraction=0.0))
    batches = [jax.random.randint(jax.random.key(30 + i), (16, 9), 0, 256) for i in range(3)]
    prog, state, losses, text = run_steps(cfg, dp8, batches)
    return cfg, prog, state, losses, text, batches, run_steps.metrics


def test_dgc_train_step_bytes_and_grad_norm(dgc_run, dp8):
    """The whole step: its bytes are exactly DGC's exchange at 1% plus the psum of (loss, count,
    squared local gradient norm), every step. The logged grad_norm is the RMS of the replicas' own
    gradient norms (computed here replica by replica), not the sparse sum's."""
    cfg, prog, state, losses, text, batches, metrics = dgc_run
    assert dgc.stages(cfg) == [] and prog.gradients.name == "explicit-dgc"
    steady = sum(dgc.bytes_sent(a.shape, 0.01, 8) for a in jax.tree.leaves(prog.model.abstract)) + 2 * 7 / 8 * 12
    assert measure.run_bytes_per_step(cfg, dp8, text) == pytest.approx((steady, steady), rel=1e-12)
    first = replica_grad_rms(prog, prog.init_state(0).params, batches[0])
    assert float(metrics[0]["grad_norm"]) == pytest.approx(first, rel=1e-4)
    assert np.isfinite(losses).all()


@pytest.mark.parametrize(
    "run,field",
    [("diloco_run", "params"), ("demo_run", "delta"), ("dgc_run", "accum")],
    ids=["diloco", "demo", "dgc"],
)
def test_replica_state_round_trips_and_refuses_another_dp(request, dp8, tmp_path, monkeypatch, run, field):
    """DiLoCo's replicas and DeMo's momenta, after real steps (they differ between replicas), are
    saved with the train state (sharded like the params under a leading dp axis); they restore
    bitwise; restoring them onto dp=4 is a one-line error naming the method and the fix."""
    cfg, prog, state = request.getfixturevalue(run)[:3]
    assert jax.tree.leaves(getattr(state.reducer_state, field))  # the field exists and holds arrays
    for s, ps in zip(
        jax.tree.leaves(getattr(prog.state_shardings.reducer_state, field)),
        jax.tree.leaves(prog.state_shardings.params),
    ):
        assert s.spec == P("dp", *ps.spec)
    per_replica = [np.asarray(a) for a in jax.tree.leaves(state.reducer_state) if a.ndim and a.shape[0] == 8]
    assert any(not np.array_equal(a[0], a[1]) for a in per_replica)  # a mixed-up restore would show
    loader = loader_mod.Loader(cfg, prog.batch_sharding)
    saver = checkpoint.Saver(tmp_path, cfg, log=lambda *a: None)
    saver.save(state, 1, loader)
    saver.close()
    restored = checkpoint.restore(tmp_path, prog, loader, cfg).state  # same dp: round trip
    for x, y in zip(jax.tree.leaves(state.reducer_state), jax.tree.leaves(restored.reducer_state)):
        assert x.sharding == y.sharding and np.asarray(x).tobytes() == np.asarray(y).tobytes()
    other = step.build_program(cfg, mesh_from_string("dp=4,fsdp=2"))
    method = cfg.reduce.method
    restores = spy_on_orbax_restore(monkeypatch)
    with pytest.raises(JaxdistError, match=rf"reduce.method={method} state for dp=8, but this mesh has dp=4") as err:
        checkpoint.restore(tmp_path, other, loader_mod.Loader(cfg, other.batch_sharding), cfg)
    assert "\n" not in str(err.value)  # one line
    # Resuming under another method (allowed by name) is refused before orbax's tree mismatch, which
    # read as an unreadable checkpoint and sent restore through every older one. Both refusals come
    # before orbax restores any array: it has read only the run's metadata (the JSON item).
    int8 = cfg.replace(reduce=dict(method="int8"))
    with pytest.raises(
        JaxdistError, match=rf"holds reduce.method={method} state, which reduce.method=int8 cannot"
    ) as err:
        checkpoint.restore(tmp_path, step.build_program(int8, dp8), loader, int8, allowed=frozenset({"reduce.method"}))
    assert "\n" not in str(err.value)
    assert restores == [["meta"], ["meta"]], restores


def spy_on_orbax_restore(monkeypatch) -> list:
    """-> the item names of every CheckpointManager.restore call from now on (the calls still run)."""
    import orbax.checkpoint as ocp

    calls, real = [], ocp.CheckpointManager.restore

    def restore(self, step, *a, args=None, **kw):
        calls.append(sorted(args.keys()) if args is not None else None)
        return real(self, step, *a, args=args, **kw)

    monkeypatch.setattr(ocp.CheckpointManager, "restore", restore)
    return calls


def test_diloco_on_one_replica_warns_and_trains_as_usual(mini_cfg):
    with pytest.warns(UserWarning, match="reduce.method=diloco does nothing with dp=1") as caught:
        prog = step.build_program(mini_cfg.replace(reduce=dict(method="diloco")), mesh_from_string("fsdp=8"))
    assert len(caught) == 1 and prog.gradients.name == "implicit" and prog.abstract_state.reducer_state == ()


# ---------------------------------------------------------------------------------------------------
# DeMo: decoupled momentum, chunked-DCT top-k, sign update


def test_dct_matrix_is_scipys_orthonormal_dct():
    import scipy.fft

    for n in (48, 64):
        x, d = np.random.default_rng(n).normal(size=(n, 5)), demo.dct_matrix(n)
        np.testing.assert_allclose(d @ x, scipy.fft.dct(x, axis=0, norm="ortho"), atol=1e-5)
        np.testing.assert_allclose(d @ d.T, np.eye(n), atol=1e-5)
    assert demo.layout((4, 256, 4, 64), 1, 64) == (4, 256, 256, 64, 64)
    assert demo.layout((96, 3), 0, 64) == (1, 96, 3, 48, 3)  # sides divide the dims


DEMO_SHAPES = {"w": (96, 128), "stack": (2, 3, 64)}  # a matrix; a stack of two 3x64 matrices
DEMO_DIMS = {"w": 0, "stack": 1}


def demo_exchange(tiny_cfg, dp8, ratio):
    """Runs one replica update on 8 replicas with known gradients and momenta; returns the inputs and
    (direction, new δ) per replica."""
    cfg = tiny_cfg.replace(reduce=dict(method="demo", ratio=ratio), optim=dict(clip_norm=1.0))
    lr = lambda step: 0.5
    update = demo.replica_update(cfg, DEMO_DIMS, lr)
    keys = iter(jax.random.split(jax.random.key(3), 4))
    grads = {k: 3.0 * jax.random.normal(next(keys), (8,) + s) for k, s in DEMO_SHAPES.items()}
    delta = {k: 0.1 * jax.random.normal(next(keys), (8,) + s) for k, s in DEMO_SHAPES.items()}

    def body(g, d):
        out, new = update(jax.tree.map(lambda a: a[0], g), jax.tree.map(lambda a: a[0], d), 0)
        return jax.tree.map(lambda a: a[None], out), jax.tree.map(lambda a: a[None], new)

    spec = {k: P("dp") for k in DEMO_SHAPES}
    fn = jax.shard_map(body, mesh=dp8, in_specs=(spec, spec), out_specs=(spec, spec), check_vma=False)
    direction, new = jax.jit(fn)(grads, delta)
    return cfg, grads, delta, direction, new


def test_demo_exchange_is_exact(tiny_cfg, dp8):
    """Per replica: x = β·δ + lr·clip(g) (clipped to norm 1 locally); what it sent (x − new δ) is, in
    the DCT basis, exactly the k largest coefficients of x in each chunk (bfloat16-rounded), nothing
    else; every replica's direction is the sign of the sum of what all sent."""
    cfg, grads, delta, direction, new = demo_exchange(tiny_cfg, dp8, 0.01)
    beta = cfg.reduce.demo.momentum_decay
    sent_sum = {}
    for r in range(8):
        g = {k: np.asarray(v[r]) for k, v in grads.items()}
        norm = np.sqrt(sum((a**2).sum() for a in g.values()))
        assert norm > 1.0  # the clip is active
        for key, shape in DEMO_SHAPES.items():
            x = beta * np.asarray(delta[key][r]) + 0.5 * g[key] / norm
            sent = x - np.asarray(new[key][r])
            lay = demo.layout(shape, DEMO_DIMS[key], 64)
            cx, cs = np.asarray(demo.encode(x, lay)), np.asarray(demo.encode(sent, lay))
            chunks, k = demo.kept(lay, 0.01)
            assert cx.shape[0] == chunks
            kth = -np.sort(-np.abs(cx), axis=1)[:, k - 1 : k]
            top = np.abs(cx) >= kth
            assert (top.sum(1) == k).all()
            np.testing.assert_allclose(cs[~top], 0, atol=1e-6)  # nothing outside the top k went
            np.testing.assert_allclose(cs[top], cx[top], rtol=2**-8, atol=1e-6)  # bfloat16 values
            sent_sum[key] = sent_sum.get(key, 0) + sent
    for key in DEMO_SHAPES:
        want = np.sign(sent_sum[key])
        clear = np.abs(sent_sum[key]) > 1e-5  # sign of a near-zero sum is rounding's call
        for r in range(8):
            np.testing.assert_array_equal(np.asarray(direction[key][r])[clear], want[clear])


def demo_update_text(tiny_cfg, dp8, ratio, abstract, bdims):
    cfg = tiny_cfg.replace(reduce=dict(method="demo", ratio=ratio))
    update = demo.replica_update(cfg, bdims, lambda step: 1.0)
    fn = jax.shard_map(
        lambda g, d: update(g, d, 0),
        mesh=dp8,
        in_specs=(P(), P()),
        out_specs=(P(), P()),
        axis_names={"dp"},
        check_vma=False,
    )
    return jax.jit(fn).lower(abstract, abstract).compile().as_text()


def test_demo_bytes_are_exact(small_cfg, dp8):
    """Two-sided at 0.1% (1% is held exact in the whole train step below): the compiled exchange
    sends exactly demo.bytes_sent summed over the tensors, 4 bytes per kept coefficient per peer;
    the ratio against dense float32 is above the issue's targets (100x at 0.1%, 15x at 1%)."""
    ratio = 0.001
    model = step.resolve(small_cfg, dp8, step.sharding.DEFAULT_RULES)
    text = demo_update_text(small_cfg, dp8, ratio, model.abstract, model.stacked_dims)
    shapes = [(a.shape, b) for a, b in zip(jax.tree.leaves(model.abstract), jax.tree.leaves(model.stacked_dims))]
    want = sum(demo.bytes_sent(s, b, ratio, 64, 8) for s, b in shapes)
    measured = measure.dp_bytes_per_step(text, dp8)
    assert measured == pytest.approx(want, rel=1e-12, abs=0)
    kept = sum(np.prod(demo.kept(demo.layout(s, b, 64), ratio)) for s, b in shapes)
    assert measured / (7 * kept) == pytest.approx(4.0, rel=1e-12)
    dense = sum(compress.dense_bytes(s, 8) for s, _ in shapes)
    assert dense / measured > 100
    assert dense / sum(demo.bytes_sent(s, b, 0.01, 64, 8) for s, b in shapes) > 15


def test_demo_train_step_is_a_sign_update_and_its_bytes_exact(demo_run, dp8):
    """The whole step: every parameter moves by lr·(s + wd·p) with s in {-1, 0, 1} (decoupled decay
    on matrices only), the loss is finite, and the compiled step's dp bytes are exactly the DeMo
    exchange plus the (loss, count, squared gradient norm) psum; the logged grad_norm is the RMS of
    the replicas' own gradient norms (computed here replica by replica), not the sign vector's."""
    cfg, prog, state, losses, text, batches, metrics = demo_run
    before = prog.init_state(0).params
    assert float(metrics[0]["grad_norm"]) == pytest.approx(replica_grad_rms(prog, before, batches[0]), rel=1e-4)
    lr0, wd = float(prog.lr_schedule(0)), cfg.optim.weight_decay
    masks = jax.tree.leaves(adamw.decay_mask(prog.param_names))
    moved = 0
    for p0, p1, decayed in zip(jax.tree.leaves(before), jax.tree.leaves(state.params), masks):
        p0, p1 = np.asarray(p0), np.asarray(p1)
        s = (p0 - p1) / lr0 - (wd * p0 if decayed else 0)
        np.testing.assert_allclose(s, np.round(s), atol=2e-3)
        assert set(np.unique(np.round(s))) <= {-1.0, 0.0, 1.0}
        moved += int((np.round(s) != 0).sum())
    assert moved > 0.9 * sum(p.size for p in jax.tree.leaves(before)) and np.isfinite(losses).all()
    exchange = sum(
        demo.bytes_sent(a.shape, b, cfg.reduce.ratio, 64, 8)
        for a, b in zip(jax.tree.leaves(prog.model.abstract), jax.tree.leaves(prog.model.stacked_dims))
    )
    # + the psum of (loss, token count, squared local gradient norm): 3 float32s
    assert measure.dp_bytes_per_step(text, dp8) == pytest.approx(exchange + 2 * 7 / 8 * 12, rel=1e-12)


def load_study():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "scripts" / "studies" / "compression_study.py"
    spec = importlib.util.spec_from_file_location("compression_study", path)
    study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study)
    return study


def test_study_plots_bytes_as_sent():
    """The Pareto plot's x: DiLoCo's bytes in whole exchanges (none before step H; at 300 steps with
    H=16 the 19th, the last step's, lands at step 300), a warm-up's at its own rate."""
    study = load_study()
    diloco = {"sync_every": 16, "steps": 300, "run_bytes_per_step": 19 * 1600 / 300}  # 1600 bytes per exchange
    got = [study.cumulative_bytes(diloco, s) for s in (15, 16, 31, 32, 288, 299, 300)]
    assert got == pytest.approx([0, 1600, 1600, 3200, 18 * 1600, 18 * 1600, 19 * 1600], rel=1e-12)
    warm = {"warmup_steps": 30, "warmup_bytes_per_step": 100.0, "dp_bytes_per_step": 10.0}
    assert [study.cumulative_bytes(warm, s) for s in (10, 30, 300)] == [1000.0, 3000.0, 5700.0]


def test_study_reuses_bytes_only_from_the_same_setup():
    """compression_study --bytes-from: a stored row's bytes are reused for another seed of the same
    model, mesh, steps and knobs; any other difference, or a row that does not record its setup, is
    refused naming what differs."""
    study = load_study()
    cfg = step.Config().replace(reduce=dict(method="topk"))
    shape = study.bytes_shape(cfg)
    study.check_same_shape("topk 1%", {"shape": study.bytes_shape(cfg.replace(train=dict(seed=1)))}, shape)
    with pytest.raises(SystemExit, match=r"model\.d_model=128 there, 256 here"):
        study.check_same_shape("topk 1%", {"shape": study.bytes_shape(cfg.replace(model=dict(d_model=128)))}, shape)
    with pytest.raises(SystemExit, match="steps=100 there, 300 here"):
        study.check_same_shape("topk 1%", {"shape": study.bytes_shape(cfg.replace(train=dict(steps=100)))}, shape)
    with pytest.raises(SystemExit, match="does not record its shape"):
        study.check_same_shape("topk 1%", {"dp_bytes_per_step": 1.0}, shape)
