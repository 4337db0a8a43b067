"""GRPO (jaxdist/objectives/grpo.py): agreement with TRL's GRPOTrainer, advantages, rewards, rollouts, sharding.

- the loss of each `loss_type` (grpo, bnpo, dr_grpo, dapo), TRL's `kl` and `clip_ratio/*`, and the gradients of
  the norm, head and embedding equal a real `trl.GRPOTrainer._compute_loss` on the tiny Llama fixture with
  fixed completions, old and reference log-probs (`tests/fixtures/trl/grpo_*.npz`, made by
  scripts/fixtures/make_trl_grpo_fixture.py); the per-token log-probs (temperature 0.7) and advantages agree too.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import MICRO_MODEL

from jaxdist.data import loss_mask
from jaxdist.distributed import sharding
from jaxdist.distributed.mesh import mesh_from_string
from jaxdist.errors import JaxdistError
from jaxdist.hf import mapping
from jaxdist.hf import tensors as hf_tensors
from jaxdist.inference import rollout
from jaxdist.objectives import grpo, grpo_stage, rewards
from jaxdist.training import step

REPO = Path(__file__).resolve().parent.parent
HF = REPO / "tests" / "fixtures" / "hf_llama"
TRL = REPO / "tests" / "fixtures" / "trl"
QWEN = REPO / "tests" / "fixtures" / "chat" / "qwen"
TOL = 1e-5
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
CLIPS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


def settings(fx, loss_type):
    return grpo.GRPO(
        group_size=int(fx["config/group_size"]),
        beta=float(fx["config/beta"]),
        epsilon=float(fx["config/epsilon"]),
        temperature=float(fx["config/temperature"]),
        max_new_tokens=int(fx["config/max_completion_length"]),
        loss_type=loss_type,
    )


def padded(fx, key):
    """TRL's (N, completion) per-token values placed on jaxdist's (N, W - 1) targets (completion at the end)."""
    v = fx[key].astype(np.float32)
    T = fx["rows"].shape[1] - 1
    return np.concatenate([np.zeros((v.shape[0], T - v.shape[1]), np.float32), v], axis=1)


@pytest.fixture(scope="module")
def trl_setup():
    """The fixture policy and reference imported on one device; `logps(params)` and the loss's (value, grads)
    jitted once each: the loss types differ only in the token weights, passed as an argument."""
    mesh = mesh_from_string("dp=1", jax.devices()[:1])
    cfg = mapping.hf_config(None, [], HF, "dp=1")
    policy, model = hf_tensors.import_params(HF, cfg, mesh)
    reference, _ = hf_tensors.import_params(TRL / "reference", cfg, mesh)
    apply_fn = step.model_apply(cfg, model, None)
    fx = np.load(TRL / "grpo_dapo.npz")
    rows = loss_mask.encode(fx["rows"], fx["masks"])
    T = float(fx["config/temperature"])
    logps = jax.jit(lambda p: grpo.token_logps(apply_fn, p, rows, T))

    g = settings(fx, "dapo")
    adv = grpo.advantages(fx["rewards"], g.group_size, g.scale_rewards)

    def loss(params, w):
        return grpo.loss_sums(apply_fn, params, rows, adv, padded(fx, "old_logps"), padded(fx, "ref_logps"), w, g)

    value_and_grad = jax.jit(jax.value_and_grad(loss, has_aux=True))
    mask = jnp.asarray(loss_mask.split(rows[:, 1:])[1])
    grad = lambda params, loss_type: value_and_grad(params, grpo.weights(mask, loss_type, g.max_new_tokens))

    def run(fn, *args):
        with sharding.activate(mesh, model.rules):
            return jax.device_get(fn(*args))

    return fx, policy, reference, logps, grad, run


def test_log_probs_and_advantages_match_trl(trl_setup):
    fx, policy, reference, logps, _, run = trl_setup
    n = fx["policy_logps"].shape[1]
    for params, key in ((policy, "policy_logps"), (reference, "ref_logps")):
        got, mask = run(logps, params)
        assert np.abs((got[:, -n:] - fx[key]) * mask[:, -n:]).max() < TOL, key
    adv = grpo.advantages(fx["rewards"], int(fx["config/group_size"]))
    assert np.abs(adv - fx["advantages"]).max() < TOL and adv[5] == 0.0  # the NaN reward: advantage 0


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_grpo_loss_statistics_and_gradients_match_trl(trl_setup, loss_type):
    """Tolerance 1e-5 on the loss and TRL's statistics, 1e-5 of the largest entry on each gradient."""
    _, policy, _, _, grad, run = trl_setup
    fx = np.load(TRL / f"grpo_{loss_type}.npz")
    (loss, stats), grads = run(grad, policy, loss_type)
    assert abs(float(loss) - float(fx["loss"])) < TOL, (float(loss), float(fx["loss"]))
    tokens = float(stats["completion_tokens"])
    for k in ("kl", *CLIPS):
        assert abs(float(stats[k]) / tokens - float(fx[k])) < TOL, k
    assert float(fx["clip_ratio/low_mean"]) > 0 and float(fx["clip_ratio/high_mean"]) > 0  # both clips exercised
    ours = {"norm": grads["final_norm"]["scale"], "head": grads["head_DV"].T, "embed": grads["embed_VD"]}
    for k, g in ours.items():
        want = fx[f"grad/{k}"]
        assert np.abs(np.asarray(g) - want).max() <= TOL * max(1.0, np.abs(want).max()), k


