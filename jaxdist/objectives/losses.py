"""The preference losses on per-sequence log-probabilities, as TRL computes them (pure functions).

Inputs are per pair: the policy's summed completion log-probs of the chosen and rejected rows
(`logps_B2`, column 0 chosen, 1 rejected), their completion token counts (`counts_B2`) and, for the
objectives with a reference, the reference's (`ref_B2`). Each returns (per-pair loss (B,), per-pair
statistics {name: (B,)}) under TRL's metric names; the stage sums both over pairs and micro-batches
and divides by the pair count, so logged values are TRL's batch means.

DPO (TRL `DPOTrainer`, `loss_type="sigmoid"`): loss = -log sigmoid(beta * ((pc - rc) - (pr - rr))),
rewards = beta * (policy - reference) log-ratios. Checked against TRL on fixed inputs:
`tests/test_objectives.py` (fixture by `scripts/make_trl_fixture.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def reward_stats(chosen_rewards, rejected_rewards, logps_B2) -> dict:
    """TRL's logged statistics of a batch of pairs, per pair (means are taken by the caller)."""
    return {
        "rewards/chosen": chosen_rewards,
        "rewards/rejected": rejected_rewards,
        "rewards/margins": chosen_rewards - rejected_rewards,
        "rewards/accuracies": (chosen_rewards > rejected_rewards).astype(jnp.float32),
        "logps/chosen": logps_B2[:, 0],
        "logps/rejected": logps_B2[:, 1],
    }


def dpo(logps_B2, counts_B2, ref_B2, obj) -> tuple[jax.Array, dict]:
    """DPO's sigmoid loss (Rafailov et al. 2023) with TRL's rewards."""
    ratios_B2 = logps_B2 - ref_B2
    losses = -jax.nn.log_sigmoid(obj.beta * (ratios_B2[:, 0] - ratios_B2[:, 1]))
    rewards = obj.beta * jax.lax.stop_gradient(ratios_B2)
    return losses, reward_stats(rewards[:, 0], rewards[:, 1], jax.lax.stop_gradient(logps_B2))
