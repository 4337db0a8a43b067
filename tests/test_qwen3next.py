"""Qwen3-Next (models/qwen3next.py) against transformers' Qwen3NextForCausalLM: `tests/fixtures/hf_qwen3_next/`
was made by transformers (scripts/fixtures/make_hf_fixture.py --only qwen3_next): 2 layers, gated DeltaNet (2 key heads,
4 value heads, a width-4 convolution, random A_log / dt_bias / gated norm) then gated full attention (rotary on
half of each head, zero-centred q/k norms), 4 experts top-2 and a gated shared expert in both, every norm
random. torch is not needed here.

- logits equal transformers' to 1e-4 (fp32) on one device and on fsdp=2,ep=2,tp=2;
- greedy generation through the cache (k/v for the full layer, convolution tail and recurrent state for the
  DeltaNet layer; two prompts of different lengths, so the shorter is left-padded) gives transformers' tokens,
  every one up to a near-tie (conftest.assert_same_greedy);
- export -> the fixture's files bit for bit, and import of the export bit for bit;
- what is not supported is one line each; configs/qwen3-next-80b-a3b.yaml has the model card's size.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import (
    assert_export_round_trip,
    assert_lora_matches_peft,
    assert_qlora_trains,
    assert_refused_in_one_line,
    assert_same_greedy,
    peft_lora_reference,
)
from flax import nnx

from jaxdist import config
from jaxdist.distributed import sharding
from jaxdist.distributed.mesh import mesh_from_string
from jaxdist.errors import JaxdistError
from jaxdist.hf import mapping, tensors
from jaxdist.inference import decode
from jaxdist.models import delta_rule

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "hf_qwen3_next"
SHARDED = "fsdp=2,ep=2,tp=2"
REF = np.load(FIXTURE / "reference.npz")


# The experts dispatched with C = N slots each (capacity factor E/K = 2): no assignment can drop, the
# computation of dropless's own worst-case tier, without dropless's switch over three tiers (a third of
# the compile time; dropless against capacity is tests/test_moe.py's).
DISPATCH = ["model.moe_dispatch=capacity", "model.moe_capacity_factor=2.0"]


def imported(mesh_text: str, devices=None):
    cfg = mapping.hf_config(None, DISPATCH, FIXTURE, mesh_text)
    m = cfg.model
    assert m.moe_capacity_factor * m.moe_topk / m.moe_experts >= 1  # C = N: nothing can drop
    mesh = mesh_from_string(mesh_text, devices)
    params, model = tensors.import_params(FIXTURE, cfg, mesh)
    return cfg, mesh, params, model


def forward(model, params, mesh, tokens) -> np.ndarray:
    with sharding.activate(mesh, model.rules):
        logits = jax.jit(lambda p, t: nnx.merge(model.graphdef, p)(t))(params, tokens)
    return np.asarray(logits)


@pytest.fixture(scope="module")
def one_device():
    return imported("fsdp=1", devices=jax.devices()[:1])


PROMPTS = [REF["prompt0"].tolist(), REF["prompt1"].tolist()]
GREEDY = np.stack([REF["greedy0"], REF["greedy1"]])


@pytest.fixture(scope="module")
def one_device_logits(one_device):
    """One compiled one-device forward serving two tests: the fixture's sequences and the two prompts
    followed by transformers' greedy tokens (teacher-forced, as conftest.greedy_gaps), right-padded to one
    length (the model is causal: padding after a position never reaches it)."""
    rows = [list(s) for s in REF["sequences"]] + [p + g[:-1].tolist() for p, g in zip(PROMPTS, GREEDY, strict=True)]
    tokens = np.zeros((len(rows), max(map(len, rows))), np.int32)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = r
    cfg, mesh, params, model = one_device
    return forward(model, params, mesh, tokens)


def gaps_along(logits_BTV, prompts, ref, tol: float) -> np.ndarray:
    """conftest.greedy_gaps on logits already computed: the top-1 minus top-2 logit along the reference's
    greedy paths, and our argmax is the reference's token wherever that gap is at least 2 * tol."""
    gaps = np.zeros(ref.shape, np.float32)
    for i, (p, r) in enumerate(zip(prompts, ref, strict=True)):
        step = logits_BTV[i, len(p) - 1 : len(p) - 1 + len(r)]
        top2 = np.sort(step, -1)[:, -2:]
        gaps[i] = top2[:, 1] - top2[:, 0]
        wide = gaps[i] >= 2 * tol
        assert (step.argmax(-1) == r)[wide].all(), f"row {i}: our argmax {step.argmax(-1).tolist()} vs {r.tolist()}"
    return gaps