def test_rewards_call_trl_style_functions_and_refuse_bad_ones(tmp_path):
    """A TRL-signature function from a file, the built-ins, weights, None / NaN as unscorable, one-line errors."""
    f = tmp_path / "my_rewards.py"
    f.write_text(
        "def length(prompts, completions, completion_ids, answer, **kw):\n"
        "    return [None if c == 'skip' else float(len(c)) for c in completions]\n"
        "def boom(prompts, completions, **kw):\n    raise KeyError('x')\n"
        "def short(prompts, completions, **kw):\n    return [1.0]\n"
        "def text(prompts, completions, **kw):\n    return ['a'] * len(completions)\n"
    )
    fns = {n: rewards.load(n) for n in (f"{f}:length", "answer_match", "digits")}
    completions = ["12 apples", "skip", "12", "x"]
    cols = {"answer": ["12", "3", "12", "12"]}
    total, per = rewards.score(fns, [1.0, 2.0, 0.5], ["p"] * 4, completions, cols)
    assert per["answer_match"].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert np.isnan(per[f"{f}:length"][1]) and per["digits"][0] == 2 / 9
    assert total[0] == 9 + 2 + 0.5 * 2 / 9 and total[1] == 0.0  # one function declined, the others count
    assert rewards.score({"l": fns[f"{f}:length"]}, [1.0], ["p"], ["skip"], {"answer": ["1"]})[0][0] != 0  # NaN
    for name, match in (("boom", "raised KeyError"), ("short", "returned 1 rewards for 4"), ("text", "returned str")):
        with pytest.raises(JaxdistError, match=f"reward function .*{name} {match}"):
            rewards.score({f"{f}:{name}": rewards.load(f"{f}:{name}")}, [1.0], ["p"] * 4, completions, cols)
    for bad, match in (
        ("nope", "neither a built-in"),
        (f"{tmp_path}/x.py:f", "is not a file"),
        (f"{f}:zz", "no function"),
    ):
        with pytest.raises(JaxdistError, match=match):
            rewards.load(bad)


def test_rows_keep_the_completion_through_its_first_eos():
    rows, kept = rollout.rows_of([[5, 6], [7]], np.array([[9, 2, 9], [3, 4, 9]]), {2}, 6, 0)
    ids, mask = loss_mask.split(rows)
    assert kept == [[9, 2], [3, 4, 9]]
    assert np.asarray(ids).tolist() == [[5, 6, 9, 2, 0, 0], [7, 3, 4, 9, 0, 0]]
    assert np.asarray(mask).tolist() == [[0, 0, 1, 1, 0, 0], [0, 1, 1, 1, 0, 0]]


@pytest.fixture(scope="module")
def grpo_run(tiny_cfg):
    """GRPO on the micro model, fsdp=4,tp=2 with 2 micro-batches, beta > 0 (a reference copy), 2 iterations."""
    cfg = tiny_cfg.replace(model=dict(MICRO_MODEL, num_kv_heads=2), train=dict(global_batch=8, grad_accum_steps=2))
    g = grpo.GRPO(group_size=4, beta=0.1, max_new_tokens=6, iterations=2, loss_type="grpo")
    mesh = mesh_from_string("fsdp=4,tp=2", jax.devices())
    run = rollout.GRPORun(cfg, mesh, g, {"digits": rewards.load("digits")}, [1.0], lambda ids: "1a" * len(ids), [])
    return run, run.prog.init_state(0)


