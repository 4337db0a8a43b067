"""Pipeline parallelism (pp=2, gpipe, 2 micro-batches) on the architectures whose layers are not one
uniform stack: Gemma 3 (sliding/full layers with a rotary base each: both staged beside the weights, as
gpt-oss's windows), gpt-oss (sliding/full windows alternate: each stage gets its layers' windows, staged
beside the weights), DeepSeek-V3 (the dense first layers run before the pipeline, the stages split the
MoE stack) and Qwen3-Next (the stages split its scanned DeltaNet+full-attention groups). Each is
compared with the one-device run of the same weights (the transformers fixture's, imported): loss and
every gradient, test_pipeline.py's tolerance (fp32 on CPU, only the order of reductions differs: each
gradient tensor to 1e-5 of its largest entry, the loss to a relative 1e-5; Qwen3-Next's to 3e-5 of it:
its short convolution's weight gradient sums the chunked delta rule's terms in another order, measured
1.1e-5 of its largest entry at pp=2). DeepSeek-V3's balancing bias (model.moe_bias_rate) after the step
is the one-device step's too: its update (training.step.after_step_update) reads the expert loads of
every micro-batch. One step, the smallest fixture models; each architecture compiles its one-device and
its pipelined gradient program once.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import learnable_batches, tokens_spec

from jaxdist import config
from jaxdist.distributed.mesh import mesh_from_string
from jaxdist.hf import mapping, tensors
from jaxdist.models import deepseek3
from jaxdist.parallel import pipeline
from jaxdist.training import step

FIXTURES = Path(__file__).resolve().parent / "fixtures"
# arch: (fixture, model overrides, pipelined mesh, devices, gradient tolerance (of the largest entry))
ARCHS = {
    # 4 layers, every 4th full: stage 0 (sliding, sliding), stage 1 (sliding, full), each kind its rotary base
    "gemma3": ("hf_gemma3", {"sliding_window_pattern": 4}, "pp=2", 2, 1e-5),
    "gpt_oss": ("hf_gpt_oss", {}, "pp=2,ep=2", 4, 1e-5),  # 2 layers: stage 0 sliding (window 4 < 16), stage 1 full
    # 1 dense layer before, 2 MoE layers in 2 stages; the balancing bias moves (its rate 0 by default)
    "deepseek_v3": ("hf_deepseek_v3", {"moe_bias_rate": 1e-3}, "pp=2,ep=2", 4, 1e-5),
    "qwen3_next": ("hf_qwen3_next", {"num_layers": 4}, "pp=2,ep=2", 4, 3e-5),  # 2 groups of (DeltaNet, full)
}
RUN = ["train.global_batch=8", "train.steps=1", "pipeline.microbatches=2", "train.eval_every=0"]


def _gradients(prog):
    """The program's gradient stage, `(params, tokens) -> (mean gradients, loss, expert loads or None)`,
    compiled for its shardings (conftest.compiled_gradients plus the MoE loads the step's after-step
    update reads)."""

    def fn(p, t):
        grads, loss, _, extra = prog.gradients.apply(p, t, (), 0)
        return grads, loss, extra.get("moe_load_LE") if isinstance(extra, dict) else None

    jitted = jax.jit(fn, in_shardings=(prog.state_shardings.params, prog.batch_sharding))
    with prog.activate():
        return jitted.lower(prog.abstract_state.params, tokens_spec(prog)).compile()


def _program(arch: str, mesh_text: str, devices: int):
    fixture, model, *_ = ARCHS[arch]
    cfg = mapping.apply(config.load(None, RUN), FIXTURES / fixture)
    cfg = cfg.replace(model={**model, "seq_len": 16})
    prog = step.build_program(cfg, mesh_from_string(mesh_text, jax.devices()[:devices]))
    return cfg, prog


@pytest.fixture(scope="module")
def one_device():
    """arch -> (fixture params in the model's layout, batch, loss, gradients, (expert loads, after-step
    params)) on one device; memoised."""
    cache = {}

    def get(arch):
        if arch not in cache:
            cfg, prog = _program(arch, "fsdp=1", 1)
            if cfg.model.num_layers != mapping.model_fields(FIXTURES / ARCHS[arch][0])["num_layers"]:
                params = jax.device_get(prog.init_state(0).params)  # more layers than the fixture: random ones
            else:
                params = jax.device_get(tensors.import_params(FIXTURES / ARCHS[arch][0], cfg, prog.mesh)[0])
            batch = learnable_batches(cfg, 1)[0]
            grads, loss, load = _gradients(prog)(params, batch)
            after = jax.device_get(step.after_step_update(cfg, params, load))
            cache[arch] = params, batch, float(loss), jax.device_get(grads), (jax.device_get(load), after)
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", list(ARCHS))
def test_pp2_matches_one_device(arch, one_device):
    params, batch, ref_loss, ref_grads, (ref_load, ref_after) = one_device(arch)
    _, _, mesh_text, n, tol = ARCHS[arch]
    cfg, prog = _program(arch, mesh_text, n)
    assert prog.pipeline is not None and prog.pipeline.stages == 2 and prog.pipeline.microbatches == 2
    staged = jax.device_put(pipeline.to_stages(params, prog.pipeline), prog.state_shardings.params)
    grads, loss, load = _gradients(prog)(staged, jax.device_put(batch, prog.batch_sharding))
    grads = pipeline.from_stages(jax.device_get(grads), prog.pipeline)
    after = pipeline.from_stages(
        jax.device_get(step.after_step_update(cfg, staged, load, prog.pipeline)), prog.pipeline
    )
    assert float(loss) == pytest.approx(ref_loss, rel=1e-5)
    assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(g, r, atol=tol * np.abs(r).max(), rtol=0, err_msg=jax.tree_util.keystr(path))
    if arch == "deepseek_v3":  # the biases moved, by the loads of both micro-batches as on one device
        np.testing.assert_allclose(np.asarray(load), ref_load, atol=0.5, rtol=0)  # assignment counts
        bias = lambda p: {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(p)
                          if jax.tree_util.keystr(k).endswith(f"'{deepseek3.BIAS}']")}  # fmt: skip
        moved, ref_moved, before = bias(after), bias(ref_after), bias(params)
        assert sorted(moved) == sorted(ref_moved) and moved
        for k in moved:
            assert np.abs(ref_moved[k] - before[k]).max() == pytest.approx(1e-3, rel=1e-3), k  # the update ran
            np.testing.assert_allclose(moved[k], ref_moved[k], atol=1e-7, rtol=0, err_msg=k)


@pytest.mark.parametrize("arch", ["gpt_oss", "deepseek_v3"])  # Qwen3-Next's fixture is one group: no pp=2
def test_hf_import_onto_the_pipeline_layout(arch):
    """--restore hf: onto pp=2,ep=2 fills the staged stack (DeepSeek-V3: the MoE stack; its dense layer
    replicated) with exactly the one-device import's tensors."""
    fixture, _, mesh_text, n, _ = ARCHS[arch]
    cfg = mapping.apply(config.load(None, RUN), FIXTURES / fixture)
    flat = lambda p: {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(p)}
    one = flat(
        jax.device_get(tensors.import_params(FIXTURES / fixture, cfg, mesh_from_string("fsdp=1", jax.devices()[:1]))[0])
    )
    staged, model = tensors.import_params(FIXTURES / fixture, cfg, mesh_from_string(mesh_text, jax.devices()[:n]))
    assert model.pipeline is not None
    two = flat(pipeline.from_stages(jax.device_get(staged), model.pipeline))
    assert sorted(one) == sorted(two) and all(np.array_equal(one[k], two[k]) for k in one)