def test_logits_match_transformers_one_device_and_sharded(one_device_logits):
    cfg, mesh, params, model = imported(SHARDED)
    m = cfg.model
    assert (m.family, m.full_attention_interval, m.linear_key_heads, m.linear_value_heads, m.rope_fraction) == (
        "qwen3_next", 2, 2, 4, 0.5)  # fmt: skip
    n, T = REF["sequences"].shape
    one = np.abs(one_device_logits[:n, :T] - REF["logits"]).max()
    diff = np.abs(forward(model, params, mesh, REF["sequences"]) - REF["logits"]).max()
    print(f"qwen3_next: max |logit diff| one device {one:.3g}, {SHARDED} {diff:.3g}")
    assert one <= 1e-4 and diff <= 1e-4
    leaves = {jax.tree_util.keystr(p): a for p, a in jax.tree_util.tree_flatten_with_path(params)[0]}
    experts = [a for k, a in leaves.items() if "w_gate_EDF" in k]
    assert experts and all(a.sharding.spec[-3] == "ep" for a in experts)  # each device holds its experts only
    qkvz = [a for k, a in leaves.items() if "wqkvz_DKX" in k]
    assert qkvz and all("tp" in str(a.sharding.spec[-2]) for a in qkvz)  # DeltaNet key heads over tp


def test_greedy_generation_through_the_recurrent_cache_matches_transformers(one_device, one_device_logits):
    cfg, mesh, params, model = one_device
    assert len(PROMPTS[0]) != len(PROMPTS[1])  # the shorter prompt is left-padded: padding must not enter the state
    new, logp, _, _ = decode.generate(cfg, params, model.graphdef, mesh, PROMPTS, GREEDY.shape[1])
    # tol 2e-4: our forward (the gaps) and the decode are each held to 1e-4 of transformers
    gaps = gaps_along(one_device_logits[len(REF["sequences"]) :], PROMPTS, GREEDY, tol=2e-4)
    assert_same_greedy(new, GREEDY, gaps, tol=2e-4, what="qwen3_next greedy tokens")  # every token unless a near-tie
    for k in (0, 1):
        assert np.abs(logp[k] - REF[f"logprobs{k}"]).max() <= 1e-4
    (k, v), (tails, states) = nnx.eval_shape(lambda: nnx.merge(model.graphdef, params)).empty_cache(2, 7, np.float32)
    assert k.shape == (1, 2, 7, 2, 8) and tails.shape == (1, 1, 2, 3, 2 * 2 * 8 + 4 * 6)
    assert states.shape == (1, 1, 2, 4, 8, 6)  # per value head a dk x dv state, whatever the length


def test_export_is_the_fixture_bit_for_bit(one_device, tmp_path):
    cfg, mesh, params, _ = one_device
    assert_export_round_trip(params, cfg, mesh, FIXTURE, tmp_path, "Qwen3NextForCausalLM", "qwen3_next")


def write_config(tmp_path, **edit):
    raw = {**json.loads((FIXTURE / "config.json").read_text()), **edit}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