def test_rollouts_sample_the_training_weights_at_the_rows_positions(grpo_run):
    """The decoder's log-probs of the tokens it sampled (on the training mesh, from the state's arrays) equal
    the training forward's on the rows built from them (1e-4: two programs): same weights, same positions."""
    run, state = grpo_run
    out = run.sample(state.params, [[1, 2, 3], [4, 5, 6, 7, 8]], seed=0)
    assert out.rows.shape == (8, 17) and out.logprobs.shape == (8, 6)
    with run.prog.activate():
        logps, mask = jax.device_get(
            jax.jit(lambda p, r: grpo.token_logps(run.prog.apply_fn, p, r))(state.params, out.rows)
        )
    for n in range(8):
        start = 3 if n < 4 else 5
        assert mask[n].sum() == 6 and mask[n, start - 1 : start + 5].all()
        assert np.abs(logps[n, start - 1 : start + 5] - out.logprobs[n]).max() < 1e-4
    for mesh, what in (("pp=2", "pipeline parallelism"), ("cp=2", "context parallelism")):
        with pytest.raises(JaxdistError, match=f"GRPO does not support {what}"):
            rollout.GRPORun(run.cfg, mesh_from_string(mesh, jax.devices()[:2]), run.g, {}, [], str, [])
    with pytest.raises(JaxdistError, match="train.global_batch=6 must be a multiple of group_size=4"):
        rollout.GRPORun(run.cfg.replace(train=dict(global_batch=6)), run.mesh, run.g, {}, [], str, [])
    with pytest.raises(JaxdistError, match="GRPO group_size=1: a group needs at least 2 completions"):
        grpo.GRPO(group_size=1)
    with pytest.raises(JaxdistError, match="a prompt of 12 tokens \\+ max_new_tokens 6 is more than a row"):
        run.sample(state.params, [[1] * 12], seed=0)


def test_grpo_stage_sharded_with_accumulation_equals_one_device(grpo_run, tiny_cfg):
    """The GRPO stage's loss, statistics and gradients on fsdp=4,tp=2 with 2 micro-batches equal one device
    without accumulation (1e-5 of each tensor's largest entry), with a reference different from the policy
    (beta > 0: the stage's copy, perturbed) and old log-probs different from the policy's (iterations > 1)."""
    run, state = grpo_run
    rng = np.random.default_rng(0)
    out = run.sample(state.params, [[1, 2, 3], [4, 5, 6, 7, 8]], seed=1)
    adv = rng.normal(size=8).astype(np.float32)
    old = rng.normal(-5.5, 0.3, (8, 16)).astype(np.float32)
    batch = grpo_stage.pack(out.rows, adv, old)
    ref = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(1), x.shape, x.dtype), state.reducer_state)

    def outputs(prog, params, ref):
        fn = jax.jit(lambda p, r, t: prog.gradients.apply(p, t, r, 0))
        with prog.activate():
            grads, loss, _, metrics = fn(params, ref, jax.device_put(batch, prog.batch_sharding))
        return jax.device_get((loss, metrics, grads))

    many = outputs(run.prog, state.params, ref)
    one_cfg = run.cfg.replace(train=dict(grad_accum_steps=1))
    prog = step.build_program(
        one_cfg, mesh_from_string("dp=1", jax.devices()[:1]), lambda f, c, m, model: grpo_stage.grpo_stage(f, c, run.g)
    )
    one = outputs(prog, jax.device_get(state.params), jax.device_get(ref))
    assert abs(float(one[0]) - float(many[0])) < TOL * max(1.0, abs(float(one[0])))
    for k in ("kl", "clip_ratio", "completion_length"):
        assert abs(float(one[1][k]) - float(many[1][k])) < TOL, k
    assert float(one[1]["kl"]) > 1e-3 and float(one[1]["clip_ratio"]) > 0  # the reference and the clip both act
    for a, b in zip(jax.tree.leaves(one[2]), jax.tree.leaves(many[2])):
        assert np.abs(a - b).max() <= TOL * max(np.abs(a).max(), 1e-12)


