"""The Hugging Face families beyond Llama (Qwen2, Qwen3, Mistral, Mixtral, Qwen3-MoE, Gemma 3) against
transformers: `tests/fixtures/hf_<family>/` were made by transformers (scripts/fixtures/make_hf_fixture.py)
with its logits, greedy continuations and (MoE) router logits; torch is not needed here.

Per family, one import per mesh, shared by the tests (module fixture):
- imported logits equal transformers' to 1e-4 (fp32) on one device and on a mesh with tp (and ep);
- greedy generation gives transformers' tokens (batched, left-padded, sharded), every token up to a near-tie
  (conftest.assert_same_greedy);
- export -> the fixture's files bit for bit, and the same config fields back;
- MoE: the experts each token is routed to are transformers' (dropless: nothing dropped);
- the switches are not vacuous: Mistral without its window, Qwen3-MoE with renormalised top-k are far off;
- config.json fields that would compute differently, and exports an architecture cannot hold: one line.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_same_greedy, greedy_gaps
from flax import nnx
from safetensors.numpy import load_file

from jaxdist import config
from jaxdist.distributed import sharding
from jaxdist.distributed.mesh import mesh_from_string
from jaxdist.errors import JaxdistError
from jaxdist.hf import export, mapping, tensors
from jaxdist.inference import decode
from jaxdist.models import registry

FIXTURES = Path(__file__).resolve().parent / "fixtures"
FAMILIES = {  # fixture -> (model.family, the sharded mesh it is checked on)
    "hf_qwen2": ("qwen2", "fsdp=4,tp=2"),
    "hf_qwen3": ("qwen3", "fsdp=4,tp=2"),
    "hf_mistral": ("mistral", "fsdp=4,tp=2"),
    "hf_mixtral": ("mixtral", "fsdp=2,ep=2,tp=2"),
    "hf_qwen3_moe": ("qwen3_moe", "fsdp=2,ep=2,tp=2"),
    "hf_gemma3": ("gemma3", "fsdp=4,tp=2"),  # its own architecture (models/gemma3.py): window 4, S/F/S/F layers
}
MOE = ("hf_mixtral", "hf_qwen3_moe")


def flat(params) -> dict:
    return {jax.tree_util.keystr(p): np.asarray(a) for p, a in jax.tree_util.tree_flatten_with_path(params)[0]}


def forward(model, params, mesh, tokens):
    with sharding.activate(mesh, model.rules):
        return np.asarray(jax.jit(lambda p, t: nnx.merge(model.graphdef, p)(t))(params, tokens))


@functools.cache  # read-only results: tests that import a fixture onto the same mesh share one import
def imported(name: str, mesh_text: str, overrides: tuple[str, ...] = (), one_device: bool = False):
    d = FIXTURES / name
    cfg = mapping.hf_config(None, list(overrides), d, mesh_text)
    mesh = mesh_from_string(mesh_text, jax.devices()[:1] if one_device else None)
    params, model = tensors.import_params(d, cfg, mesh)
    return cfg, mesh, params, model


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    """(fixture name, its reference, the import onto its sharded mesh)."""
    name = request.param
    return name, np.load(FIXTURES / name / "reference.npz"), imported(name, FAMILIES[name][1])


def test_logits_match_transformers_one_device_and_sharded(family):
    name, ref, (cfg, mesh, params, model) = family
    assert cfg.model.family == FAMILIES[name][0] and cfg.model.moe_dispatch == "dropless"
    sharded = np.abs(forward(model, params, mesh, ref["sequences"]) - ref["logits"]).max()
    cfg1, mesh1, params1, model1 = imported(name, "fsdp=1", one_device=True)
    one = np.abs(forward(model1, params1, mesh1, ref["sequences"]) - ref["logits"]).max()
    print(f"{name}: max |logit diff| one device {one:.3g}, {FAMILIES[name][1]} {sharded:.3g}")
    assert one <= 1e-4 and sharded <= 1e-4
    if name in MOE:  # each device holds its experts only (read straight from the per-expert tensors)
        leaves = jax.tree_util.tree_flatten_with_path(params)[0]
        w = [a for p, a in leaves if "w_gate_EDF" in jax.tree_util.keystr(p)]
        assert w and all(a.sharding.spec[-3] == "ep" for a in w)


def test_greedy_generation_matches_transformers(family):
    name, ref, (cfg, mesh, params, model) = family
    prompts = [ref["prompt0"].tolist(), ref["prompt1"].tolist()]
    new, logp, _, _ = decode.generate(cfg, params, model.graphdef, mesh, prompts, len(ref["greedy0"]))
    want = np.stack([ref["greedy0"], ref["greedy1"]])
    # tol 2e-4: our forward (the gaps) and the decode are each held to 1e-4 of transformers
    gaps = greedy_gaps(cfg, params, model.graphdef, mesh, prompts, want, tol=2e-4)
    assert_same_greedy(new, want, gaps, tol=2e-4, what=f"{name} greedy tokens")  # every token unless a near-tie
    for k in (0, 1):
        assert np.abs(logp[k] - ref[f"logprobs{k}"]).max() <= 1e-4


def test_export_is_the_fixture_bit_for_bit(family, tmp_path):
    name, _, (cfg, mesh, params, _) = family
    export.export(params, cfg.model, tmp_path, "float32", log=lambda *a: None)
    original, exported = (
        load_file(str(FIXTURES / name / "model.safetensors")),
        load_file(str(tmp_path / "model.safetensors")),
    )
    assert sorted(original) == sorted(exported)
    assert all(np.array_equal(original[k], exported[k]) for k in original)
    assert mapping.model_fields(tmp_path) == mapping.model_fields(FIXTURES / name)
    written = json.loads((tmp_path / "config.json").read_text())
    source = json.loads((FIXTURES / name / "config.json").read_text())
    assert written["architectures"] == source["architectures"] and written["model_type"] == source["model_type"]
    again, _ = tensors.import_params(tmp_path, cfg, mesh)
    a, b = flat(params), flat(again)
    assert all(np.array_equal(a[k], b[k]) for k in a)


@jax.jit(static_argnums=0)
def _router_logits(graphdef, params, tokens):
    m = nnx.merge(graphdef, params)
    graphdef, stacked = nnx.split(m.blocks)
    x, positions = m.embed(tokens), jnp.arange(tokens.shape[1])
    out = []
    for g in range(m.cfg.stack_depth):
        unit = nnx.merge(graphdef, jax.tree.map(lambda a, g=g: a[g], stacked))
        for block in getattr(unit, "layers", [unit]):
            if block.sparse:
                h = x + block.attn(block.attn_norm(x), positions)
                out.append((block.mlp_norm(h) @ block.mlp.router_DE[...]).reshape(-1, m.cfg.moe_experts))
            x = block(x, positions)
            x = x[0] if isinstance(x, tuple) else x
    return jnp.stack(out)


def router_logits(model, params, tokens):
    """Each MoE layer's router logits (layers, B*T, E), layer by layer on one device (no mesh)."""
    return np.asarray(_router_logits(model.graphdef, params, jnp.asarray(tokens)))


