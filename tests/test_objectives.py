"""Preference objectives (jaxdist/objectives): agreement with TRL, the reference, equivalence, data, errors.

- DPO's loss, TRL's metrics and the gradients of the norm, head and embedding equal a real
  `trl.DPOTrainer`'s on the tiny Llama fixture (`tests/fixtures/trl/`, made by scripts/fixtures/make_trl_fixture.py);
- with the reference equal to the policy the loss is ln 2 (and the rewards 0);
- every loss variant (DPO sigmoid / IPO / robust, SimPO, ORPO) equals TRL's on the fixture's log-probs;
- with LoRA (reference = the base, adapters off) fsdp=4,tp=2 with 2 micro-batches equals one device
  without accumulation (loss, metrics, gradients), and a fresh adapter gives ln 2 too;
- `objective.method=lm` keeps the default run name's hash; prepare --preference keeps pairs whole.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import MICRO_MODEL

from jaxdist import config
from jaxdist.config import Config
from jaxdist.config.tuning_sections import ObjectiveConfig
from jaxdist.data import loss_mask, prefprep
from jaxdist.data import prepare as prepare_mod
from jaxdist.distributed import sharding
from jaxdist.distributed.mesh import mesh_from_string
from jaxdist.errors import JaxdistError
from jaxdist.hf import mapping
from jaxdist.hf import tensors as hf_tensors
from jaxdist.objectives import pairs, registry
from jaxdist.training import rundir, step

REPO = Path(__file__).resolve().parent.parent
HF = REPO / "tests" / "fixtures" / "hf_llama"
TRL = REPO / "tests" / "fixtures" / "trl"
QWEN = REPO / "tests" / "fixtures" / "chat" / "qwen"
TOL = 1e-5
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)


def records(fx) -> np.ndarray:
    return loss_mask.encode(fx["records"], fx["masks"])


@pytest.fixture(scope="module")
def trl_setup():
    """The fixture policy and reference imported on one device, and the DPO stage's (loss, grads, metrics)
    function compiled once (the reference passed as the stage's state)."""
    fx = np.load(TRL / "dpo.npz")
    mesh_text = "dp=1"
    devices = jax.devices()[:1]
    cfg = mapping.hf_config(None, ["objective.method=dpo", "objective.beta=0.1"], HF, mesh_text)
    mesh = mesh_from_string(mesh_text, devices)
    policy, model = hf_tensors.import_params(HF, cfg, mesh)
    reference, _ = hf_tensors.import_params(TRL / "reference", cfg, mesh)
    stage = registry.stage(step.model_apply(cfg, model, None), cfg)
    fn = jax.jit(lambda p, r, t: stage.apply(p, t, r, 0))

    def run(p, r):
        with sharding.activate(mesh, model.rules):
            return jax.device_get(fn(p, r, records(fx)))

    return fx, policy, reference, run, model


def test_dpo_loss_metrics_and_gradients_match_trl(trl_setup):
    fx, policy, reference, run, model = trl_setup
    grads, loss, _, metrics = run(policy, reference)
    assert abs(float(loss) - float(fx["loss"])) < TOL
    for k in METRICS:
        assert abs(float(metrics[k]) - float(fx[k])) < TOL, k
    # HF names: model.norm.weight, lm_head.weight (V, D), model.embed_tokens.weight (V, D)
    ours = {"norm": grads["final_norm"]["scale"], "head": grads["head_DV"].T, "embed": grads["embed_VD"]}
    for k, g in ours.items():
        want = fx[f"grad/{k}"]
        assert np.abs(np.asarray(g) - want).max() <= TOL * max(1.0, np.abs(want).max()), k


VARIANTS = {
    "dpo": ObjectiveConfig(method="dpo", beta=0.1),
    "dpo_ipo": ObjectiveConfig(method="dpo", beta=0.1, dpo_loss="ipo"),
    "dpo_robust": ObjectiveConfig(method="dpo", beta=0.1, dpo_loss="robust", label_smoothing=0.1),
    "simpo": ObjectiveConfig(method="simpo", beta=2.0, gamma=0.5, label_smoothing=0.1),
    "orpo": ObjectiveConfig(method="orpo", orpo_lambda=0.1),
}


@pytest.mark.parametrize("name", VARIANTS)
def test_each_loss_matches_trl_on_its_log_probs(name):
    """Every loss variant on the fixture pairs' log-probs (TRL's `get_batch_logps`) against TRL: the real
    DPOTrainer for sigmoid / ipo / robust, `CPOTrainer.cpo_loss` (SimPO) and `ORPOTrainer.odds_ratio_loss`
    plus the chosen NLL (ORPO), with their gradients w.r.t. the summed log-probs where TRL's fixture has
    them. Tolerance 1e-5, relative above 1 (IPO's loss is 22.8)."""
    fx, obj = np.load(TRL / f"{name}.npz"), VARIANTS[name]
    loss_fn = registry.OBJECTIVES[obj.method].loss
    counts, ref = (np.asarray(fx[k], np.float32) for k in ("counts", "ref_logps"))
    per_token = len(counts) / counts[:, 0].sum()

    def mean_loss(logps):
        total, stats = pairs.summed(loss_fn(logps, counts, ref, obj), per_token)
        return total / len(counts), {k: v / len(counts) for k, v in stats.items()}

    (loss, stats), grad = jax.value_and_grad(mean_loss, has_aux=True)(np.asarray(fx["logps"], np.float32))
    close = lambda a, b: abs(float(a) - float(b)) <= TOL * max(1.0, abs(float(b)))
    assert close(loss, fx["loss"]), (float(loss), float(fx["loss"]))
    for k in [*METRICS, "nll_loss", "log_odds_ratio", "log_odds_chosen"]:
        if k in fx:
            assert close(stats[k], fx[k]), k
    if "grad/logps" in fx:
        assert np.abs(np.asarray(grad) - fx["grad/logps"]).max() <= TOL


def test_dpo_with_reference_equal_to_policy_is_ln2(trl_setup):
    fx, policy, _, run, _ = trl_setup
    _, loss, _, metrics = run(policy, policy)
    assert abs(float(loss) - math.log(2)) < 1e-6
    assert abs(float(metrics["rewards/margins"])) < 1e-7 and float(metrics["rewards/accuracies"]) == 0.0
    assert abs(float(metrics["logps/chosen"]) - float(fx["logps/chosen"])) < TOL  # the policy's, as TRL's


def pair_batches(cfg, seed=3) -> np.ndarray:
    """Random pair records of `cfg`'s shape: prompts of 3..8 tokens, completions of 1..6, mask on completions."""
    rng = np.random.default_rng(seed)
    W = cfg.model.seq_len + 1
    ids = rng.integers(0, cfg.model.vocab_size, (cfg.train.global_batch, 2 * W)).astype(np.int32)
    mask = np.zeros_like(ids)
    for b in range(ids.shape[0]):
        prompt = rng.integers(3, 9)
        for side in (0, 1):
            mask[b, side * W + prompt : side * W + prompt + rng.integers(1, 7)] = 1
    return loss_mask.encode(ids, mask)


def stage_outputs(cfg, mesh_text, tokens, lora=False):
    """(loss, metrics, gradients) of the program's stage at its initial state (reference = the init)."""
    n = math.prod(int(part.split("=")[1]) for part in mesh_text.split(","))
    mesh = mesh_from_string(mesh_text, jax.devices()[:n])
    prog = step.build_program(cfg, mesh)
    state = prog.init_state(0)
    placed = jax.device_put(tokens, prog.batch_sharding)
    fn = jax.jit(lambda s, t: prog.gradients.apply(s.params, t, s.reducer_state, s.step))
    with prog.activate():
        grads, loss, _, metrics = fn(state, placed)
    return jax.device_get((loss, metrics, grads))


@pytest.fixture(scope="module")
def dpo_cfg(tiny_cfg):
    return tiny_cfg.replace(
        model=dict(MICRO_MODEL, num_kv_heads=2), objective=dict(method="dpo", beta=0.5), train=dict(global_batch=8)
    )


def test_dpo_lora_sharded_with_accumulation_equals_one_device(dpo_cfg):
    """DPO with LoRA on fsdp=4,tp=2 with 2 micro-batches vs one device: the stage's loss, metrics and
    gradients at the equivalence tests' tolerance (1e-5 of each tensor's largest entry). The reference is
    the base with the adapters off: the stage keeps no copy (its state is empty), and a fresh adapter's
    policy (B = 0) equals its reference, so the loss is ln 2 while the adapters get a real gradient."""
    cfg = dpo_cfg.replace(lora=dict(rank=4))
    assert registry.keeps_reference_copy(cfg) is False and registry.keeps_reference_copy(dpo_cfg) is True
    tokens = pair_batches(cfg)
    one = stage_outputs(cfg, "dp=1", tokens)
    many = stage_outputs(cfg.replace(train=dict(grad_accum_steps=2)), "fsdp=4,tp=2", tokens)
    assert abs(float(one[0]) - math.log(2)) < 1e-6 and abs(float(many[0]) - math.log(2)) < 1e-6
    for k in METRICS:
        assert abs(float(one[1][k]) - float(many[1][k])) < TOL, k
    for a, b in zip(jax.tree.leaves(one[2]), jax.tree.leaves(many[2])):
        assert np.abs(a - b).max() <= TOL * max(np.abs(a).max(), 1e-12)
    assert max(np.abs(g).max() for g in jax.tree.leaves(one[2])) > 1e-4  # a real gradient, not zeros


def test_orpo_sharded_with_accumulation_equals_one_device(dpo_cfg):
    """ORPO (full fine-tuning, no reference; its NLL averaged over the whole batch's chosen tokens, the
    term micro-batches could get wrong) on fsdp=4,tp=2 with 2 micro-batches vs one device: loss, metrics
    and gradients to 1e-5 (of each tensor's largest entry for the gradients). SimPO's per-pair mean takes
    the path DPO's test covers, without the reference; not compiled again here (suite time)."""
    method = "orpo"
    cfg = dpo_cfg.replace(objective=dict(method=method, orpo_lambda=0.1))
    assert registry.keeps_reference_copy(cfg) is False
    tokens = pair_batches(cfg)
    one = stage_outputs(cfg, "dp=1", tokens)
    many = stage_outputs(cfg.replace(train=dict(grad_accum_steps=2)), "fsdp=4,tp=2", tokens)
    assert abs(float(one[0]) - float(many[0])) < TOL * max(1.0, abs(float(one[0])))
    for k in one[1]:
        assert abs(float(one[1][k]) - float(many[1][k])) < TOL * max(1.0, abs(float(one[1][k]))), k
    assert ("nll_loss" in one[1]) == (method == "orpo")
    for a, b in zip(jax.tree.leaves(one[2]), jax.tree.leaves(many[2])):
        assert np.abs(a - b).max() <= TOL * max(np.abs(a).max(), 1e-12)
    assert max(np.abs(g).max() for g in jax.tree.leaves(one[2])) > 1e-4


def test_default_objective_keeps_run_names_and_the_registry_agrees():
    assert rundir.identity(Config()) == "bef0e0b4"  # the default config's hash before the section existed
    assert rundir.identity(Config().replace(objective=dict(method="dpo"))) != "bef0e0b4"
    assert set(registry.OBJECTIVES) == set(typing.get_args(typing.get_type_hints(ObjectiveConfig)["method"]))
    assert {n for n, o in registry.OBJECTIVES.items() if o.paired} == set(prefprep.PAIRED)
    assert registry.is_default(Config()) and dataclasses.asdict(Config())["objective"]["method"] == "lm"


def test_unsupported_meshes_and_methods_are_one_line_errors(dpo_cfg):
    with pytest.raises(JaxdistError, match="objective.method=dpo does not support reduce.method=dense"):
        step.build_program(dpo_cfg.replace(reduce=dict(method="dense")), mesh_from_string("dp=2", jax.devices()[:2]))
    with pytest.raises(JaxdistError, match="pipeline parallelism"):
        registry.check(dpo_cfg, mesh_from_string("pp=2", jax.devices()[:2]))


def prepare(tmp_path, lines, *extra):
    src = tmp_path / "pairs.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" if not isinstance(x, str) else x + "\n" for x in lines))
    out = tmp_path / "out"
    args = prepare_mod.parse_args(
        [
            "prepare",
            "--preference",
            "--tokenizer",
            str(QWEN),
            "--seq-len",
            "96",
            "--out",
            str(out),
            "--val-fraction",
            "0",
            str(src),
            *extra,
        ]
    )
    logs = []
    manifest = prepare_mod.prepare(args, log=logs.append)
    return out, manifest, logs


