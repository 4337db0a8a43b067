"""Mixed precision: bfloat16 compute over float32 master weights, optimizer state, gradients and loss;
the explicit data-parallel reduction runs in `reduce.dtype`."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SMALL_MODEL

from jaxdist.distributed import mesh as mesh_mod
from jaxdist.training import step

SMALL = dict(SMALL_MODEL, seq_len=16, compute_dtype="bfloat16")


def op_dtypes(hlo_text: str, op: str) -> list[str]:
    """Result dtype of each `op` instruction in HLO text (`name = bf16[2,64]{1,0} all-reduce(...)`)."""
    return re.findall(rf"=\s*(bf16|f32|f16)\[[\d,]*\]\S*\s{op}\(", hlo_text)


def build(tiny_cfg, reduce_dtype: str):
    """dp=2 with the dense explicit reduction in `reduce_dtype`, bfloat16 compute."""
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices for dp=2 (scripts/gpu_check.sh runs on one GPU)")
    cfg = tiny_cfg.replace(model=SMALL, train=dict(global_batch=4), reduce=dict(method="dense", dtype=reduce_dtype))
    prog = step.build_program(cfg, mesh_mod.mesh_from_string("dp=2", jax.devices()[:2]))
    tokens = jax.ShapeDtypeStruct((4, SMALL["seq_len"] + 1), jnp.int32, sharding=prog.batch_sharding)
    return prog, prog.train_step.lower(prog.abstract_state, tokens)


@pytest.fixture(scope="module")
def bf16_program(tiny_cfg):
    prog, lowered = build(tiny_cfg, "float32")
    return prog, lowered, lowered.compile()


def test_master_weights_and_optimizer_state_stay_float32(bf16_program):
    prog, _, compiled = bf16_program
    assert step.compute_dtype(prog.cfg.model) == jnp.bfloat16
    floats = [
        x.dtype
        for x in jax.tree.leaves((prog.abstract_state.params, prog.abstract_state.opt_state))
        if jnp.issubdtype(x.dtype, jnp.floating)
    ]
    assert floats and set(floats) == {jnp.dtype(jnp.float32)}
    tokens = jax.device_put(np.random.default_rng(0).integers(0, 256, (4, 17), dtype=np.int32), prog.batch_sharding)
    state, metrics = compiled(prog.init_state(0), tokens)
    assert metrics["loss"].dtype == jnp.float32 and metrics["grad_norm"].dtype == jnp.float32
    assert np.isfinite(float(metrics["loss"])) and int(metrics["skipped"]) == 0
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}


def test_matmuls_run_in_bfloat16(bf16_program):
    # The program as written (XLA's CPU compiler then upcasts bf16 dots to f32; GPUs run them as is).
    dots = [line for line in bf16_program[1].as_text(dialect="hlo").splitlines() if " dot(" in line]
    # Scanned layers: the body's 9 matmuls (7 weights + 2 attention) forward, twice that backward.
    assert len(dots) >= 27
    # Every one takes bfloat16 operands: a bf16 result, or attention's bf16 x bf16 -> f32 accumulation.
    assert all(re.search(r"= bf16\[|algorithm=dot_bf16_bf16_f32", line) for line in dots)


def test_reduction_runs_in_reduce_dtype(tiny_cfg, bf16_program, monkeypatch):
    n_params = len(jax.tree.leaves(bf16_program[0].abstract_state.params))
    # float32: one all-reduce per gradient tensor plus the (loss, token count) one, all float32.
    assert op_dtypes(bf16_program[1].as_text(dialect="hlo"), "all-reduce") == ["f32"] * (n_params + 1)
    # bfloat16: XLA's CPU compiler crashes on it (reduce.py refuses it on CPU), so build as for GPU and
    # read the lowered program: every gradient is summed in bfloat16, the loss still in float32.
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    _, lowered = build(tiny_cfg, "bfloat16")
    monkeypatch.undo()
    assert sorted(op_dtypes(lowered.as_text(dialect="hlo"), "all-reduce")) == ["bf16"] * n_params + ["f32"]


def test_weight_matmul_names_exactly_the_matrices_it_multiplies(tiny_cfg, monkeypatch):
    """mixed.WEIGHT_MATMUL tells the layer scan which matrices to leave float32 for weight_matmul, which
    casts each on its shard and returns its gradient in float32. A matrix used through weight_matmul but
    missing from the list would be pre-cast by the scan, its gradient then reduced in bf16; a listed
    name that weight_matmul never sees would not be cast before its gather at all. One dense Block,
    traced: the parameters weight_matmul receives are exactly the listed ones, and they are all of the
    Block's matrices (norm scales are vectors)."""
    from flax import nnx

    from jaxdist.adapters import lora
    from jaxdist.models import decoder_layers
    from jaxdist.parallel.matmul import WEIGHT_MATMUL

    # the layers' matmuls go through lora.project, which calls weight_matmul when no adapter is attached
    seen, real = [], lora.weight_matmul
    monkeypatch.setattr(lora, "weight_matmul", lambda x, w, *a, **k: seen.append(w) or real(x, w, *a, **k))
    model = tiny_cfg.replace(model=SMALL).model
    graphdef, state = nnx.split(nnx.eval_shape(lambda: decoder_layers.Block(model, nnx.Rngs(params=0))))
    names, matrices = {}, set()

    def run(x, state):
        block = nnx.merge(graphdef, state)
        for path, p in nnx.to_flat_state(nnx.state(block, nnx.Param)):
            names[id(p.get_value())] = str(path[-1])
            matrices.update([str(path[-1])] if p.get_value().ndim >= 2 else [])
        return block(x, jnp.arange(x.shape[1]))

    jax.make_jaxpr(run)(jax.ShapeDtypeStruct((1, 8, model.d_model), jnp.bfloat16), state)
    used = [names.get(id(w)) for w in seen]
    assert sorted(used) == sorted(WEIGHT_MATMUL) and matrices == WEIGHT_MATMUL
