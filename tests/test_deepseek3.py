"""DeepSeek-V3 (models/deepseek3.py) against transformers' DeepseekV3ForCausalLM: `tests/fixtures/hf_deepseek_v3/`
was made by transformers (scripts/fixtures/make_hf_fixture.py --only deepseek_v3): 3 layers, the first dense, MLA with
q and kv low rank, interleaved rotary, 8 experts in 4 groups (2 kept), top-3, a shared expert, random
norms and a random e_score_correction_bias, YaRN rotary (x4 from 8 positions, both mscales). torch is not
needed here.

- logits equal transformers' to 1e-4 (fp32) on one device and on fsdp=2,ep=2,tp=2;
- greedy generation over the latent cache gives transformers' tokens, every one up to a near-tie
  (conftest.assert_same_greedy);
- export -> the fixture's files bit for bit, and import of the export bit for bit;
- the selection bias and the group limit are not vacuous; what is not supported is one line each;
- the auxiliary-loss-free bias update moves load toward balance (a flipped sign does not);
- LoRA on MLA's projections (q_a, q_b, kv_a, kv_b, o; the dense first layer and the MoE ones) equals peft's
  (`tests/fixtures/lora_peft_deepseek_v3`, scripts/fixtures/make_lora_peft_moe_fixture.py), and its PEFT
  export is peft's file.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    assert_export_is_peft_file,
    assert_export_round_trip,
    assert_generation_matches_fixture,
    assert_lora_matches_peft,
    assert_qlora_trains,
    assert_refused_in_one_line,
    flat_params,
    peft_lora_reference,
)
from flax import nnx

from jaxdist import config
from jaxdist.distributed import sharding
from jaxdist.distributed.mesh import mesh_from_string
from jaxdist.errors import JaxdistError
from jaxdist.hf import mapping, tensors

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "hf_deepseek_v3"
SHARDED = "fsdp=2,ep=2,tp=2"
REF = np.load(FIXTURE / "reference.npz")


def imported(mesh_text: str, overrides=(), devices=None):
    cfg = mapping.hf_config(None, list(overrides), FIXTURE, mesh_text)
    mesh = mesh_from_string(mesh_text, devices)
    params, model = tensors.import_params(FIXTURE, cfg, mesh)
    return cfg, mesh, params, model


flat = flat_params


@jax.jit(static_argnums=0)
def _apply(graphdef, params, tokens):
    return nnx.merge(graphdef, params)(tokens)


def forward(model, params, mesh, tokens):
    """The logits: one compiled program per (graphdef, mesh), shared by the tests."""
    with sharding.activate(mesh, model.rules):
        return np.asarray(_apply(model.graphdef, params, tokens))


@pytest.fixture(scope="module")
def sharded():
    return imported(SHARDED)


@pytest.fixture(scope="module")
def one_device():
    return imported("fsdp=1", devices=jax.devices()[:1])


def test_logits_match_transformers_one_device_and_sharded(sharded, one_device):
    cfg, mesh, params, model = sharded
    m = cfg.model
    assert (m.family, m.dense_layers, m.moe_groups, m.moe_topk_groups, m.mla_q_rank, m.mla_kv_rank) == (
        "deepseek_v3",
        1,
        4,
        2,
        24,
        16,
    )
    diff = np.abs(forward(model, params, mesh, REF["sequences"]) - REF["logits"]).max()
    one = np.abs(forward(one_device[3], one_device[2], one_device[1], REF["sequences"]) - REF["logits"]).max()
    print(f"deepseek_v3: max |logit diff| one device {one:.3g}, {SHARDED} {diff:.3g}")
    assert one <= 1e-4 and diff <= 1e-4
    w = [a for p, a in jax.tree_util.tree_flatten_with_path(params)[0] if "w_gate_EDF" in jax.tree_util.keystr(p)]
    assert w and all(a.sharding.spec[-3] == "ep" for a in w)  # each device holds its experts only


def test_greedy_generation_over_the_latent_cache_matches_transformers(sharded):
    cfg, mesh, params, model = sharded
    assert_generation_matches_fixture(cfg, params, model.graphdef, mesh, REF, "deepseek_v3")
    # The cache decode fills is the latent: kv_rank + rope numbers per token and layer, not N (nope + rope + v).
    from jaxdist.models import deepseek3

    ck, cv = nnx.eval_shape(lambda: nnx.merge(model.graphdef, params)).empty_cache(2, 7, jnp.float32)
    assert ck.shape == (3, 2, 7, 16) and cv.shape == (3, 2, 7, 4)
    assert deepseek3.cache_bytes_per_token(cfg.model, 4) == (3 * 20 * 4, 3 * 4 * (8 + 4 + 6) * 4)


def test_export_is_the_fixture_bit_for_bit(sharded, tmp_path):
    cfg, mesh, params, _ = sharded
    assert_export_round_trip(params, cfg, mesh, FIXTURE, tmp_path, "DeepseekV3ForCausalLM", "deepseek_v3")


def test_selection_bias_and_group_limit_are_not_vacuous(one_device):
    """Without the fixture's correction bias the logits are far off; on transformers' own router logits
    of the fixture's sequences, the group limit and the bias change which experts are chosen."""
    from jaxdist.models.deepseek3 import rotary_setup, route

    cfg, mesh, params, model = one_device
    freq, rotated, scores = rotary_setup(cfg.model)  # the fixture's YaRN acts on frequencies and both factors
    assert (
        rotated != 1.0
        and scores != 1.0
        and freq != rotary_setup(dataclasses.replace(cfg.model, rope_scaling="none"))[0]
    )
    biases = [a for p, a in jax.tree_util.tree_flatten_with_path(params)[0] if "e_bias_E" in jax.tree_util.keystr(p)]
    zero = jax.tree_util.tree_map_with_path(
        lambda p, x: jnp.zeros_like(x) if "e_bias_E" in jax.tree_util.keystr(p) else x, params
    )
    assert np.abs(forward(model, zero, mesh, REF["sequences"]) - REF["logits"]).max() > 1e-2
    m, logits_LNE, bias_LE = cfg.model, jnp.asarray(REF["router_logits"]), np.asarray(biases[0])
    pick = lambda groups, kept, b: np.sort(
        np.stack([route(logits_LNE[i][None], jnp.asarray(b[i]), m.moe_topk, groups, kept, 1.0, True)[0][0]
                  for i in range(len(b))]), axis=-1)  # fmt: skip
    limited = pick(4, 2, bias_LE)
    assert (limited != pick(4, 4, bias_LE)).any(-1).mean() > 0.05  # the group limit decides for some tokens
    assert (limited != pick(4, 2, 0 * bias_LE)).any(-1).mean() > 0.05  # and so does the bias


