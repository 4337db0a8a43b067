"""The preference losses on per-sequence log-probabilities, as TRL computes them (pure functions).

Inputs are per pair: the policy's summed completion log-probs of the chosen and rejected rows
(`logps_B2`, column 0 chosen, 1 rejected), their completion token counts (`counts_B2`) and, for the
objectives with a reference, the reference's (`ref_B2`). Each returns `Terms`: the per-pair loss (B,),
an optional per-pair sum that TRL averages over the batch's chosen tokens instead (ORPO's NLL), and
per-pair statistics under TRL's metric names. The stage sums them over pairs and micro-batches and
divides by the batch's pair count (the token term by its chosen-token count), so the loss and the logged
values are TRL's batch means.

- DPO (TRL `DPOTrainer`): `sigmoid` -log sigmoid(beta * ((pc - rc) - (pr - rr))); `ipo` the squared loss
  on length-normalised log-ratios, (d - 1 / (2 beta))^2; `robust` (label_smoothing = flip probability e)
  (-(1 - e) log sigmoid(beta d) + e log sigmoid(-beta d)) / (1 - 2e). Rewards: beta x (policy - reference).
- SimPO (TRL `CPOTrainer`, loss_type="simpo", cpo_alpha=0): length-normalised log-probs, no reference:
  -(1 - e) log sigmoid(beta (pc - pr) - gamma) - e log sigmoid(-(beta (pc - pr) - gamma)).
- ORPO (TRL `ORPOTrainer`): chosen NLL (mean over the batch's chosen tokens) - lambda x mean log sigmoid of
  the log-odds ratio of the length-normalised log-probs.

Checked against TRL on fixed inputs: `tests/test_objectives.py` (fixtures by `scripts/fixtures/make_trl_fixture.py`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Terms(NamedTuple):
    losses: jax.Array  # (B,): averaged over the pairs
    token_sums: jax.Array | None  # (B,): summed, then divided by the batch's chosen completion tokens
    stats: dict  # name -> (B,), averaged over the pairs (token-weighted ones come pre-scaled)


def reward_stats(rewards_B2, logps_B2) -> dict:
    """TRL's logged statistics of a batch of pairs, per pair (means are taken by the caller)."""
    rewards_B2, logps_B2 = jax.lax.stop_gradient(rewards_B2), jax.lax.stop_gradient(logps_B2)
    return {
        "rewards/chosen": rewards_B2[:, 0],
        "rewards/rejected": rewards_B2[:, 1],
        "rewards/margins": rewards_B2[:, 0] - rewards_B2[:, 1],
        "rewards/accuracies": (rewards_B2[:, 0] > rewards_B2[:, 1]).astype(jnp.float32),
        "logps/chosen": logps_B2[:, 0],
        "logps/rejected": logps_B2[:, 1],
    }


def smoothed(logits, e):
    """-(1 - e) log sigmoid(x) - e log sigmoid(-x): the conservative (label-smoothed) sigmoid loss."""
    return -(1 - e) * jax.nn.log_sigmoid(logits) - e * jax.nn.log_sigmoid(-logits)


def dpo(logps_B2, counts_B2, ref_B2, obj) -> Terms:
    """DPO (Rafailov et al. 2023) with TRL's loss types sigmoid, ipo and robust."""
    ratios_B2 = logps_B2 - ref_B2
    delta = ratios_B2[:, 0] - ratios_B2[:, 1]
    if obj.dpo_loss == "ipo":  # TRL: log-ratios averaged over each side's completion tokens
        avg_B2 = ratios_B2 / jnp.maximum(counts_B2, 1.0)
        losses = (avg_B2[:, 0] - avg_B2[:, 1] - 1 / (2 * obj.beta)) ** 2
    elif obj.dpo_loss == "robust":
        e = obj.label_smoothing
        losses = (-(1 - e) * jax.nn.log_sigmoid(obj.beta * delta) + e * jax.nn.log_sigmoid(-obj.beta * delta)) / (
            1 - 2 * e
        )
    else:
        losses = -jax.nn.log_sigmoid(obj.beta * delta)
    return Terms(losses, None, reward_stats(obj.beta * ratios_B2, logps_B2))


def simpo(logps_B2, counts_B2, ref_B2, obj) -> Terms:
    """SimPO (Meng et al. 2024): reference-free, length-normalised, with a target margin gamma."""
    avg_B2 = logps_B2 / counts_B2
    logits = avg_B2[:, 0] - avg_B2[:, 1] - obj.gamma / obj.beta
    return Terms(smoothed(obj.beta * logits, obj.label_smoothing), None, reward_stats(obj.beta * avg_B2, avg_B2))


def log1mexp(x):
    """log(1 - exp(x)) for x < 0, stable at both ends (as TRL's `log1mexp`)."""
    return jnp.where(x < -0.6931471805599453, jnp.log1p(-jnp.exp(x)), jnp.log(-jnp.expm1(x)))


def orpo(logps_B2, counts_B2, ref_B2, obj) -> Terms:
    """ORPO (Hong et al. 2024): the chosen completions' NLL plus lambda x the odds-ratio term."""
    avg_B2 = logps_B2 / counts_B2
    log_odds = (avg_B2[:, 0] - avg_B2[:, 1]) - (log1mexp(avg_B2[:, 0]) - log1mexp(avg_B2[:, 1]))
    ratio = jax.nn.log_sigmoid(log_odds)
    stats = reward_stats(obj.orpo_lambda * avg_B2, avg_B2)
    stats |= {"log_odds_ratio": jax.lax.stop_gradient(ratio), "log_odds_chosen": jax.lax.stop_gradient(log_odds)}
    return Terms(-obj.orpo_lambda * ratio, -logps_B2[:, 0], stats)
