"""The blockwise cross-entropy (jaxdist/parallel/loss.py), the sharded embedding lookup (parallel/embedding.py)
and bf16 parameter gathers.

Equivalence: the blockwise loss and its gradients equal the naive (full-logits, one-hot) loss of one
device to 1e-5 (relative; gradients to 1e-5 of each tensor's largest entry), fp32, on 1 device, fsdp=8,
tp=2,fsdp=4, inside the explicit dp reduction (dp=2,fsdp=2,tp=2) and under the pipeline (pp=2,fsdp=4),
with several vocab blocks per device. Memory and bytes are read from the compiled program.
"""

import glob
import re
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxdist.analysis import measure
from jaxdist.distributed import hlo
from jaxdist.distributed import mesh as mesh_mod
from jaxdist.errors import JaxdistError
from jaxdist.parallel import loss, loss_blocks, pipeline
from jaxdist.training import step

SMALL = dict(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128, seq_len=32)
FAST_COMPILE = dict(xla_backend_optimization_level=0, xla_llvm_disable_expensive_passes=True)
CASES = {  # id -> (mesh, devices, overrides); loss_block=32: 8 blocks per device (4 with tp=2)
    "1 device": ("fsdp=1", 1, {}),
    "fsdp=8": ("fsdp=8", 8, {}),
    "tp=2,fsdp=4": ("tp=2,fsdp=4", 8, {}),
    "explicit dp=2,fsdp=2,tp=2": ("dp=2,fsdp=2,tp=2", 8, dict(reduce=dict(method="dense"))),
    "pipeline pp=2,fsdp=4": ("pp=2,fsdp=4", 8, dict(pipeline=dict(microbatches=2))),
    # logits recomputed in the backward, the head gathered block by block (the defaults keep and chunk)
    "fsdp=8 recompute": ("fsdp=8", 8, dict(model=dict(loss_keep_mib=0, loss_gather_mib=0))),
}


@pytest.fixture(scope="module")
def cfg(tiny_cfg):
    return tiny_cfg.replace(model=SMALL, optim=dict(warmup_steps=2, lr=1e-3))


@pytest.fixture(scope="module")
def batches(cfg):
    rng = np.random.default_rng(3)
    return rng.integers(0, cfg.model.vocab_size, (3, cfg.train.global_batch, cfg.model.seq_len + 1)).astype(np.int32)


def gradients(cfg, mesh_text, n, batch):
    prog = step.build_program(cfg, mesh_mod.mesh_from_string(mesh_text, jax.devices()[:n]))
    state = prog.init_state(0)
    with prog.activate():
        grads, loss_ = jax.jit(lambda p, t: prog.gradients.apply(p, t, (), 0)[:2])(
            state.params, jax.device_put(batch, prog.batch_sharding)
        )
    grads = jax.device_get(grads)
    return float(loss_), pipeline.from_stages(grads, prog.pipeline) if prog.pipeline else grads, prog, state


@pytest.fixture(scope="module")
def naive(cfg, batches):
    return gradients(cfg.replace(model=dict(loss_impl="naive")), "fsdp=1", 1, batches[0])