def write_config(tmp_path, **edit):
    raw = {**json.loads((FIXTURE / "config.json").read_text()), **edit}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


@pytest.mark.parametrize(
    "edit, named",
    [
        ({"num_nextn_predict_layers": 1}, "multi-token prediction"),
        ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, "dequantise"),
        ({"rope_parameters": {"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e4}}, "longrope"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "truncate": False}}, "truncate"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 16}}, "beta_fast=16"),
        ({"topk_method": "greedy"}, "topk_method"),
        ({"scoring_func": "softmax"}, "scoring_func"),
    ],
)
def test_what_is_not_supported_is_one_line(tmp_path, edit, named):
    with pytest.raises(JaxdistError, match=named) as e:
        mapping.model_fields(write_config(tmp_path, **edit))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["mesh.shape=pp=2,fsdp=4", "pipeline.schedule=zb_h1"], "pipeline.schedule=zb_h1 does not run .*dense first"),
        (["mesh.shape=cp=2,fsdp=4"], "mesh cp=2 is not supported by model.family=deepseek_v3"),
        (["lora.rank=4", "lora.targets=[o]", "model.moe_bias_rate=0.01"], "moe_bias_rate=0.01 with lora.rank>0"),
        (["model.moe_groups=3"], "moe_groups=3"),
        (["model.rope_scaling=llama3"], "rope_scaling"),
    ],
)
def test_refusals_are_one_line(overrides, named):
    assert_refused_in_one_line(FIXTURE, overrides, named)


