"""gpt-oss (models/gpt_oss.py) against transformers' GptOssForCausalLM: `tests/fixtures/hf_gpt_oss/` was
made by transformers (scripts/fixtures/make_hf_fixture.py --only gpt_oss): 2 layers (sliding window 4 < the
16-token sequences, then full), learned sinks, random q/k/v/o, router and expert biases, 4 experts top-2,
swiglu_limit 1 (the clamp acts), YaRN rotary with all three bands. torch is not needed here.

- logits equal transformers' to 1e-4 (fp32) on one device and on fsdp=2,ep=2,tp=2 (experts split over ep);
- greedy generation over the KV cache (windowed layer, sinks) gives transformers' tokens, every one up to a
  near-tie (conftest.assert_same_greedy);
- each token's top-k expert set equals transformers' at every layer;
- export -> the fixture's files bit for bit, and import of the export bit for bit;
- the sinks, the router bias, the window and the clamp are not vacuous; what is not supported is one line each;
- configs/gpt-oss-20b.yaml has the published 20.91B parameters (3.61B active without the embedding).
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

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "hf_gpt_oss"
SHARDED = "fsdp=2,ep=2,tp=2"
REF = np.load(FIXTURE / "reference.npz")


def imported(mesh_text: str, devices=None):
    cfg = mapping.hf_config(None, [], FIXTURE, mesh_text)
    mesh = mesh_from_string(mesh_text, devices)
    params, model = tensors.import_params(FIXTURE, cfg, mesh)
    return cfg, mesh, params, model


flat = flat_params


@jax.jit(static_argnums=0)
def _apply(graphdef, params, tokens):
    return nnx.merge(graphdef, params)(tokens)


def logits_of(model, params, mesh, tokens=REF["sequences"]) -> np.ndarray:
    """One compiled program per (graphdef, mesh), shared by the tests."""
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
    assert (m.family, m.sliding_window, m.moe_experts, m.moe_topk, m.rope_scaling, m.swiglu_limit) == (
        "gpt_oss", 4, 4, 2, "yarn", 1.0)  # fmt: skip
    diff = np.abs(logits_of(model, params, mesh) - REF["logits"]).max()
    one = np.abs(logits_of(one_device[3], one_device[2], one_device[1]) - REF["logits"]).max()
    print(f"gpt_oss: max |logit diff| one device {one:.3g}, {SHARDED} {diff:.3g}")
    assert one <= 1e-4 and diff <= 1e-4
    w = [a for p, a in jax.tree_util.tree_flatten_with_path(params)[0] if "w_gate_up_EDG" in jax.tree_util.keystr(p)]
    assert w and all(a.sharding.spec[-3] == "ep" for a in w)  # each device holds its experts only


def test_greedy_generation_matches_transformers(sharded):
    cfg, mesh, params, model = sharded
    assert_generation_matches_fixture(cfg, params, model.graphdef, mesh, REF, "gpt_oss")


def test_export_is_the_fixture_bit_for_bit(sharded, tmp_path):
    cfg, mesh, params, _ = sharded
    assert_export_round_trip(params, cfg, mesh, FIXTURE, tmp_path, "GptOssForCausalLM", "gpt_oss")


def test_same_experts_chosen_per_token(one_device):
    """Layer by layer on one device, each token's router logits equal transformers' (the fixture's
    `router_logits`) to 1e-4 and its top-k expert set is transformers' exactly, every layer and token."""
    cfg, mesh, params, model = one_device
    K, tokens = cfg.model.moe_topk, jnp.asarray(REF["sequences"])
    ref_LNE = REF["router_logits"]
    top = lambda lg: np.sort(np.argsort(-lg, axis=-1)[..., :K], axis=-1)
    gap = np.sort(ref_LNE, axis=-1)[..., ::-1]
    assert (gap[..., K - 1] - gap[..., K]).min() > 2e-4  # no choice is a tie-break within the tolerance
    with sharding.activate(mesh, model.rules):
        ours_LNE = np.asarray(_router_logits(model.graphdef, params, tokens))
    assert np.abs(ours_LNE - ref_LNE).max() <= 1e-4
    for i in range(len(ref_LNE)):
        assert np.array_equal(top(ours_LNE[i]), top(ref_LNE[i])), i