def test_prepare_prompts_keeps_columns_and_never_cuts(tmp_path, small_cfg):
    """prepare --prompts: plain (TRL: with the tokenizer's special tokens) and conversational prompts
    (chat template, generation prompt), the other columns kept; too long / empty / bad lines counted."""
    from jaxdist.data import loader as loader_mod
    from jaxdist.data import prefprep, promptprep
    from jaxdist.data import prepare as prepare_mod

    lines = [
        {"prompt": "What is 2+2?", "answer": "4"},
        {"prompt": [{"role": "user", "content": "Hi?"}], "answer": "Hello", "level": 3},
        {"prompt": "x " * 200, "answer": "1"},
        {"prompt": "", "answer": "1"},
        {"question": "no prompt"},
    ]
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines) + "not json\n")
    argv = ["prepare", "--prompts", "--tokenizer", str(QWEN), "--seq-len", "64", "--val-fraction", "0", str(src)]
    manifest = prepare_mod.prepare(prepare_mod.parse_args([*argv, "--out", str(tmp_path / "p")]), log=lambda m: None)
    assert manifest["prompts"]["skipped"] == {"bad_json": 1, "empty": 1, "malformed": 1, "too_long": 1}
    got = promptprep.read(tmp_path / "p")
    ct = prefprep.load_tokenizer(str(QWEN), None)
    assert (
        [r["answer"] for r in got] == ["4", "Hello"] and got[1]["level"] == 3 and got[1]["prompt"] == lines[1]["prompt"]
    )
    assert got[0]["ids"] == ct.parser.encode("What is 2+2?").ids
    assert (
        got[1]["ids"]
        == prefprep.tokenize_pair(
            ct,
            {
                **lines[1],
                "chosen": [{"role": "assistant", "content": "a"}],
                "rejected": [{"role": "assistant", "content": "b"}],
            },
        )[0]
    )  # the prompt DPO's pairs would have: rendered with the assistant's turn opened
    with pytest.raises(JaxdistError, match="the prompt is \\d+ tokens, more than --seq-len 64 - 1"):
        prepare_mod.prepare(prepare_mod.parse_args([*argv, "--out", str(tmp_path / "q"), "--on-error", "stop"]))
    with pytest.raises(JaxdistError, match="--preference and --prompts exclude each other"):
        prepare_mod.prepare(prepare_mod.parse_args([*argv, "--preference", "--out", str(tmp_path / "r")]))
    assert not (tmp_path / "q").exists() and not (tmp_path / "r").exists()
    cfg = small_cfg.replace(
        data=dict(source="tokens", path=str(tmp_path / "p")), model=dict(seq_len=64, vocab_size=512)
    )
    with pytest.raises(JaxdistError, match="holds GRPO prompts \\(prepare --prompts\\), not training tokens"):
        loader_mod.load_windows(cfg)


@pytest.fixture(scope="module")
def grpo_train(tmp_path_factory, tiny_cfg):
    """`python -m jaxdist.train objective.method=grpo` in process (jaxdist.run) on the micro model with LoRA (the
    reference is the base with the adapters off): 3 steps with a checkpoint after each and a held-out
    evaluation at step 3, on prompts made by prepare --prompts, two reward functions (a built-in and a file's)."""
    from jaxdist.data import prepare as prepare_mod

    tmp = tmp_path_factory.mktemp("grpo_train")
    src = tmp / "prompts.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"{n}+{n}=", "answer": str(2 * n)}) + "\n" for n in range(40)))
    argv = ["prepare", "--prompts", "--tokenizer", str(QWEN), "--seq-len", "16", "--val-fraction", "0.2", str(src)]
    prepare_mod.prepare(prepare_mod.parse_args([*argv, "--out", str(tmp / "p")]), log=lambda m: None)
    (tmp / "reward.py").write_text(
        "def chars(prompts, completions, **kw):\n    return [len(c) / 8 for c in completions]\n"
    )
    cfg = tiny_cfg.replace(
        model=dict(MICRO_MODEL, vocab_size=512),
        mesh=dict(shape="dp=4,fsdp=2"),
        data=dict(source="tokens", path=str(tmp / "p")),
        objective=dict(
            method="grpo",
            reward=["digits", f"{tmp}/reward.py:chars"],
            reward_weights=[1.0, 0.5],
            group_size=2,
            max_new_tokens=4,
            beta=0.1,
        ),
        train=dict(global_batch=8, steps=3, eval_every=3, eval_batches=1, log_every=1),
        checkpoint=dict(every=2, keep=5, async_save=False),  # step 2 (resumed from) and the last
        lora=dict(rank=4),
    )
    import jaxdist

    logs = []
    jaxdist.run(cfg, tmp / "a", log=lambda *a, **k: logs.append(" ".join(map(str, a))))
    (tmp / "log.txt").write_text("\n".join(logs))
    return cfg, tmp