def test_prepare_preference_keeps_prompt_and_completions_apart(tmp_path):
    plain = {"prompt": "The sky is", "chosen": " blue.", "rejected": " a rather green colour."}
    conv = {
        "prompt": [{"role": "user", "content": "Hi?"}],
        "chosen": [{"role": "assistant", "content": "Hello."}],
        "rejected": [{"role": "assistant", "content": "No."}],
    }
    out, manifest, logs = prepare(
        tmp_path,
        [plain, conv, {"prompt": "x", "chosen": "", "rejected": "y"}, "not json", {**plain, "chosen": " z" * 200}],
    )
    pref = manifest["preference"]
    assert (
        pref["skipped"] == {"bad_json": 1, "empty": 1, "too_long": 1} and manifest["splits"]["train"]["documents"] == 2
    )
    assert "pairs are never cut" in (out / "skipped.txt").read_text()
    ids = np.fromfile(out / "train" / "000000.bin", manifest["dtype"]).reshape(2, 2, 97).astype(np.int64)
    mask = np.fromfile(out / "train" / "000000.mask", np.uint8).reshape(2, 2, 97)
    ct = prefprep.load_tokenizer(str(QWEN), None)
    for pair, record in zip(range(2), (plain, conv)):
        p, c, r = prefprep.tokenize_pair(ct, record)
        for side, completion in ((0, c), (1, r)):
            n = len(p) + len(completion)
            assert ids[pair, side, : len(p)].tolist() == p and ids[pair, side, len(p) : n].tolist() == completion
            assert mask[pair, side].tolist() == [0] * len(p) + [1] * len(completion) + [0] * (97 - n)
            assert (ids[pair, side, n:] == pref["pad_id"]).all()
    # TRL's rule for plain strings: the completions get the EOS text
    eos = ct.parser.token_to_id(ct.variables["eos_token"])
    assert all(side[-1] == eos for side in prefprep.tokenize_pair(ct, plain)[1:])