@pytest.mark.parametrize("name", MOE)
def test_router_choices_are_transformers(name):
    ref = np.load(FIXTURES / name / "reference.npz")
    cfg, _, params, model = imported(name, "fsdp=1", one_device=True)
    ours, theirs = router_logits(model, params, ref["sequences"]), ref["router_logits"]
    assert ours.shape == theirs.shape and np.abs(ours - theirs).max() <= 1e-4
    k = cfg.model.moe_topk
    pick = lambda r: np.sort(np.argsort(-r, axis=-1)[..., :k], axis=-1)
    assert np.array_equal(pick(ours), pick(theirs))  # the same experts for every token and layer
    top = -np.sort(-theirs, axis=-1)  # no choice is within twice the tolerance of a tie
    assert (top[..., k - 1] - top[..., k]).min() > 2e-4


@pytest.mark.parametrize(
    "name, override",
    [
        ("hf_mistral", "model.sliding_window=0"),
        ("hf_qwen3_moe", "model.moe_norm_topk=true"),
        ("hf_gemma3", "model.sliding_window_pattern=0"),  # every layer windowed: the full layers matter
        ("hf_gemma3", "model.rope_local_theta=1000000.0"),  # one rotary base: the local one matters
    ],
)
def test_switches_are_not_vacuous(name, override):
    """The fixture needs its switch: with it flipped the logits are far from transformers'."""
    ref = np.load(FIXTURES / name / "reference.npz")
    cfg, mesh, params, model = imported(name, "fsdp=1", one_device=True)
    key, value = override.split("=")
    cfg = cfg.replace(model={key.split(".")[1]: config.parse_override(override)[2]})
    params, model = tensors.import_params(FIXTURES / name, cfg, mesh)
    assert np.abs(forward(model, params, mesh, ref["sequences"]) - ref["logits"]).max() > 1e-2


def write_config(tmp_path, name, **edit):
    raw = {**json.loads((FIXTURES / name / "config.json").read_text()), **edit}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