def rows(run_dir):
    lines = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r for r in lines if "step" in r}


def test_train_grpo_logs_trl_names_and_held_out_reward(grpo_train):
    """The train command's GRPO: every step logs TRL's names (reward, reward_std, kl, clip_ratio,
    completion_length), the rollout's tokens/s and generating share; step 3 logs the held-out reward."""
    cfg, tmp = grpo_train
    got = rows(tmp / "a")
    assert sorted(got) == [1, 2, 3]
    for r in got.values():
        for k in ("loss", "reward", "reward_std", "kl", "clip_ratio", "completion_length", "rewards/chars/mean"):
            assert np.isfinite(r[k]), k
        assert r["reward"] > 0 and 0 < r["completion_length"] <= 4 and r["reward_std"] > 0
        assert r["rollout_tokens_per_s"] > 0 and 0 < r["generate_share"] < 1
    assert got[1]["kl"] == 0.0 and got[3]["kl"] > 0  # step 1: fresh adapters, the policy is the reference
    assert all(r["clip_ratio"] == 0.0 for r in got.values())  # one iteration: the ratio is 1
    assert got[3]["eval_reward"] > 0 and 0 < got[3]["eval_completion_length"] <= 4
    assert abs(got[3]["reward"] - got[3]["rewards/digits/mean"] - 0.5 * got[3]["rewards/chars/mean"]) < 1e-6
    assert "eval_reward" not in got[2] and "eval_loss" not in got[3]
    assert f"reward {got[3]['reward']:.4g} (eval {got[3]['eval_reward']:.4g})" in (tmp / "log.txt").read_text()
    from test_objectives import planner_arguments  # the planner's bytes: LoRA keeps no reference, rows 2W wide

    summary = json.loads((tmp / "a" / "metrics.jsonl").read_text().splitlines()[-1])
    predicted, reference = planner_arguments(cfg, {"dp": 4, "fsdp": 2})
    assert predicted == pytest.approx(summary["memory_compiled_arguments"], rel=0.01) and reference == 0


def test_train_grpo_resume_draws_the_same_prompts_and_losses(grpo_train):
    """Resumed at step 2 (a copy of the run with its step-3 checkpoint removed), step 3 reads the same prompts
    (the stream's saved position) and samples with the same seed: its loss, reward and kl equal the
    uninterrupted run's (1e-6: the same program on the same inputs)."""
    import shutil

    import jaxdist
    from jaxdist.data import prompt_stream

    cfg, tmp = grpo_train
    shutil.copytree(tmp / "a", tmp / "b")
    shutil.rmtree(tmp / "b" / "checkpoints" / "3")
    jaxdist.run(cfg, tmp / "b", log=lambda *a, **k: None)
    a, b = rows(tmp / "a"), rows(tmp / "b")
    for k in ("loss", "reward", "reward_std", "kl", "completion_length", "grad_norm", "eval_reward"):
        assert abs(a[3][k] - b[3][k]) <= 1e-6 * max(1.0, abs(a[3][k])), k
    stream, again = prompt_stream.PromptStream(cfg), prompt_stream.PromptStream(cfg)
    first = [next(stream).records for _ in range(3)]
    next(again), next(again)
    moved = prompt_stream.PromptStream(cfg)
    moved.set_state(again.get_state())
    assert next(moved).records == first[2] and first[2] != first[1]