@jax.jit(static_argnums=0)
def _router_logits(graphdef, params, tokens):
    """Each layer's router logits (L, B*T, E), the layers run one by one as the scan runs them."""
    net = nnx.merge(graphdef, params)
    layers_def, stacked = nnx.split(net.blocks)
    x, positions, windows, out = net.embed(tokens), jnp.arange(tokens.shape[1]), net.layer_consts(), []
    for i in range(windows.shape[0]):
        block = nnx.merge(layers_def, jax.tree.map(lambda a, i=i: a[i], stacked))
        h = x + block.attn(block.attn_norm(x), positions, None, windows[i])
        z = block.mlp_norm(h).reshape(-1, h.shape[-1])
        out.append(z @ block.mlp.router_DE[...] + block.mlp.router_bias_E[...])
        x = block(x, positions, None, windows[i])[0]
    return jnp.stack(out)


def _with(params, name: str, fn):
    return jax.tree_util.tree_map_with_path(lambda p, x: fn(x) if name in jax.tree_util.keystr(p) else x, params)


def test_sinks_router_bias_window_and_clamp_are_not_vacuous(one_device):
    """Each part, taken away, moves the logits far from transformers' (the sinks and the router bias on
    the compiled program of the first test; the window and the clamp through the config)."""
    from jaxdist.models.gpt_oss import GptOss

    cfg, mesh, params, model = one_device
    far = lambda lg: np.abs(lg - REF["logits"]).max() > 1e-2
    assert far(logits_of(model, _with(params, "sinks_N", jnp.zeros_like), mesh))
    assert far(logits_of(model, _with(params, "router_bias_E", jnp.zeros_like), mesh))
    for change in ({"sliding_window": 64}, {"swiglu_limit": 100.0}):  # one compile each (YaRN: the script)
        m = dataclasses.replace(cfg.model, **change)
        graphdef = nnx.graphdef(nnx.eval_shape(lambda m=m: GptOss(m, nnx.Rngs(params=0))))
        assert far(logits_of(dataclasses.replace(model, graphdef=graphdef), params, mesh)), change


def write_config(tmp_path, **edit):
    raw = {**json.loads((FIXTURE / "config.json").read_text()), **edit}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


@pytest.mark.parametrize(
    "edit, named",
    [
        ({"quantization_config": {"quant_method": "bitsandbytes"}}, "bitsandbytes-quantised .*Mxfp4Config"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "attention_factor": 2.0}}, "attention_factor"),
        ({"attention_bias": False}, "attention_bias"),
    ],
)
def test_what_is_not_supported_is_one_line(tmp_path, edit, named):
    with pytest.raises(JaxdistError, match=named) as e:
        mapping.model_fields(write_config(tmp_path, **edit))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "overrides, named",
    [
        (
            ["mesh.shape=pp=2,fsdp=4", "pipeline.schedule=1f1b"],
            "pipeline.schedule=1f1b does not run model.family=gpt_oss: .*gpipe",
        ),
        (["mesh.shape=cp=2,fsdp=4"], "mesh cp=2 is not supported by model.family=gpt_oss"),
    ],
)
def test_refusals_are_one_line(overrides, named):
    assert_refused_in_one_line(FIXTURE, overrides, named)


@pytest.mark.parametrize(
    "targets, named",
    [
        ("q,k,v,o,q_a", r"names q_a, .*set lora.targets=\[q,k,v,o,gate,up,down\]"),
        ("q,gate,down", "names one of gate and up: .*fused parameter"),
    ],
)
def test_lora_targets_it_lacks_are_one_line(targets, named):
    """The trainer's and planner's start-up check (objectives/refusals.py) names the targets gpt-oss's layers do
    not carry, and gate without up (one fused expert parameter, which peft adapts whole)."""
    from jaxdist.objectives import refusals

    cfg = mapping.hf_config(None, ["lora.rank=4", f"lora.targets=[{targets}]"], FIXTURE, SHARDED)
    with pytest.raises(JaxdistError, match=named) as e:
        refusals.check_sizes(cfg, {"fsdp": 2, "ep": 2, "tp": 2})
    assert "\n" not in str(e.value)


