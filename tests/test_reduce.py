"""Explicit data-parallel reduction (jaxdist.reduce.explicit, jaxdist.reduce.compress), 8 CPU devices.

Compiled tests use one small model: 2 layers, d_model 128, 4 heads x 32 (2 kv heads), mlp 512,
vocab 256, seq 16 — 557,696 parameters in 13 tensors. Each codec's bytes are checked two-sided (the
compiled reduction == what the codec accounts for) in tests/test_compress.py; here the dense ring
model and one full-step comparison tie the reduction compiled alone to the whole step.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.analysis import measure
from jaxdist.distributed import hlo
from jaxdist.distributed.mesh import mesh_from_string
from jaxdist.reduce import compress, explicit
from jaxdist.training import step

SMALL_MODEL = dict(num_layers=2, d_model=128, num_heads=4, num_kv_heads=2, head_dim=32, mlp_dim=512, seq_len=16)


@pytest.fixture(scope="module")
def small_cfg(tiny_cfg):
    # optim.eps=1e-4: Adam's first steps are ~lr·sign(g), which turns 1e-7 summation-order noise on
    # near-zero gradients into lr-sized parameter differences; a larger eps keeps the comparison linear.
    return tiny_cfg.replace(model=SMALL_MODEL, train=dict(global_batch=16), optim=dict(eps=1e-4))


@pytest.fixture(scope="module")
def mesh3d():
    return mesh_from_string("dp=2,fsdp=2,tp=2")


@pytest.fixture(scope="module")
def batches(small_cfg):
    shape = (small_cfg.train.global_batch, small_cfg.model.seq_len + 1)
    return [jax.random.randint(jax.random.key(i), shape, 0, small_cfg.model.vocab_size) for i in (1, 2)]


def train(cfg, mesh, batches):
    """Compile the train step once (AOT), run it over `batches`; returns (state, losses, hlo text)."""
    prog = step.build_program(cfg, mesh)
    state = prog.init_state(0)
    tokens = [jax.device_put(b, prog.batch_sharding) for b in batches]
    compiled = prog.train_step.lower(state, tokens[0]).compile()
    losses = []
    for t in tokens:
        state, metrics = compiled(state, t)
        losses.append(float(metrics["loss"]))
    return state, losses, compiled.as_text()


@pytest.fixture(scope="module")
def dense_run(small_cfg, mesh3d, batches):
    return train(small_cfg.replace(reduce=dict(method="dense")), mesh3d, batches)


def assert_trees_close(a, b, atol):
    diffs = jax.tree.map(lambda x, y: float(jnp.max(jnp.abs(x - y))), a, b)
    assert max(jax.tree.leaves(diffs)) <= atol, diffs


def test_dense_explicit_matches_implicit_jit(small_cfg, mesh3d, batches, dense_run):
    state, losses, _ = train(small_cfg, mesh3d, batches)  # reduce.method=implicit: XLA's all-reduce
    dense_state, dense_losses, _ = dense_run
    np.testing.assert_allclose(dense_losses, losses, atol=1e-6, rtol=0)
    assert_trees_close(dense_state.params, state.params, 1e-6)


def test_microbatches_reduce_once(small_cfg, mesh3d, batches, dense_run):
    cfg = small_cfg.replace(reduce=dict(method="dense"), train=dict(grad_accum_steps=4))
    state, losses, text = train(cfg, mesh3d, batches)
    dense_state, dense_losses, dense_text = dense_run
    np.testing.assert_allclose(losses, dense_losses, atol=1e-5, rtol=0)
    assert_trees_close(state.params, dense_state.params, 1e-5)
    # The HLO itself: the micro-batch loop is there (a while with trip count 4), yet every collective
    # across dp runs once per step, and the dp bytes equal the single micro-batch program's.
    assert '"known_trip_count":{"n":"4"}' in text
    dp = [c for c in hlo.collectives(text) if hlo.spans_axis(c, dict(mesh3d.shape), mesh3d.axis_names, "dp")]
    assert dp and all(c.count == 1 for c in dp), [(c.kind, c.count, c.computation) for c in dp]
    assert measure.dp_bytes_per_step(text, mesh3d) == measure.dp_bytes_per_step(dense_text, mesh3d) > 0


@pytest.fixture(scope="module")
def dp8():
    return mesh_from_string("dp=8")


def reduction_bytes(cfg, mesh, **knobs):
    return measure.dp_bytes_per_step(measure.compile_reduction(cfg.replace(reduce=knobs), mesh).as_text(), mesh)


@pytest.fixture(scope="module")
def dense_dp8_bytes(small_cfg, dp8):
    return reduction_bytes(small_cfg, dp8, method="dense")


def test_dense_dp_bytes_follow_ring_model(small_cfg, dp8, dense_dp8_bytes):
    abstract = step.resolve(small_cfg, dp8, step.sharding.DEFAULT_RULES).abstract
    n, params = 8, sum(x.size for x in jax.tree.leaves(abstract))
    assert dense_dp8_bytes == pytest.approx(2 * (n - 1) / n * 4 * params)


def test_train_step_dp_bytes_are_the_reduction_and_the_loss(small_cfg, dp8):
    """The whole compiled step sends across dp exactly the reduction plus one (loss, count) psum
    (plain top-k; DGC's step, which also sums the replicas' gradient norms, is in test_compress)."""
    knobs = dict(method="topk", ratio=0.01, topk=dict(dgc="off"))
    whole = measure.dp_bytes_per_step(measure.compile_train_step(small_cfg.replace(reduce=knobs), dp8).as_text(), dp8)
    assert whole == pytest.approx(reduction_bytes(small_cfg, dp8, **knobs) + 2 * 7 / 8 * 8)


# ---------------------------------------------------------------------------------------------------
# The compressors on their own: per-replica gradients on a 1-D dp=8 mesh

SHAPES = {"w": (2, 48, 40), "b": (40,)}  # a stacked (layers, rows, cols) matrix and a vector
BATCH_DIMS = {"w": 1, "b": 0}


def per_replica_tree(key, n=8):
    keys = jax.random.split(key, len(SHAPES))
    return {name: jax.random.normal(k, (n,) + shape) for k, (name, shape) in zip(keys, sorted(SHAPES.items()))}


def run_reducer(reducer, mesh, grads, state):
    """Apply `reducer.update` per replica; grads/state carry a leading replica axis."""

    def body(g, s):
        total, s = reducer.update(jax.tree.map(lambda x: x[0], g), jax.tree.map(lambda x: x[0], s), jnp.int32(100))
        return total, jax.tree.map(lambda x: x[None], s)

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P("dp"), P("dp")), out_specs=(P(), P("dp")), check_vma=False)
    return jax.jit(fn)(grads, state)


def numpy_int8(x_RS, block):
    """Each replica's row, zero-padded to 8 chunks of whole blocks, quantised per block of `block` entries
    (scale max|x|/127, round half to even) and dequantised: what int8 delivers for it, in numpy."""
    pad = -x_RS.shape[1] % (8 * block)
    blocks = np.pad(x_RS, ((0, 0), (0, pad))).reshape(x_RS.shape[0], -1, block).astype(np.float32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    scale = np.where(amax > 0, amax / np.float32(127), np.float32(1))
    return (np.round(blocks / scale) * scale).reshape(x_RS.shape[0], -1)[:, : x_RS.shape[1]]


def make(codec, mesh, error_feedback=True):
    abstract = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in SHAPES.items()}
    return explicit.compressed(codec, "dp", mesh.shape["dp"], abstract, BATCH_DIMS, error_feedback)


@pytest.mark.parametrize("codec", [compress.topk(0.05), compress.powersgd(2), compress.int8(16)], ids=lambda c: c.name)
def test_error_feedback_is_exact(dp8, codec):
    """Per replica, sent + new residual == gradient + old residual, where `sent` is what the codec
    delivered on this replica's behalf: the senders' shares add up to what every replica received."""
    reducer = make(codec, dp8)
    grads = per_replica_tree(jax.random.key(0))
    old = jax.tree.map(lambda x: 0.1 * x, per_replica_tree(jax.random.key(1)))
    init = jax.tree.map(
        lambda s: jnp.broadcast_to(s, (8,) + s.shape), reducer.init({k: v[0] for k, v in grads.items()})
    )
    total, state = run_reducer(reducer, dp8, grads, init._replace(residual=old))
    sent = jax.tree.map(lambda g, e, e_new: g + e - e_new, grads, old, state.residual)
    for name in SHAPES:
        if codec.name == "int8":  # receivers requantise the sum: within one int8 step of sum(sent)
            atol = float(jnp.abs(sent[name].sum(0)).max()) / 127
            np.testing.assert_allclose(total[name], sent[name].sum(0), atol=atol, rtol=0)
        else:
            np.testing.assert_allclose(total[name], sent[name].sum(0), rtol=1e-5, atol=1e-5)
    if codec.name == "int8":  # the sender keeps exactly what its own quantisation lost: x - dequant(quant(x))
        x = np.asarray(grads["w"] + old["w"]).reshape(8, -1)
        np.testing.assert_allclose(np.asarray(state.residual["w"]).reshape(8, -1), x - numpy_int8(x, 16), atol=1e-5)
        assert np.abs(state.residual["w"]).max() > 1e-3  # rounding lost something, and it was kept
        np.testing.assert_array_equal(state.residual["b"], 0)  # 40 entries: sent dense, nothing left behind
    if codec.name == "powersgd":  # a vector is not compressed: sent dense, nothing left behind
        np.testing.assert_array_equal(state.residual["b"], 0)
    if codec.name == "topk":  # exactly k entries of each replica's tensor were sent, the largest ones
        k = int(np.ceil(0.05 * np.prod(SHAPES["w"])))
        x = np.asarray(grads["w"] + old["w"]).reshape(8, -1)
        s = np.asarray(sent["w"]).reshape(8, -1)
        assert ((s != 0).sum(1) == k).all()
        kth = -np.sort(-np.abs(x), axis=1)[:, k - 1 : k]
        np.testing.assert_array_equal(s != 0, np.abs(x) >= kth)
    if codec.name == "powersgd":  # each replica's share of each layer's matrix has rank <= 2
        ranks = np.linalg.matrix_rank(np.asarray(sent["w"]), tol=1e-4)
        assert (ranks <= 2).all(), ranks


def test_int8_requantisation_error_is_fed_back(dp8):
    """int8 with the axis size (what reduce.method=int8 builds): replica j keeps what requantising
    its chunk of the sum lost and adds it next step, so over both stages nothing is dropped: what
    every replica receives plus the new chunk errors (all replicas' chunks in order) equals what the
    senders sent plus the old chunk errors (fp32 rounding), and each error is within half an int8
    step of its block. Without the axis size the codec is stateless (the test above)."""
    reducer = make(compress.int8(16, 8), dp8)
    grads = per_replica_tree(jax.random.key(4))
    init = jax.tree.map(
        lambda s: jnp.broadcast_to(s, (8,) + s.shape), reducer.init({k: v[0] for k, v in grads.items()})
    )
    assert [getattr(c, "shape", None) for c in init.codec] == [None, (8, 2 * 48 * 40 // 8)]  # b goes dense
    old_chunks = ((), 0.01 * jax.random.normal(jax.random.key(5), init.codec[1].shape))
    total, state = run_reducer(reducer, dp8, grads, init._replace(codec=old_chunks))
    sent = jax.tree.map(lambda g, e: g - e, grads, state.residual)  # old sender residuals are zero
    size = int(np.prod(SHAPES["w"]))  # w is the codec state's second leaf (tree-flatten order)
    old, new = (np.asarray(c[1]).reshape(-1)[:size] for c in (old_chunks, state.codec))  # chunk j: replica j
    want = np.asarray(sent["w"]).sum(0).reshape(-1) + old
    np.testing.assert_allclose(np.asarray(total["w"]).reshape(-1) + new, want, rtol=1e-5, atol=1e-5)
    assert np.abs(new).max() > 0  # rounding lost something, and it was kept
    blocks = np.pad(want, (0, -size % 16)).reshape(-1, 16)  # each block's step is its max |sum| / 127
    step_of = np.repeat(np.abs(blocks).max(1) / 127, 16)[:size]
    assert (np.abs(new) <= step_of / 2 + 1e-6).all()


def test_without_error_feedback_the_rest_is_dropped(dp8):
    reducer = make(compress.topk(0.05), dp8, error_feedback=False)
    grads = per_replica_tree(jax.random.key(2))
    total, state = run_reducer(reducer, dp8, grads, reducer.init({k: v[0] for k, v in grads.items()}))
    assert state.residual == ()
    assert float(jnp.abs(total["w"] - grads["w"].sum(0)).max()) > 0.1  # lossy, and nothing kept


@pytest.mark.parametrize(
    "codec,atol",
    [(compress.topk(1.0), 1e-5), (compress.powersgd(40), 1e-3), (compress.int8(16), None)],
    ids=["topk-all", "powersgd-full-rank", "int8"],
)
def test_codec_sums(dp8, codec, atol):
    """At full ratio / full rank the codecs sum exactly (top-k: the bfloat16-rounded values it sends);
    int8 is within its quantisation steps."""
    x = jax.random.normal(jax.random.key(3), (8,) + SHAPES["w"])

    def body(x_local):
        total, _, _ = codec.reduce(x_local[0], codec.init(SHAPES["w"], 1), 1, "dp")
        return total

    total = jax.jit(jax.shard_map(body, mesh=dp8, in_specs=P("dp"), out_specs=P(), check_vma=False))(x)
    if atol is None:  # two quantisations: each replica's blocks (8 of them), then the sum's
        atol = 8 * float(jnp.abs(x).max()) / 127 / 2 + float(jnp.abs(x.sum(0)).max()) / 127 / 2
    if codec.name == "topk":  # values travel as bfloat16
        x = x.astype(jnp.bfloat16).astype(jnp.float32)
    np.testing.assert_allclose(total, x.sum(0), atol=atol, rtol=0)


def test_dp1_compressed_is_a_no_op_with_warning(small_cfg):
    cfg = small_cfg.replace(reduce=dict(method="topk"))
    with pytest.warns(UserWarning, match="does nothing with dp=1"):
        prog = step.build_program(cfg, mesh_from_string("fsdp=8"))
    assert prog.gradients.name == "implicit" and prog.abstract_state.reducer_state == ()


def test_reducer_state_is_sharded_like_params(small_cfg, dp8):
    prog = step.build_program(
        small_cfg.replace(reduce=dict(method="topk", topk=dict(dgc="off"))), dp8
    )  # DGC: test_compress
    residual = prog.abstract_state.reducer_state.residual
    residual_specs = prog.state_shardings.reducer_state.residual
    for r, p, s, ps in zip(
        jax.tree.leaves(residual),
        jax.tree.leaves(prog.abstract_state.params),
        jax.tree.leaves(residual_specs),
        jax.tree.leaves(prog.state_shardings.params),
    ):
        assert r.shape == (8,) + p.shape  # one residual per replica
        assert isinstance(s, NamedSharding) and s.spec == P("dp", *ps.spec)


def test_params_sharded_over_dp_are_refused(small_cfg, dp8):
    cfg = small_cfg.replace(reduce=dict(method="dense"), mesh=dict(rules={"embed": ["dp"]}))
    with pytest.raises(step.JaxdistError, match="replicated over dp"):
        step.build_program(cfg, dp8)


@pytest.mark.parametrize("method", ["topk", "powersgd", "diloco"])
def test_reducer_state_checkpoint_round_trip(small_cfg, dp8, tmp_path, method):
    """The reducer state (per-replica residuals, PowerSGD's Q) saves and restores with orbax the way
    jaxdist.checkpoint saves the train state: StandardSave, then StandardRestore onto abstract arrays
    carrying the target shardings."""
    import orbax.checkpoint as ocp

    prog = step.build_program(small_cfg.replace(reduce=dict(method=method)), dp8)
    abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        prog.abstract_state.reducer_state,
        prog.state_shardings.reducer_state,
    )
    rng = np.random.default_rng(0)
    state = jax.tree.map(lambda a: jax.device_put(rng.normal(size=a.shape).astype(a.dtype), a.sharding), abstract)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "reducer", state)
        ckpt.wait_until_finished()
        restored = ckpt.restore(tmp_path / "reducer", abstract)
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(a, b)


def test_bfloat16_dense_on_cpu_is_refused(small_cfg, dp8):
    with pytest.raises(step.JaxdistError, match="reduce.dtype=float32 on CPU"):
        step.build_program(small_cfg.replace(reduce=dict(method="dense", dtype="bfloat16")), dp8)


def test_reducer_sees_the_staged_layout_under_pipeline(small_cfg):
    """With pp > 1 the train state stores the layer stack by stage; reducers (PowerSGD's per-layer
    matrices, residuals) must be built for those shapes, not the model's plain stack."""
    cfg = small_cfg.replace(reduce=dict(method="powersgd", powersgd=dict(rank=2)), train=dict(global_batch=16))
    mesh = mesh_from_string("dp=2,pp=2,fsdp=2")
    prog = step.build_program(cfg, mesh)
    abstract, batch_dims = prog.model.abstract, prog.model.stacked_dims
    assert jax.tree.map(lambda a: a.shape, abstract) == jax.tree.map(lambda a: a.shape, prog.abstract_state.params)
    assert batch_dims["blocks"]["mlp"]["w_up_DF"] == 2  # (stage, layers, embed, mlp)