RATE, STEPS = 0.02, 6


@pytest.fixture(scope="module")
def bias_run(tmp_path_factory):
    """The fixture trained on one skewed batch (a few repeated tokens) on fsdp=4,ep=2 with a tiny learning
    rate (the weights hardly move; the selection biases do, by RATE per step): (program, compiled step,
    states per step, load CV per step, batch). Capacity dispatch with room for every token (factor 8:
    nothing dropped), not dropless: the bias update reads the router's per-expert load, the same either
    way (load CV by step 0.991, 0.918, 0.827, 0.739, 0.654, 0.578 under both), and the program compiles
    in 2.6 CPU-s instead of 4.1 (dropless's tiers are a lax.switch of expert programs)."""
    from jaxdist.training import step

    tokens = tmp_path_factory.mktemp("tokens") / "tokens.bin"  # for the checkpoint's loader state
    np.tile(np.arange(128), 40).astype(np.uint16).tofile(tokens)
    overrides = [f"data.path={tokens}", "data.source=tokens", "model.seq_len=16", "train.global_batch=8", "optim.lr=1e-9", "optim.warmup_steps=0",
                 f"model.moe_bias_rate={RATE}", "mesh.shape=fsdp=4,ep=2", "model.moe_dispatch=capacity",
                 "model.moe_capacity_factor=8.0"]  # fmt: skip
    cfg = mapping.apply(config.load(None, overrides), FIXTURE)
    prog = step.build_program(cfg, mesh_from_string("fsdp=4,ep=2"))
    params, _ = tensors.import_params(FIXTURE, cfg, prog.mesh, prog.rules)
    state = prog.state_from_params(params)
    batch = np.tile(np.array([5, 9, 5, 17, 5, 9], np.int32), 30)[: 8 * 17].reshape(8, 17)
    batch = jax.device_put(batch, prog.batch_sharding)
    shape = jax.ShapeDtypeStruct(batch.shape, batch.dtype, sharding=prog.batch_sharding)
    compiled = prog.train_step.lower(prog.abstract_state, shape).compile()
    states, cvs = [state], []
    for _ in range(STEPS):  # the step donates its input state: each kept state is a copy
        state, metrics = compiled(jax.tree.map(lambda x: x.copy(), state), batch)
        states.append(state)
        cvs.append(float(metrics["moe_load_cv"]))
    return prog, compiled, states, cvs, batch


def biases(state):
    leaves = jax.tree_util.tree_flatten_with_path(jax.device_get(state.params))[0]
    return next(np.asarray(a) for p, a in leaves if "e_bias_E" in jax.tree_util.keystr(p))


def test_bias_update_moves_load_toward_balance(bias_run):
    """DeepSeek-V3 §2.1.2: after each step b_e -= rate * sign(load_e - mean load), per MoE layer. On a
    skewed batch the load's coefficient of variation falls (a flipped sign raises it)."""
    from jaxdist.models.deepseek3 import balance_bias

    _, _, states, cvs, _ = bias_run
    load = jnp.array([[6.0, 1.0, 2.0, 3.0]])  # mean 3: overloaded down, underloaded up, at the mean kept
    assert balance_bias(jnp.zeros((1, 4)), load, 0.5).tolist() == [[-0.5, 0.5, 0.5, 0.0]]
    step_LE = biases(states[1]) - biases(states[0])  # a sign step: -rate, 0 (at the mean) or +rate per expert
    assert np.isclose(np.abs(step_LE), RATE, atol=1e-7).mean() > 0.5
    assert np.all(np.isclose(np.abs(step_LE), RATE, atol=1e-7) | np.isclose(step_LE, 0, atol=1e-7))
    assert np.abs(biases(states[-1]) - biases(states[0])).max() <= STEPS * RATE + 1e-6
    print(f"deepseek_v3 aux-free bias update (rate {RATE}): load CV by step {[round(c, 3) for c in cvs]}")
    assert cvs[-1] < 0.8 * cvs[0]