@pytest.mark.parametrize(
    "edit, named",
    [
        ({"mtp_num_hidden_layers": 1}, "multi-token-prediction"),
        ({"layer_types": ["full_attention", "linear_attention"]}, "layer_types"),
        ({"mlp_only_layers": [0]}, "mlp_only_layers"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "yarn"),
        ({"linear_num_value_heads": 3}, "multiple"),
    ],
)
def test_what_is_not_supported_is_one_line(tmp_path, edit, named):
    with pytest.raises(JaxdistError, match=named) as e:
        mapping.model_fields(write_config(tmp_path, **edit))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["mesh.shape=cp=2,fsdp=4"], "mesh cp=2 is not supported by model.family=qwen3_next"),
        (["lora.rank=4"], r"lora.targets names gate, up, down: .*set lora.targets=\[q,k,v,o\]"),
        (["model.full_attention_interval=3"], "full_attention_interval=3"),
        (["model.qk_norm=true"], "qk_norm"),
        (["data.document_mask=true"], "data.document_mask=true .*not on chat data"),  # chat data's loop ends here
    ],
)
def test_refusals_are_one_line(overrides, named):
    assert_refused_in_one_line(FIXTURE, overrides, named)


def test_packed_documents_are_refused(one_device):
    cfg, mesh, params, model = one_device
    with pytest.raises(JaxdistError, match="packed documents") as e:
        jax.eval_shape(lambda p: nnx.merge(model.graphdef, p)(REF["sequences"], REF["sequences"] * 0), params)
    assert "\n" not in str(e.value)


def test_shipped_config_has_the_published_parameter_count():
    """configs/qwen3-next-80b-a3b.yaml: the model card's 80B total and ~3B activated (without the embedding
    and head, which a token only looks up / projects once); the count is the registry's (exact: it equals the
    model's tensors in test_model_registry for every architecture)."""
    from jaxdist.models.qwen3next import count_params

    c = count_params(config.load("configs/qwen3-next-80b-a3b.yaml").model)
    assert c["total"] == 79_674_391_296 and round(c["total"] / 1e9) == 80
    body = c["active"] - c["embed"] - c["head"]
    assert body == 3_252_599_552 and round(body / 1e9) == 3


def test_chunked_delta_rule_is_the_recurrence():
    """The chunked form (the one a forward over a sequence runs: T / chunk states kept for the backward)
    equals the token-by-token recurrence (the decoding step's), over several chunks, a padded last chunk and
    a non-zero initial state."""
    from jaxdist.models.delta_rule import chunked_delta_rule, gated_delta_rule

    r = np.random.default_rng(0)
    B, T, V, K, D = 2, 21, 3, 8, 6
    q, k, v = r.normal(size=(B, T, V, K)), r.normal(size=(B, T, V, K)), r.normal(size=(B, T, V, D))
    g, beta = -np.abs(r.normal(size=(B, T, V))), 1 / (1 + np.exp(-r.normal(size=(B, T, V))))
    s0 = r.normal(size=(B, V, K, D))
    o, s = jax.jit(gated_delta_rule)(q, k, v, g, beta, s0)
    chunked = jax.jit(chunked_delta_rule, static_argnames="chunk")
    oc, sc = chunked(q, k, v, g, beta, s0, chunk=8)
    assert np.abs(o).max() > 0.1 and np.abs(o - oc).max() <= 1e-5 and np.abs(s - sc).max() <= 1e-5
    wrong, _ = chunked(q, k, v, g, 0 * beta, s0, chunk=8)  # no writes: the deltas matter
    assert np.abs(o - wrong).max() > 1e-2


PEFT_FIXTURE = FIXTURE.parent / "lora_peft_qwen3_next"  # scripts/fixtures/make_lora_peft_moe_fixture.py (peft 0.21.2)


@pytest.fixture(scope="module")
def lora_peft():
    """peft's adapter (random A and B on the full-attention layer's q/k/v/o_proj, r=4) read onto the imported
    float32 base on the sharded mesh: the LoRA program's logits, loss and adapter gradients in one compile."""
    return peft_lora_reference(FIXTURE, PEFT_FIXTURE, DISPATCH, SHARDED)