def test_train_grpo_bad_settings_are_one_line_errors_before_writing(grpo_train):
    """objective.method=grpo's settings are checked up front (no rollout, nothing written)."""
    import jaxdist
    from jaxdist.data import prompt_stream
    from jaxdist.objectives.refusals import check_sizes

    cfg, tmp = grpo_train
    bad = [
        (dict(objective=dict(reward=[])), "objective.method=grpo needs objective.reward"),
        (dict(objective=dict(reward_weights=[1.0])), "objective.reward_weights has 1 weights for 2"),
        (dict(train=dict(global_batch=6)), "train.global_batch=6 must be a multiple of objective.group_size=4"),
        (dict(objective=dict(max_new_tokens=16)), "objective.max_new_tokens=16 leaves no room for a prompt"),
        (dict(objective=dict(group_size=1)), "GRPO group_size=1: a group needs at least 2 completions"),
    ]
    for change, message in bad:
        if "train" in change:
            change = dict(train=change["train"], objective=dict(group_size=4))
        with pytest.raises(JaxdistError, match=message):
            check_sizes(cfg.replace(**change), {"dp": 2})
    with pytest.raises(
        JaxdistError, match="\\d+ prompts are longer than model.seq_len \\+ 1 - objective.max_new_tokens"
    ):
        prompt_stream.PromptStream(cfg.replace(objective=dict(max_new_tokens=13)))
    with pytest.raises(
        JaxdistError, match="set data.path to a folder made by python -m jaxdist.data prepare --prompts"
    ):
        prompt_stream.PromptStream(cfg.replace(data=dict(path=str(tmp / "none"))))
    with pytest.raises(JaxdistError, match=f"reward {tmp}/nothere.py:f: {tmp}/nothere.py is not a file"):
        jaxdist.run(
            cfg.replace(objective=dict(reward=[f"{tmp}/nothere.py:f"], reward_weights=[])),
            tmp / "c",
            log=lambda *a, **k: None,
        )
    assert not (tmp / "c").exists()


def test_grpo_with_a_moe_model_adds_the_router_aux_loss_as_the_lm_objective(tiny_cfg):
    """GRPO's stage on a MoE model (one device, on-policy, beta 0, dapo): the loss is the surrogate,
    -sum_n A_n len_n / sum_n len_n (the ratio is 1), plus the router's auxiliary objective as the LM
    objective adds it, its sum / the batch's routed positions (both 1e-6)."""

    # capacity dispatch with room for every token: the aux objective is the router's, whatever the
    # dispatch, and its program compiles faster than dropless's lax.switch of tiers
    moe = dict(moe_experts=4, moe_topk=2, moe_dispatch="capacity", moe_capacity_factor=8.0)
    cfg = tiny_cfg.replace(model=dict(MICRO_MODEL, **moe), train=dict(global_batch=4))
    g = grpo.GRPO(group_size=2, beta=0.0, iterations=1, loss_type="dapo")
    mesh = mesh_from_string("dp=1", jax.devices()[:1])
    prog = step.build_program(cfg, mesh, lambda f, c, m, model: grpo_stage.grpo_stage(f, c, g))
    state = prog.init_state(0)
    rng = np.random.default_rng(0)
    W = cfg.model.seq_len + 1
    ids = rng.integers(1, cfg.model.vocab_size, (4, W))
    starts, lengths = np.array([3, 4, 5, 3]), np.array([6, 9, 4, 11])
    mask = ((np.arange(W) >= starts[:, None]) & (np.arange(W) < (starts + lengths)[:, None])).astype(np.int64)
    rows = np.asarray(loss_mask.encode(ids, mask))
    adv = np.array([0.7, -0.7, 1.2, -1.2], np.float32)
    with prog.activate():
        _, loss, _, metrics = jax.jit(lambda p, t: prog.gradients.apply(p, t, (), 0))(
            state.params, grpo_stage.pack(rows, adv)
        )
        inputs = loss_mask.split(rows[:, :-1])[0]
        aux = jax.jit(lambda p: prog.apply_fn(p, inputs)[1]["objective"])(state.params)
    expected_aux = float(aux) / (4 * (W - 1))
    surrogate = -float((adv * lengths).sum() / lengths.sum())
    assert expected_aux > 1e-4 and abs(float(metrics["aux_loss"]) - expected_aux) < 1e-6
    assert abs(float(loss) - (surrogate + expected_aux)) < 1e-6