@pytest.mark.parametrize("chunk,keep,shards", [(1, False, 1), (2, True, 1), (4, False, 1), (2, True, 2)])
def test_blockwise_matches_optax_on_arrays(chunk, keep, shards):
    """No mesh: per-token losses and the gradients of a weighted sum, targets on block edges included;
    4 blocks gathered 1, 2 or 4 at a time, logits kept (the input gradient computed in the forward,
    per vocab shard when S=2) or recomputed."""
    rng = np.random.default_rng(0)
    x, w = rng.normal(size=(2, 6, 8)).astype(np.float32), rng.normal(size=(8, 64)).astype(np.float32)
    t = np.array([[0, 15, 16, 31, 32, 63], [47, 1, 17, 33, 5, 48]], np.int32)
    g = rng.uniform(0.5, 2, size=t.shape).astype(np.float32)
    plan = loss_blocks.Plan(chunk, keep)

    def ours(x, w):
        return loss._blockwise(x.reshape(12, 8), w, t.reshape(12), shards, 16 // shards, None, plan).reshape(2, 6)

    def ref(x, w):
        return optax.softmax_cross_entropy_with_integer_labels(jnp.einsum("btd,dv->btv", x, w), t)

    np.testing.assert_allclose(ours(x, w), ref(x, w), rtol=1e-6)
    for got, want in zip(
        jax.grad(lambda *a: (g * ours(*a)).sum(), (0, 1))(x, w), jax.grad(lambda *a: (g * ref(*a)).sum(), (0, 1))(x, w)
    ):
        np.testing.assert_allclose(got, want, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("case", list(CASES))
def test_blockwise_loss_and_gradients_match_naive(cfg, batches, naive, case):
    mesh_text, n, overrides = CASES[case]
    c = cfg.replace(**overrides).replace(model=dict(loss_impl="blockwise", loss_block=32))
    got_loss, got, _, _ = gradients(c, mesh_text, n, batches[0])
    ref_loss, ref = naive[0], naive[1]
    assert got_loss == pytest.approx(ref_loss, rel=1e-5)
    assert jax.tree.structure(got) == jax.tree.structure(ref)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, atol=1e-5 * np.abs(b).max(), rtol=0)


def test_loss_curve_matches_naive(cfg, batches, naive):
    """Three optimizer steps of tp=2,fsdp=4 blockwise follow the one-device naive curve."""

    def curve(c, mesh_text, n):
        prog = step.build_program(c, mesh_mod.mesh_from_string(mesh_text, jax.devices()[:n]))
        state, out = prog.init_state(0), []
        for b in batches:
            state, m = prog.train_step(state, jax.device_put(b, prog.batch_sharding))
            out.append(float(m["loss"]))
        return out

    ref = curve(cfg.replace(model=dict(loss_impl="naive")), "fsdp=1", 1)
    np.testing.assert_allclose(curve(cfg.replace(model=dict(loss_block=32)), "tp=2,fsdp=4", 8), ref, rtol=1e-5)


def test_block_rows_and_errors():
    assert loss_blocks.block_rows(128256, 1, 2048, 4096) == 128256 // 64  # 2004 rows x 4096 x 4 B < 32 MiB
    assert loss_blocks.block_rows(128256, 2, 8192, 4096) == 1002  # tokens bound it: 1002 x 8192 x 4 B < 32 MiB
    assert loss_blocks.block_rows(256, 2, 128, 64) == 128  # small: one block per device
    assert loss_blocks.block_rows(256, 2, 128, 64, block=32) == 32
    with pytest.raises(JaxdistError, match="model.loss_block=48 must divide"):
        loss_blocks.block_rows(256, 2, 128, 64, block=48)
    from jaxdist import config

    with pytest.raises(JaxdistError, match="loss_impl"):
        config.load(None, ["model.loss_impl=fused"])


def test_vocabulary_attributable_temp_bytes(cfg):
    """temp(V=8192) - temp(V=256) held two-sided on tp=2,fsdp=4 (measure.vocabulary_temp_misses says the
    bounds: the embedding's and head's float32 gradients up to 8 logits blocks more when the backward
    recomputes the logits, the kept logits on top when it keeps them, the naive loss above both). fsdp=8,
    the same check with one vocabulary shard: `python scripts/memory/vocab_temp_check.py --mesh fsdp=8`."""
    _, misses = measure.vocabulary_temp_misses(cfg, mesh_mod.mesh_from_string("tp=2,fsdp=4"))
    assert not misses, misses


def test_gradients_leave_the_stage_as_means_without_a_division_pass(cfg):
    """The implicit stage differentiates the loss sum over the batch's kept-target count (the count is
    the backward's seed), so no parameter-shaped gradient is divided after the backward. Dividing after
    it by a count read from the batch (the loss mask's, since 2a8f271; a constant before) cost one more
    float32 vocabulary-table shard in temp at Llama 3 scale: temp(V=128,256) - temp(V=256), llama3-8b
    2 layers, seq 2048, fp32, 1.07 -> 0.84 GB on fsdp=8 and 0.96 -> 0.84 GB on tp=2,fsdp=4 with the
    seed (docs/memory.md; compile only, minutes a program). At small shapes XLA places that buffer
    elsewhere (no temp difference at V=8192..65536, D=64..512), so this reads the traced program."""
    prog = step.build_program(cfg, mesh_mod.mesh_from_string("fsdp=8"))
    tokens = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.model.seq_len + 1), jnp.int32)
    with prog.activate():
        jaxpr = jax.make_jaxpr(lambda p, t: prog.gradients.apply(p, t, (), 0)[0])(prog.abstract_state.params, tokens)
    shapes = {x.shape for x in jax.tree.leaves(prog.abstract_state.params) if x.ndim >= 2}
    divided = [e for e in jaxpr.eqns if e.primitive.name == "div" and e.outvars[0].aval.shape in shapes]
    assert not divided, divided[:2]