def test_lora_on_peft_adapter_matches_peft(lora_peft, tmp_path):
    """A peft-written adapter on Qwen3-Next's gated full attention (q_proj with its per-head gate, k, v, o;
    the DeltaNet layer, experts and shared expert frozen) read onto the base on fsdp=2,ep=2,tp=2: logits
    equal peft's to 1e-5 of the largest (the adapter moves them by 3.0), the loss to a relative 1e-5, each
    adapter tensor's gradient norm (relative 1e-5) and gradient . tensor (1e-5 of the largest) torch's; the
    PEFT export is peft's file key for key, bit for bit (layer 1: the group's full-attention layer)."""
    from safetensors.numpy import load_file

    from jaxdist.adapters import peft
    from jaxdist.adapters import tree as adapters

    f = lora_peft
    m = f["cfg"].model
    assert_lora_matches_peft(f, REF["logits"], m=m)
    own = jax.device_get(adapters.trainable(f["params"]))["blocks"]
    peft.write(tmp_path, own, f["cfg"].lora, m=m)
    written = load_file(str(tmp_path / "adapter_model.safetensors"))
    original = load_file(str(PEFT_FIXTURE / "adapter_model.safetensors"))
    assert sorted(written) == sorted(original)
    for k, v in original.items():
        np.testing.assert_array_equal(written[k], v)


def test_the_delta_rule_is_matmuls_without_lapack():
    """The chunk's unit-lower-triangular solve is (I + N)^-1 by matmuls (delta_rule.unit_lower_inverse),
    not XLA:CPU's batched LAPACK trsm, whose threads, started from the 8 simulated devices at once,
    deadlocked the train step (a Qwen3-Next run on fsdp=8 hung after compiling, at 0% CPU). Checked:
    the inverse against numpy's at the chunk size, and no LAPACK call in the forward or backward."""
    rng = np.random.default_rng(0)
    n = np.tril(rng.normal(size=(3, delta_rule.CHUNK, delta_rule.CHUNK)), -1).astype(np.float32) * 0.3
    want = np.linalg.inv(np.eye(delta_rule.CHUNK) + n.astype(np.float64))
    np.testing.assert_allclose(np.asarray(delta_rule.unit_lower_inverse(jax.numpy.asarray(n))), want, atol=1e-4)
    B, T, V, K, D = 1, 80, 2, 8, 8
    q, k = (jax.numpy.asarray(rng.normal(size=(B, T, V, K)), jax.numpy.float32) for _ in range(2))
    v = jax.numpy.asarray(rng.normal(size=(B, T, V, D)), jax.numpy.float32)
    g, beta = -jax.numpy.ones((B, T, V)) * 0.1, jax.numpy.full((B, T, V), 0.5)
    state = jax.numpy.zeros((B, V, K, D))
    loss = lambda q: delta_rule.chunked_delta_rule(q, k, v, g, beta, state)[0].sum()
    text = jax.jit(jax.value_and_grad(loss)).lower(q).compile().as_text()
    targets = set(re.findall(r'custom_call_target="([^"]+)"', text))
    assert not [t for t in targets if "lapack" in t.lower() or "trsm" in t.lower()], targets


def test_qlora_nf4_base_trains():
    """QLoRA on Qwen3-Next (NF4 q/k/v/o of the full-attention layer; DeltaNet, experts and the gated shared
    expert bfloat16) on fsdp=2,ep=2,tp=2: conftest.assert_qlora_trains (the loss falls over 4 steps, the
    base quantised and untouched, the export peft's structure) — the train step that hung before the
    delta rule's solve became matmuls."""
    assert_qlora_trains(FIXTURE, PEFT_FIXTURE, ["optim.lr=0.05"], SHARDED, steps=6)
