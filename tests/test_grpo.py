"""GRPO (jaxdist/objectives/grpo.py): agreement with TRL's GRPOTrainer, advantages, rewards, rollouts, sharding.

- the loss of each `loss_type` (grpo, bnpo, dr_grpo, dapo), TRL's `kl` and `clip_ratio/*`, and the gradients of
  the norm, head and embedding equal a real `trl.GRPOTrainer._compute_loss` on the tiny Llama fixture with
  fixed completions, old and reference log-probs (`tests/fixtures/trl/grpo_*.npz`, made by
  scripts/make_trl_grpo_fixture.py); the per-token log-probs (temperature 0.7) and advantages agree too.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdist.data import loss_mask
from jaxdist.distributed import sharding
from jaxdist.distributed.mesh import mesh_from_string
from jaxdist.hf import mapping
from jaxdist.hf import tensors as hf_tensors
from jaxdist.objectives import grpo
from jaxdist.training import step

REPO = Path(__file__).resolve().parent.parent
HF = REPO / "tests" / "fixtures" / "hf_llama"
TRL = REPO / "tests" / "fixtures" / "trl"
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