PUBLISHED_20B = {  # https://huggingface.co/openai/gpt-oss-20b/raw/main/config.json
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
    "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                           "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088,
}  # fmt: skip


def test_published_20b_config_maps_to_the_shipped_config(tmp_path):
    """The real gpt-oss-20b config.json (MXFP4 experts, de-quantised on import) and the same file without
    quantization_config (what a de-quantised save writes) both map onto configs/gpt-oss-20b.yaml's model."""
    shipped = config.load("configs/gpt-oss-20b.yaml").model
    for raw in (PUBLISHED_20B, {k: v for k, v in PUBLISHED_20B.items() if k != "quantization_config"}):
        (tmp_path / "config.json").write_text(json.dumps(raw))
        fields = mapping.model_fields(tmp_path)
        assert {k: v for k, v in fields.items() if getattr(shipped, k) != v} == {}


def test_gpt_oss_20b_config_has_the_published_count():
    """The model card's table 1: 20.91B total, 3.61B active (without the embedding table)."""
    from jaxdist.models import registry

    m = config.load("configs/gpt-oss-20b.yaml").model
    counts = registry.of(m).count_params(m)
    assert counts["total"] == 20_914_757_184 and round(counts["total"] / 1e9, 2) == 20.91
    assert round((counts["active"] - counts["embed"]) / 1e9, 2) == 3.61


def test_the_planner_offers_gpt_oss_20b_pp_but_no_cp_mesh():
    """The registry entry's refusals are the planner's candidate filter too (pp under gpipe:
    tests/test_arch_pipeline.py)."""
    from jaxdist.planner.candidates import architecture_takes

    cfg = config.load("configs/gpt-oss-20b.yaml")
    base = {"dp": 1, "fsdp": 8, "tp": 1, "pp": 1, "cp": 1, "ep": 1}
    assert architecture_takes(cfg, base) and architecture_takes(cfg, {**base, "ep": 2})
    assert architecture_takes(cfg, {**base, "pp": 2}) and not architecture_takes(cfg, {**base, "cp": 2})


PEFT_FIXTURE = FIXTURE.parent / "lora_peft_gpt_oss"  # scripts/fixtures/make_lora_peft_moe_fixture.py (peft 0.21.2)


@pytest.fixture(scope="module")
def lora_peft():
    """peft's adapter (random A and B, r=4, on q/k/v/o_proj and the experts' gate_up_proj and down_proj) read onto
    the imported float32 base on the
    sharded mesh; the LoRA program's logits, loss and adapter gradients in one compile; the merged weights."""
    from jaxdist.adapters import tree as adapters

    got = peft_lora_reference(FIXTURE, PEFT_FIXTURE, [], SHARDED)
    merged = jax.jit(lambda p: adapters.merge(p, got["cfg"].lora))(got["params"])
    return dict(got, merged=jax.device_put(merged, jax.tree.map(lambda a: a.sharding, got["base"])))