def test_bias_is_checkpointed_and_resumes_exactly(bias_run, tmp_path):
    """The biases are in the checkpoint (they are parameters the optimizer leaves alone): a restored
    state steps to the same bytes as the uninterrupted one."""
    from jaxdist import checkpoint
    from jaxdist.data import loader as loader_mod

    prog, compiled, states, _, batch = bias_run
    loader = loader_mod.Loader(prog.cfg, prog.batch_sharding)
    saver = checkpoint.Saver(tmp_path, prog.cfg, log=lambda *a: None)
    saver.save(states[3], 3, loader)
    saver.close()
    restored = checkpoint.restore(tmp_path, prog, loader, prog.cfg).state
    assert np.array_equal(biases(restored), biases(states[3])) and not np.array_equal(
        biases(states[3]), biases(states[0])
    )
    resumed, _ = compiled(restored, batch)
    for x, y in zip(jax.tree.leaves(resumed), jax.tree.leaves(states[4]), strict=True):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


def test_shipped_config_has_the_published_parameter_count():
    """configs/deepseek-v3.yaml: 671B parameters, 37B active per token (the paper's §1 figures; the exact
    count is the registry's, which equals the model's tensors for every architecture in
    test_model_registry); its latent cache holds 576 numbers per token and layer against 40,960."""
    from jaxdist.models.deepseek3 import cache_bytes_per_token, count_params

    m = config.load("configs/deepseek-v3.yaml").model
    c = count_params(m)
    assert c["total"] == 671_026_419_200 and round(c["total"] / 1e9) == 671 and int(c["active"] / 1e9) == 37
    assert cache_bytes_per_token(m, 2) == (61 * 576 * 2, 61 * 128 * 320 * 2)  # bf16: 70,272 vs 4,997,120 B


PEFT_FIXTURE = FIXTURE.parent / "lora_peft_deepseek_v3"  # scripts/fixtures/make_lora_peft_moe_fixture.py (peft 0.21.2)


@pytest.fixture(scope="module")
def lora_peft():
    """peft's adapter (random A and B, r=4, on q_a/q_b/kv_a_proj_with_mqa/kv_b/o_proj of all 3 layers and the
    routed experts' fused gate_up_proj (r 8) and down_proj of the 2 MoE layers) read onto the imported float32
    base on fsdp=2,ep=2,tp=2: the LoRA program's logits, loss and adapter gradients in one compile; the merged
    weights."""
    from jaxdist.adapters import tree as adapters

    got = peft_lora_reference(FIXTURE, PEFT_FIXTURE, [], SHARDED)
    merged = jax.jit(lambda p: adapters.merge(p, got["cfg"].lora))(got["params"])
    return dict(got, merged=jax.device_put(merged, jax.tree.map(lambda a: a.sharding, got["base"])))