def test_prepare_preference_stop_and_flag_errors(tmp_path):
    with pytest.raises(JaxdistError, match=r"pairs.jsonl:1: prompt \+ chosen is \d+ tokens, more than a row"):
        prepare(tmp_path, [{"prompt": "p", "chosen": " a" * 200, "rejected": " b"}], "--on-error", "stop")
    with pytest.raises(JaxdistError, match="--loss-on does not apply to --preference"):
        prepare(tmp_path, [{"prompt": "p", "chosen": "a", "rejected": "b"}], "--loss-on", "all")
    assert not (tmp_path / "out").exists()


def test_training_reads_pairs_only_under_a_pair_objective(tmp_path, small_cfg):
    from jaxdist.data import data_rules
    from jaxdist.data import loader as loader_mod

    out, _, _ = prepare(tmp_path, [{"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}])
    base = dict(source="tokens", path=str(out))
    cfg = small_cfg.replace(data=base, model=dict(seq_len=96, vocab_size=512))
    with pytest.raises(JaxdistError, match="holds preference pairs .* but objective.method=lm"):
        loader_mod.load_windows(cfg)
    train, _ = loader_mod.load_windows(cfg.replace(objective=dict(method="dpo")))
    assert (
        len(train) == 1
        and train[0].shape == (194,)
        and data_rules.row_width(cfg.replace(objective=dict(method="dpo"))) == 194
    )
    with pytest.raises(JaxdistError, match="model.seq_len=32; set model.seq_len=96"):
        loader_mod.load_windows(cfg.replace(objective=dict(method="dpo"), model=dict(seq_len=32)))
    assert config.load(None, ["objective.method=dpo"]).objective.beta == 0.1


def planner_arguments(cfg, sizes: dict) -> tuple[float, float]:
    """(the planner's bytes per device the compiled step receives, of which the reference copy)."""
    from jaxdist.distributed.mesh import AXES
    from jaxdist.observe import report
    from jaxdist.planner import memory
    from jaxdist.planner.layout import Layout

    full = {a: sizes.get(a, 1) for a in AXES}
    mem = memory.estimate(Layout(cfg, full, report.hardware_for(jax.devices()[0])))
    return mem.arguments, mem.reference


def test_dpo_train_resumes_as_the_uninterrupted_run_and_the_planner_counts_its_reference(tmp_path, tiny_cfg):
    """DPO through jaxdist.run (full fine-tuning: the reference is a copy in the stage's state, saved in each
    checkpoint), 3 steps on dp=4,fsdp=2; resumed at step 2 (a copy of the run without its step-3
    checkpoint), step 3's loss, grad norm and TRL metrics equal the uninterrupted run's (1e-6: the same
    program on the same batch and state). The planner's arguments (parameters, AdamW moments, the reference
    copy, the two-row pair batch) equal the compiled step's to 1%; without the copy they would be short by
    a quarter."""
    import shutil

    import jaxdist

    lines = [{"prompt": f"Say {n}.", "chosen": f" {n}", "rejected": " No."} for n in range(24)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    argv = ["prepare", "--preference", "--tokenizer", str(QWEN), "--seq-len", "16", "--val-fraction", "0"]
    prepare_mod.prepare(
        prepare_mod.parse_args([*argv, "--out", str(tmp_path / "p"), str(tmp_path / "pairs.jsonl")]),
        log=lambda m: None,
    )
    cfg = tiny_cfg.replace(
        model=dict(MICRO_MODEL, vocab_size=512),
        mesh=dict(shape="dp=4,fsdp=2"),
        data=dict(source="tokens", path=str(tmp_path / "p")),
        objective=dict(method="dpo", beta=0.5),
        train=dict(global_batch=8, steps=3, eval_every=0, log_every=1),
        checkpoint=dict(every=2, keep=5, async_save=False),  # step 2 (resumed from) and the last
    )
    jaxdist.run(cfg, tmp_path / "a", log=lambda *a, **k: None)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "3")
    jaxdist.run(cfg, tmp_path / "b", log=lambda *a, **k: None)
    a, b = ([json.loads(x) for x in (tmp_path / r / "metrics.jsonl").read_text().splitlines()] for r in "ab")
    (step3a,), (step3b,) = ([r for r in rows if r.get("step") == 3] for rows in (a, b))
    for k in ("loss", "grad_norm", "rewards/margins", "rewards/chosen", "logps/rejected"):
        assert abs(step3a[k] - step3b[k]) <= 1e-6 * max(1.0, abs(step3a[k])), k
    assert step3a["loss"] != a[0]["loss"]  # it trained: step 3 is not step 1
    compiled = a[-1]["memory_compiled_arguments"]
    predicted, reference = planner_arguments(cfg, {"dp": 4, "fsdp": 2})
    assert predicted == pytest.approx(compiled, rel=0.01) and reference > 0.2 * compiled


def test_dpo_with_a_moe_model_adds_the_router_aux_loss_as_the_lm_objective(dpo_cfg):
    """DPO on a MoE model (one device): the policy's router auxiliary objective enters the training loss as
    the LM objective adds it (`reduce.gradients.objective_sums`: the model's aux sum x 1 / routed positions, a
    mean over every position of the batch's rows). At step 0 the reference is the policy, so the DPO part is ln 2 and the
    loss is ln 2 + that aux term (1e-6); the term is > 0 and its gradient reaches the router."""

    # capacity dispatch with room for every token: the aux objective is the router's, whatever the
    # dispatch, and its program compiles faster than dropless's lax.switch of tiers
    moe = dict(moe_experts=4, moe_topk=2, moe_dispatch="capacity", moe_capacity_factor=8.0)
    cfg = dpo_cfg.replace(model=moe, train=dict(global_batch=4))
    prog = step.build_program(cfg, mesh_from_string("dp=1", jax.devices()[:1]))
    state = prog.init_state(0)
    rng = np.random.default_rng(0)
    W = cfg.model.seq_len + 1
    ids = rng.integers(1, cfg.model.vocab_size, (8, W))
    mask = (np.arange(W)[None, :] >= rng.integers(3, 8, (8, 1))).astype(np.int64)
    batch = np.asarray(loss_mask.encode(ids, mask)).reshape(4, 2 * W)
    with prog.activate():
        grads, loss, _, metrics = jax.jit(lambda p, r, t: prog.gradients.apply(p, t, r, 0))(
            state.params, state.reducer_state, batch
        )
        inputs = loss_mask.split(pairs.as_rows(batch)[:, :-1])[0]
        aux = jax.jit(lambda p: prog.apply_fn(p, inputs)[1]["objective"])(state.params)
    expected = float(aux) / (8 * (W - 1))  # the LM objective's weight: a mean over the 8 rows' W - 1 positions
    assert expected > 1e-4
    assert abs(float(metrics["aux_loss"]) - expected) < 1e-6 * max(1.0, expected)
    assert abs(float(loss) - (math.log(2) + expected)) < 1e-6
    router = [g for path, g in jax.tree_util.tree_leaves_with_path(grads) if "router" in jax.tree_util.keystr(path)]
    assert router and max(float(np.abs(g).max()) for g in router) > 0


def test_plan_says_what_it_leaves_out_for_each_objective(capsys):
    """`python -m jaxdist.plan` sizes a DPO / GRPO run's train step (the reference copy and the two-row batch
    counted, test_dpo_train_resumes_...) and says in a line what it does not model; lm has no such line."""
    from jaxdist import plan

    notes = {}
    for method in ("lm", "dpo", "grpo"):
        argv = ["--devices", "8", "--hardware", "h100-80gb", "--mesh", "fsdp=8", "--json", "--no-scaling"]
        assert plan.main([*argv, f"objective.method={method}", "objective.reward=[digits]"]) == 0
        notes[method] = json.loads(capsys.readouterr().out)["objective_note"]
    assert notes["lm"] is None
    assert "reference copy counted" in notes["dpo"] and "rejected row" in notes["dpo"]
    assert "rollout decoding" in notes["grpo"] and "not modeled" in notes["grpo"]