def test_lora_on_peft_adapter_matches_peft(lora_peft):
    """A peft-written adapter on gpt-oss's attention (q/k/v/o_proj, biased; sinks, window, YaRN) and on its
    experts (peft's target_parameters: the (E, D, 2F) gate_up_proj, gate and up interleaved, at rank r, and
    down_proj; a weight-space delta before the clamped SwiGLU) read onto the base on fsdp=2,ep=2,tp=2 (experts
    split over ep): logits equal peft's to 1e-5 of the largest (the adapter moves them by 2.5), the mean
    next-token cross-entropy to a relative 1e-5, each adapter tensor's gradient norm (relative 1e-5) and
    gradient . tensor (1e-5 of the largest) torch's, under peft's key names; the merged parameters run by the
    plain model give merge_and_unload()'s logits. The expert adapters are not vacuous: without them the
    logits leave peft's by over 1000x the bound."""
    f = lora_peft
    assert_lora_matches_peft(f, REF["logits"])
    tol = 1e-5 * np.abs(f["ref"]["logits"]).max()
    merged = logits_of(f["model"], f["merged"], f["mesh"])[:1]
    np.testing.assert_allclose(merged, f["ref"]["merged_logits"], atol=tol, rtol=0)
    # the merged experts alone back to the base's: the attention adapters' logits only, far from peft's
    base = jax.device_get(f["base"]["blocks"]["mlp"])
    no_experts = jax.tree.map(np.asarray, jax.device_get(f["merged"]))
    no_experts["blocks"]["mlp"] = dict(no_experts["blocks"]["mlp"], w_gate_up_EDG=base["w_gate_up_EDG"],
                                       w_down_EFD=base["w_down_EFD"])  # fmt: skip
    no_experts = jax.device_put(no_experts, jax.tree.map(lambda a: a.sharding, f["base"]))
    away = np.abs(logits_of(f["model"], no_experts, f["mesh"])[:1] - f["ref"]["merged_logits"]).max()
    assert away > 1000 * tol, away
    print(f"gpt_oss LoRA vs peft: logits {np.abs(f['logits'] - f['ref']['logits']).max():.2g}, "
          f"merged {np.abs(merged - f['ref']['merged_logits']).max():.2g}, without the experts' adapters {away:.2g} "
          f"(largest {np.abs(f['ref']['logits']).max():.2g})")  # fmt: skip


def test_lora_peft_export_is_peft_file(lora_peft, tmp_path):
    """jaxdist's PEFT export of the adapters it read is peft's file key for key, bit for bit (the experts'
    nested ParamWrappers included), and its config names peft's target_modules and target_parameters with no
    rank or alpha pattern; peft loads that export onto transformers' gpt-oss to the fixture's logits
    (`make_lora_peft_moe_fixture.py --load DIR gpt_oss`: measured 0 difference, the same tensors)."""

    from jaxdist.adapters import peft
    from jaxdist.adapters import tree as adapters

    f = lora_peft
    peft.write(tmp_path, jax.device_get(adapters.trainable(f["params"]))["blocks"], f["cfg"].lora, m=f["cfg"].model)
    ours, theirs = assert_export_is_peft_file(tmp_path, PEFT_FIXTURE)
    assert ours["target_parameters"] == theirs["target_parameters"] == ["gate_up_proj", "down_proj"]
    assert not ours["rank_pattern"] and not theirs["rank_pattern"] and not ours["alpha_pattern"]


def test_adapter_count_and_planner_size_the_experts_adapters(lora_peft):
    """count_adapter_params is the model's adapter entries (q/k/v/o plus per expert r (D + 2F) for gate_up_proj
    and r (F + D) for down_proj), and the planner's adapter groups hold that many entries on gpt-oss-20b."""
    from jaxdist.adapters import tree as adapters
    from jaxdist.adapters.lora import count_adapter_params
    from jaxdist.distributed.mesh import parse_mesh
    from jaxdist.planner import hardware, lora
    from jaxdist.planner.layout import Layout

    f = lora_peft
    got = sum(x.size for x in jax.tree.leaves(adapters.trainable(f["params"])))
    assert got == count_adapter_params(f["cfg"].model, f["cfg"].lora) > 0
    cfg = config.load("gpt-oss-20b", ["lora.rank=16"])  # the shipped config, from any directory
    one = Layout(cfg, parse_mesh("fsdp=1", 1), hardware.get("h100-80gb"))
    m, r = cfg.model, 16
    experts = m.num_layers * m.moe_experts * r * ((m.d_model + 2 * m.moe_mlp_dim) + (m.moe_mlp_dim + m.d_model))
    assert sum(g.size for g in lora.adapter_groups(one)) == count_adapter_params(m, cfg.lora) > experts > 0