def test_lora_on_peft_adapter_matches_peft(lora_peft):
    """A peft-written adapter on MLA's five projections, in the dense first layer (`dense_blocks`, HF layer 0)
    and the MoE ones (`blocks`, HF layers 1-2), and on the MoE layers' routed experts (peft's target_parameters,
    added to the expert weights before dispatch), read onto the base on fsdp=2,ep=2,tp=2: logits equal peft's
    to 1e-5 of the largest (conftest.assert_lora_matches_peft; the adapter moves them by 4.9), the mean
    next-token cross-entropy to a relative 1e-5, each adapter tensor's gradient norm (relative 1e-5) and
    gradient . tensor (1e-5 of the largest) torch's, under peft's key names for both stacks; the merged
    parameters run by the plain model give merge_and_unload()'s logits."""
    f = lora_peft
    m = f["cfg"].model
    w = assert_lora_matches_peft(f, REF["logits"], m)
    assert {k.split(".")[4] for k in w} == {"0", "1", "2"}  # the dense layer's adapters are HF layer 0
    assert sum(".experts." in k for k in w) == 8  # gate_up and down, A and B, in both MoE layers
    tol = 1e-5 * np.abs(f["ref"]["logits"]).max()
    merged = forward(f["model"], f["merged"], f["mesh"], f["ref"]["sequences"])[:1]
    np.testing.assert_allclose(merged, f["ref"]["merged_logits"], atol=tol, rtol=0)
    got = np.abs(f["logits"] - f["ref"]["logits"]).max()
    print(f"deepseek_v3 LoRA vs peft: logits {got:.2g} (largest {np.abs(f['ref']['logits']).max():.2g})")


@pytest.mark.parametrize(
    "targets, named",
    [
        ("q,k,v,o,gate,up,down", r"names q, k, v, .*set lora.targets=\[q_a,q_b,kv_a,kv_b,o,gate,up,down\]"),
        ("q_a,q_b,kv_a,kv_b,o,gate,down", "names one of gate and up: .*fused parameter"),
    ],
)
def test_lora_targets_it_lacks_are_one_line(targets, named):
    """The trainer's and planner's start-up check (objectives/refusals.py) names the targets DeepSeek-V3's
    layers do not carry (k and v: MLA has none; q: the q rank splits it), and gate without up (one fused
    expert parameter, which peft adapts whole)."""
    from jaxdist.objectives import refusals

    cfg = mapping.hf_config(None, ["lora.rank=4", f"lora.targets=[{targets}]"], FIXTURE, SHARDED)
    with pytest.raises(JaxdistError, match=named) as e:
        refusals.check_sizes(cfg, {"fsdp": 2, "ep": 2, "tp": 2})
    assert "\n" not in str(e.value)


def test_lora_peft_export_is_peft_file(lora_peft, tmp_path):
    """jaxdist's PEFT export of the adapters it read (both stacks) is peft's file key for key, bit for bit,
    with peft's target_modules; peft loads that export onto transformers' DeepSeek-V3 to the fixture's
    logits (`make_lora_peft_moe_fixture.py --load DIR deepseek_v3`)."""

    from jaxdist.adapters import peft
    from jaxdist.adapters import tree as adapters

    f = lora_peft
    trained = jax.device_get(adapters.trainable(f["params"]))
    peft.write(tmp_path, trained["blocks"], f["cfg"].lora, m=f["cfg"].model, dense=trained["dense_blocks"])
    ours, theirs = assert_export_is_peft_file(tmp_path, PEFT_FIXTURE)
    assert sorted(ours["target_parameters"]) == sorted(theirs["target_parameters"])  # the experts, as peft
    assert (ours["rank_pattern"], ours["alpha_pattern"]) == (theirs["rank_pattern"], theirs["alpha_pattern"])


def test_qlora_nf4_base_trains():
    """QLoRA on DeepSeek-V3 (NF4 MLA in every layer and the dense layer's MLP; experts, shared expert, router
    and selection bias bfloat16) on fsdp=2,ep=2,tp=2, r=4 on q_a/q_b/kv_a/kv_b/o and the routed experts
    (gate, up, down: adapters over the bfloat16 experts), block size 2 (o's 6-wide
    v_head_dim takes no larger even block): conftest.assert_qlora_trains (the loss falls over 4 steps, the
    base quantised and untouched, the export peft's structure, both stacks)."""
    assert_qlora_trains(FIXTURE, PEFT_FIXTURE, [], SHARDED, targets="q_a,q_b,kv_a,kv_b,o,gate,up,down", block_size=2,
                        also=("w_gate_DF", "w_up_DF", "w_down_FD"))  # fmt: skip