def partitioned_hlo(prog, cfg):
    """The program after XLA's SPMD partitioner, before XLA:CPU's float normalisation (which computes
    bf16 in f32 on CPU only): the collectives a GPU/TPU would run."""
    tokens = jax.ShapeDtypeStruct(
        (cfg.train.global_batch, cfg.model.seq_len + 1), jnp.int32, sharding=prog.batch_sharding
    )
    d = tempfile.mkdtemp()
    compiled = prog.train_step.lower(prog.abstract_state, tokens).compile(
        {**FAST_COMPILE, "xla_dump_to": d, "xla_dump_hlo_pass_re": "spmd-partitioning"}
    )
    (path,) = glob.glob(f"{d}/*jit_train_step*after_spmd-partitioning*.txt")
    return compiled, open(path).read()


GATHER = re.compile(r"=\s*(f32|bf16)\[([\d,]*)\]\S*\s+all-gather(?:-start)?\(")
REDUCTION = re.compile(r"=\s*(f32|bf16)\[([\d,]*)\]\S*\s+(?:all-reduce|reduce-scatter)(?:-start)?\(")


def test_bf16_gathers_half_the_bytes_and_loss_matches_fp32(cfg, batches):
    """fsdp=8: every all-gather of a weight matrix (rank >= 2) moves bf16 under bf16 compute, exactly half
    the bytes of the float32 program's, while every gradient reduction of a weight matrix (the layers'
    and the head's) stays float32 with the float32 program's bytes; the loss agrees with float32 to
    bf16 precision (2e-2). reduce.dtype=bfloat16 (the implicit path): those 8 reductions run in bf16
    in the partitioned program, half the bytes; the same loss (the forward is unchanged, 1e-6) and the
    gradient norm within 1e-2 of the float32 reduction's (each partial sum rounded to bf16 first; XLA:CPU
    then sums in float32: its all-reduce promotion pass, so a bf16 ring's own rounding is not run here)."""
    out = {}
    programs = {"float32": {}, "bfloat16": {}, "reduce bf16": dict(reduce=dict(dtype="bfloat16"))}
    for name, over in programs.items():
        c = cfg.replace(model=dict(compute_dtype="float32" if name == "float32" else "bfloat16"), **over)
        prog = step.build_program(c, mesh_mod.mesh_from_string("fsdp=8"))
        compiled, text = partitioned_hlo(prog, c)
        gathers = [  # matrices: rank >= 2 (the norms' float32 scales, gathered as [1, D], are not cast)
            (dt, hlo.shape_bytes(f"{dt}[{dims}]")[0])
            for dt, dims in GATHER.findall(text)
            if dims.count(",") >= 1 and sorted(int(d) for d in dims.split(","))[-2] > 1
        ]
        reductions = [
            (dt, hlo.shape_bytes(f"{dt}[{dims}]")[0]) for dt, dims in REDUCTION.findall(text) if dims.count(",") >= 1
        ]
        _, metrics = compiled(prog.init_state(0), jax.device_put(batches[0], prog.batch_sharding))
        out[name] = gathers, reductions, float(metrics["loss"]), float(metrics["grad_norm"])
    (f32, f32_red, f32_loss, _), (bf16, bf16_red, bf16_loss, norm) = out["float32"], out["bfloat16"]
    assert f32 and {dt for dt, _ in f32} == {"f32"} and {dt for dt, _ in bf16} == {"bf16"}
    assert sum(b for _, b in bf16) * 2 == sum(b for _, b in f32)
    # 7 layer matrices (one scan body) + the head: reduced over fsdp in float32 under both dtypes
    assert len(bf16_red) == len(f32_red) == 8 and {dt for dt, _ in bf16_red} == {"f32"}
    assert sorted(bf16_red) == sorted(f32_red)
    assert bf16_loss == pytest.approx(f32_loss, rel=2e-2) and bf16_loss != f32_loss
    gathers, red, loss16, norm16 = out["reduce bf16"]
    assert sorted(gathers) == sorted(bf16)
    assert (
        len(red) == 8 and {dt for dt, _ in red} == {"bf16"} and 2 * sum(b for _, b in red) == sum(b for _, b in f32_red)
    )
    assert loss16 == pytest.approx(bf16_loss, rel=1e-6)
    assert norm16 == pytest.approx(norm, rel=1e-2)