def test_qlora_nf4_base_trains():
    """QLoRA on gpt-oss (NF4 attention, bfloat16 experts with adapters) on fsdp=2,ep=2,tp=2:
    conftest.assert_qlora_trains (the loss falls over 4 steps, the base quantised and untouched, the export peft's
    structure)."""
    assert_qlora_trains(FIXTURE, PEFT_FIXTURE, [], SHARDED, targets="q,k,v,o,gate,up,down")


def test_mxfp4_dequantisation_is_transformers():
    """jaxdist.hf.mxfp4.dequantize of packed expert tensors in the published layout (every FP4 code,
    exponents 2^-9..2^9 and the range's ends) equals transformers' convert_moe_packed_tensors entry for
    entry (scripts/fixtures/make_mxfp4_fixture.py): both are exact (an e2m1 value times a power of two),
    so equality, not a tolerance; a swapped nibble order or a missing transpose fails."""
    from jaxdist.hf import mxfp4

    ref = np.load(FIXTURE.parent / "mxfp4" / "packed.npz")
    for name in ("gate_up_proj", "down_proj"):
        blocks, scales = ref[f"{name}_blocks"], ref[f"{name}_scales"]
        np.testing.assert_array_equal(mxfp4.dequantize(blocks, scales), ref[name])
        swapped = (blocks >> 4) | (blocks << 4)
        assert not np.array_equal(mxfp4.dequantize(swapped, scales), ref[name])
    with pytest.raises(ValueError, match="MXFP4 blocks"):
        mxfp4.dequantize(ref["down_proj_blocks"][..., :8], ref["down_proj_scales"])


def test_mxfp4_checkpoint_imports_as_its_dequantised_twin(tmp_path, sharded):
    """A tiny MXFP4 checkpoint (the fixture with each layer's experts.gate_up_proj stored as random
    `_blocks` / `_scales`, quantization_config mxfp4) imports on fsdp=2,ep=2,tp=2 to exactly the parameters
    of its bfloat16 twin (the same tensors de-quantised by hf/mxfp4.py, which equals transformers'): so
    the same logits (one program, the same inputs: 0 difference). down_proj stays dense here (its
    contraction dim F=16 is under one 32-wide block); its transpose is checked by the fixture test."""
    from safetensors.numpy import load_file, save_file

    from jaxdist.hf import mxfp4

    mesh = sharded[1]
    raw, conf = load_file(str(FIXTURE / "model.safetensors")), json.loads((FIXTURE / "config.json").read_text())
    rng = np.random.default_rng(0)
    packed, dense = dict(raw), dict(raw)
    for i in range(conf["num_hidden_layers"]):
        name = f"model.layers.{i}.mlp.experts.gate_up_proj"
        E, D, G2 = raw[name].shape
        blocks = rng.integers(0, 256, (E, G2, D // 32, 16), dtype=np.uint8)
        scales = rng.integers(122, 126, (E, G2, D // 32), dtype=np.uint8)
        del packed[name]
        packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
        dense[name] = mxfp4.dequantize(blocks, scales).astype(raw[name].dtype)
        assert dense[name].shape == raw[name].shape
    out = {}
    for kind, tensors_, extra in (("mxfp4", packed, {"quantization_config": {"quant_method": "mxfp4"}}),
                                  ("dense", dense, {})):  # fmt: skip
        d = tmp_path / kind
        d.mkdir()
        save_file(tensors_, str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps({**conf, **extra}))
        out[kind] = flat(tensors.import_params(d, mapping.hf_config(None, [], d, SHARDED), mesh)[0])
    assert sorted(out["mxfp4"]) == sorted(out["dense"])
    for k, v in out["dense"].items():
        np.testing.assert_array_equal(out["mxfp4"][k], v, err_msg=k)
    moved = [k for k in out["dense"] if "w_gate_up" in k]
    assert moved and not np.array_equal(out["dense"][moved[0]], flat(sharded[2])[moved[0]])  # not the fixture's