@pytest.mark.parametrize(
    "name, edit, named",
    [
        ("hf_qwen2", {"use_sliding_window": True}, "use_sliding_window"),
        ("hf_qwen2", {"use_mrope": True}, "use_mrope"),
        ("hf_qwen3", {"attention_bias": True}, "attention_bias"),
        ("hf_qwen3", {"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
        ("hf_mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise"),
        ("hf_qwen3_moe", {"mlp_only_layers": [0]}, "mlp_only_layers"),
        ("hf_mistral", {"model_type": "llama"}, "does not match"),
        ("hf_mistral", {"sliding_window": 0}, "sliding_window"),
        ("hf_mistral", {"architectures": ["GemmaForCausalLM"]}, "not supported"),
        ("hf_gemma3", {"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        ("hf_gemma3", {"layer_types": ["full_attention"] * 4}, "layer_types"),
        ("hf_gemma3", {"rope_parameters": {"sliding_attention": {"rope_type": "yarn"}}}, "yarn"),
    ],
)
def test_unsupported_fields_are_named(tmp_path, name, edit, named):
    with pytest.raises(JaxdistError, match=named) as e:
        mapping.model_fields(write_config(tmp_path, name, **edit))
    assert "\n" not in str(e.value)


def test_family_defaults_and_spellings(tmp_path):
    """A field absent from config.json takes transformers' default for that family; the Hub's
    num_experts and transformers 5's num_local_experts read alike."""
    raw = json.loads((FIXTURES / "hf_mistral" / "config.json").read_text())
    del raw["sliding_window"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert mapping.model_fields(tmp_path)["sliding_window"] == 4096  # MistralConfig's default
    raw["sliding_window"] = None  # Mistral v0.2+: no window
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert mapping.model_fields(tmp_path)["sliding_window"] == 0
    raw = json.loads((FIXTURES / "hf_qwen3_moe" / "config.json").read_text())
    raw["num_experts"] = raw.pop("num_local_experts")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert mapping.model_fields(tmp_path) == mapping.model_fields(FIXTURES / "hf_qwen3_moe")


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["model.qk_norm=true"], "family=qwen3"),
        (["model.qkv_bias=true"], "family=qwen2"),
        (["model.sliding_window=8"], "family=mistral"),
        (["model.family=qwen2"], "qkv_bias"),
        (["model.family=mixtral", "model.moe_experts=4", "model.moe_norm_topk=false"], "moe_norm_topk"),
        (["model.family=qwen3_moe", "model.qk_norm=true"], "moe_experts"),
        (["model.family=mixtral", "model.moe_experts=4", "model.moe_shared_experts=1"], "moe_shared_experts"),
    ],
)
def test_export_refuses_what_the_architecture_cannot_hold(tmp_path, overrides, named):
    m = config.load(None, overrides).model
    with pytest.raises(JaxdistError, match=named) as e:
        export.export({}, m, tmp_path / "out", "float32", log=lambda *a: None)
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()


def test_sliding_window_under_context_parallelism_is_one_line():
    from jaxdist.parallel import context

    cfg = config.load(None, ["model.sliding_window=8", "mesh.shape=fsdp=4,cp=2"])
    mesh = mesh_from_string("fsdp=4,cp=2")
    with pytest.raises(JaxdistError, match="sliding_window=8 with cp=2") as e:
        context.check(cfg, mesh, sharding.make_rules())
    assert "\n" not in str(e.value)


# Each training path once (a fine-tune compiles a whole train step: 25-50 s of the suite each): qkv biases
# (qwen2), qk norms (qwen3), routed experts over ep (qwen3_moe), Gemma 3's own blocks with sliding
# windows. Mistral adds only a sliding window (trained in Gemma 3's run) and Mixtral only a softmax
# router (trained in qwen3_moe's, with the same ep=2 dispatch); their forwards are checked above.
FINE_TUNED = ["hf_qwen2", "hf_qwen3", "hf_qwen3_moe", "hf_gemma3"]


@pytest.mark.parametrize("name", FINE_TUNED)
def test_fine_tuning_each_import_lowers_the_loss(name, tmp_path):
    """train --restore hf:DIR on the default mesh (fsdp over 8 devices; ep=2 for MoE): a few AdamW
    steps on a repeating token stream lower the imported model's loss (FINE_TUNED: one family per
    training path)."""
    import jaxdist

    tokens = tmp_path / "tokens.bin"
    np.tile(np.random.default_rng(0).integers(0, 128, 64), 400).astype(np.uint16).tofile(tokens)
    overrides = [
        "model.seq_len=16",
        "train.steps=6",
        "train.eval_every=0",
        "train.global_batch=8",
        "train.log_every=1",
        "checkpoint.every=0",
        "train.plot=false",  # nothing here reads loss.png
        "optim.lr=1e-2",
        "optim.warmup_steps=0",
        "data.source=tokens",
        f"data.path={tokens}",
        *(["mesh.shape=fsdp=-1,ep=2"] if name in MOE else []),
    ]
    cfg = mapping.apply(config.load(None, overrides), FIXTURES / name)
    jaxdist.run(cfg, tmp_path / "run", log=lambda *a: None, restore=f"hf:{FIXTURES / name}")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    print(f"{name}: fine-tuning losses {[round(x, 3) for x in losses]}")
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.5, losses


def test_shipped_configs_have_the_published_parameter_counts():
    """configs/{qwen3-8b,mistral-7b,qwen3-30b-a3b}.yaml: Mistral 7B's 7,241,732,096 and Qwen3 8B's
    8,190,735,360 (their safetensors), Qwen3-30B-A3B's 30.5B total / 3.3B active (its model card)."""
    from jaxdist.models.llama import count_params

    count = lambda name: count_params(config.load(f"configs/{name}.yaml").model)
    assert count("mistral-7b")["total"] == 7_241_732_096
    assert count("qwen3-8b")["total"] == 8_190_735_360
    moe = count("qwen3-30b-a3b")
    assert round(moe["total"] / 1e9, 1) == 30.5 and round(moe["active"] / 1e9, 1) == 3.4  # card: "3.3B"


def test_plan_sizes_qwen3_30b_a3b(capsys):
    """`python -m jaxdist.plan` on the shipped config: parameter bytes per device on fsdp=8,ep=8 are
    the experts split 64 ways, the rest 8 ways (fsdp) and the norms (q/k, layer, final) replicated, exactly."""
    from jaxdist import plan

    argv = ["--config", "configs/qwen3-30b-a3b.yaml", "--devices", "64", "--mesh", "fsdp=8,ep=8", "--no-scaling"]
    assert plan.main([*argv, "--json"]) == 0
    given = json.loads(capsys.readouterr().out)["candidates"][0]
    L, E, D, F, H = 48, 128, 2048, 768, 128
    experts, norms = L * E * 3 * D * F, L * 2 * H + (2 * L + 1) * D
    rest = 30_532_122_624 - experts - norms
    assert given["memory"]["params"] == 4 * (experts / 64 + rest / 8 + norms)
    assert given["memory"]["fits"]
    # Mistral's window: the planner offers no context-parallel mesh (parallel/context.py refuses it).
    from jaxdist.planner.candidates import candidates
    from jaxdist.planner.hardware import HARDWARE

    long = config.load("configs/mistral-7b.yaml", ["model.seq_len=131072", "train.global_batch=8"])
    meshes = [e.layout.mesh for e in candidates(long, 64, HARDWARE["h100-80gb"])]
    assert meshes and all(m["cp"] == 1 for m in meshes)


def test_gemma3_refuses_the_meshes_its_layers_cannot_meet():
    """Gemma 3 under cp (no per-layer window there yet), and under pp with a table schedule (only gpipe and
    circular carry its per-layer windows and rotary bases), is one line naming why, before anything is read."""
    with pytest.raises(JaxdistError, match="mesh cp=2 is not supported by model.family=gemma3") as e:
        imported("hf_gemma3", "cp=2,fsdp=4")
    assert "\n" not in str(e.value)
    cfg = config.load(None, ["pipeline.schedule=1f1b", "model.family=gemma3"])
    with pytest.raises(JaxdistError, match="pipeline.schedule=1f1b does not run model.family=gemma3") as e:
        registry.of(cfg.model).validate(cfg, {"pp": 2, "fsdp": 4})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_import_onto_a_pipeline_layout(name):
    """pp=2: biases (flattened in the file), q/k norms and per-expert tensors (stage, layers, expert)
    fill the pipeline's stack directly."""
    from jaxdist.parallel import pipeline

    mesh = "pp=2,ep=2,fsdp=2" if name in MOE else "pp=2,fsdp=4"
    _, _, params, _ = imported(name, "fsdp=8")
    _, _, staged, model = imported(name, mesh)
    a, b = flat(params), flat(pipeline.from_stages(jax.device_get(staged), model.pipeline))
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)


def test_each_device_reads_only_its_experts(monkeypatch):
    """Mixtral onto fsdp=2,ep=2,tp=2: every per-expert tensor is read as one device's slice (a quarter:
    fsdp x tp) and each device reads its 2 of the 4 experts only, never another's."""
    from jaxdist.hf import tensors

    reads, real = [], tensors.read_block

    def spy(sl, idx, shape, n_in):
        out = real(sl, idx, shape, n_in)
        reads.append((tuple(sl.get_shape()), out.size))
        return out

    monkeypatch.setattr(tensors, "read_block", spy)
    cfg, *_ = imported.__wrapped__("hf_mixtral", "fsdp=2,ep=2,tp=2")  # an import of its own: the spy reads it
    m = cfg.model
    expert_shapes = {(m.mlp_dim, m.d_model), (m.d_model, m.mlp_dim)}
    experts = [size for shape, size in reads if shape in expert_shapes]
    assert len(experts) == 8 * (m.moe_experts // 2) * 3 * m.num_layers  # devices x own experts x w1/w3/w2 x layers
    assert all(size * 4 == m.mlp_dim * m.d_model for size in experts)


@pytest.mark.parametrize("name, mesh_text", [("hf_qwen2", "cp=4,tp=2"), ("hf_qwen3_moe", "cp=2,ep=2,fsdp=2")])
def test_logits_match_transformers_under_context_parallelism(name, mesh_text):
    """q/k/v biases, q/k norms and the MoE layer with the sequence split over cp (load-balanced order)."""
    from jaxdist.parallel import context

    ref = np.load(FIXTURES / name / "reference.npz")
    cfg, mesh, params, model = imported(name, mesh_text, ("model.seq_len=16",))
    perm = context.order(16, dict(mesh.shape)["cp"])
    with sharding.activate(mesh, model.rules):
        out = jax.jit(lambda p, t: nnx.merge(model.graphdef, p)(t, positions_T=perm))(params, ref["sequences"][:, perm])
    out = np.asarray(out[0] if isinstance(out, tuple) else out)[:, context.inverse(perm)]
    assert np.abs(out - ref["logits"]).max() <= 1e-4


def test_biases_and_qk_norms_get_no_weight_decay():
    """Like the norms (and transformers' fine-tuning recipes), the Qwen2 biases are not decayed."""
    from jaxdist.optim.adamw import decay_mask

    cfg, _, _, model = imported("hf_qwen2", "fsdp=8")
    mask = flat(decay_mask(model.names))
    biases = [k for k in mask if k.endswith(("['bq_NH']", "['bk_KH']", "['bv_KH']"))]
    assert len(biases) == 3 and not any(mask[k] for k in biases)
    assert not any(v for k, v in mask.items() if "norm" in k)
    assert mask["['blocks']['attn']['wq_DNH']"] and mask["['embed_VD']"]


def test_gemma3_lora_on_every_projection():
    """LoRA on Gemma 3's seven projections (q, k, v, o, gate, up, down): with B = 0 the adapted import
    is transformers' model (1e-4); with random B the merged weights, run by the plain model, give the
    adapted logits (1e-5 of the largest)."""
    from jaxdist.adapters import tree as adapters
    from jaxdist.training import step

    d, mesh_text = FIXTURES / "hf_gemma3", "fsdp=4,tp=2"
    ref = np.load(d / "reference.npz")
    lora = ["lora.rank=4", "lora.alpha=8", "lora.base_dtype=float32", "lora.targets=[q,k,v,o,gate,up,down]"]
    cfg = mapping.hf_config(None, lora, d, mesh_text)
    mesh = mesh_from_string(mesh_text)
    base, model = tensors.import_params(d, cfg.replace(lora=dict(rank=0)), mesh)
    prog = step.build_program(cfg, mesh)
    state = prog.state_from_params(base)
    run = lambda params, m=model: forward(m, params, mesh, ref["sequences"])
    lora_model = dataclasses.replace(model, graphdef=prog.graphdef)
    assert np.abs(run(state.params, lora_model) - ref["logits"]).max() <= 1e-4
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(adapters.trainable(state.params))]
    assert len(names) == 14 and all(any(w in n for n in names) for w in ("wq", "wk", "wv", "wo", "gate", "up", "down"))
    rng = np.random.default_rng(0)
    params = jax.tree_util.tree_map_with_path(
        lambda p, a: (
            a + 0.3 * rng.normal(size=a.shape).astype(np.float32) if "lora_b" in jax.tree_util.keystr(p) else a
        ),
        jax.device_get(state.params),
    )
    adapted = run(params, lora_model)
    merged = run(jax.jit(lambda p: adapters.merge(p, cfg.lora))(params))
    assert np.abs(merged - adapted).max() <= 1e-5 * np.abs(adapted).max()
    assert np.abs(adapted - ref["logits"]).max() > 1e-2  # the adapters act
