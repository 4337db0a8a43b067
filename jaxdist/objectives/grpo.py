"""GRPO's loss as TRL computes it (`GRPOTrainer._compute_loss`, TRL 1.16), and its group-relative advantages.

Rows are a prompt then its sampled completion from position 0, right-padded, with the loss mask on the
completion tokens (`jaxdist.data.loss_mask`), so the model sees each row at its natural positions. Per
completion token t of row n, with r = exp(logp - old_logp) (old: the policy that sampled it):

    loss_nt = -min(r A_n, clip(r, 1 - epsilon, 1 + epsilon_high) A_n) + beta * kl_nt
    kl_nt   = r * (exp(ref - logp) - (ref - logp) - 1)    (Schulman's k3 estimator; x r: TRL 1.16's
                                                           use_bias_correction_kl, on by default)

aggregated per `loss_type` (TRL's names and default):
- `grpo`: each row's token mean, then the mean over rows (length-biased, the original paper);
- `bnpo`: the mean over the batch's completion tokens (TRL: per device batch; here the batch is global);
- `dr_grpo`: the sum over tokens / (rows x max_new_tokens) (Dr. GRPO's constant);
- `dapo` (TRL's default): the sum over tokens / the global batch's completion tokens.

All four are a weighted token sum, `sum_nt loss_nt w_nt` with weights from the whole batch (`weights`),
so micro-batches and shards add up to the batch's loss exactly. Log-probs are of the logits divided by
the sampling temperature, as TRL's. Advantages: (reward - group mean) / (group std + 1e-4) with TRL's
NaN rules (an unscorable completion, NaN reward, is out of its group's statistics and gets advantage 0).
Checked against a real `trl.GRPOTrainer`: tests/test_grpo.py (fixtures by scripts/fixtures/make_trl_grpo_fixture.py).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist.data import loss_mask
from jaxdist.errors import JaxdistError
from jaxdist.parallel.loss import ApplyFn, cross_entropy

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


@dataclasses.dataclass(frozen=True)
class GRPO:
    """GRPO's knobs, under TRL GRPOConfig's meaning (the name there in brackets)."""

    group_size: int = 4  # completions sampled per prompt (num_generations)
    beta: float = 0.04  # weight of the k3 KL to the reference; 0: no reference forward (beta)
    epsilon: float = 0.2  # lower clip of the ratio, 1 - epsilon (epsilon)
    epsilon_high: float | None = None  # upper clip 1 + epsilon_high; None: epsilon (epsilon_high)
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "dapo"  # token aggregation (loss_type)
    scale_rewards: Literal["group", "batch", "none"] = "group"  # advantage divided by this std (scale_rewards)
    max_new_tokens: int = 16  # completion length sampled; dr_grpo's constant (max_completion_length)
    temperature: float = 1.0  # sampling temperature; log-probs are of logits / temperature (temperature)
    top_p: float = 1.0  # nucleus sampling (top_p)
    iterations: int = 1  # optimiser steps on each batch of rollouts (num_iterations)
    bias_correction_kl: bool = True  # the KL term times the ratio r, TRL 1.16's default (use_bias_correction_kl)

    def __post_init__(self):
        bad = [
            (self.group_size < 2, f"group_size={self.group_size}: a group needs at least 2 completions"),
            (self.loss_type not in LOSS_TYPES, f"loss_type={self.loss_type!r}: use one of {', '.join(LOSS_TYPES)}"),
            (self.scale_rewards not in ("group", "batch", "none"), "scale_rewards: use group, batch or none"),
            (self.temperature <= 0, f"temperature={self.temperature}: sampling needs a temperature > 0"),
            (not 0 < self.top_p <= 1, f"top_p={self.top_p}: use a value in (0, 1]"),
            (self.max_new_tokens < 1 or self.iterations < 1, "max_new_tokens and iterations must be >= 1"),
            (self.beta < 0 or self.epsilon <= 0, "beta must be >= 0 and epsilon > 0"),
        ]
        for is_bad, what in bad:
            if is_bad:
                raise JaxdistError(f"GRPO {what}")


def advantages(rewards_N, group_size: int, scale: str = "group") -> np.ndarray:
    """Group-relative advantages (N,) of rewards (N,) laid out group after group, as TRL's
    sum_then_normalize (nanmean / unbiased nanstd per group, + 1e-4; NaN rewards -> advantage 0)."""
    r = np.asarray(rewards_N, np.float64)
    groups = r.reshape(-1, group_size)
    with warnings.catch_warnings():  # an all-NaN group: its mean and std are NaN, its advantages 0
        warnings.simplefilter("ignore", RuntimeWarning)
        mean = np.repeat(np.nanmean(groups, axis=1), group_size)
        if scale == "batch":
            std = np.full_like(r, np.nanstd(r, ddof=1))
        else:
            std = np.repeat(np.nanstd(groups, axis=1, ddof=1), group_size)
    adv = r - mean if scale == "none" else (r - mean) / (std + 1e-4)
    return np.nan_to_num(adv, nan=0.0).astype(np.float32)


def token_logps(apply_fn: ApplyFn, params, rows_NW, temperature: float = 1.0, aux: dict | None = None):
    """(log-probs (N, W-1) of each row's next tokens under logits / temperature, completion weights (N, W-1)).
    `aux`: filled with the model's auxiliary outputs (MoE: `objective`, the balance and z losses' sum)."""
    inputs = loss_mask.split(rows_NW[:, :-1])[0]
    targets, weights = loss_mask.split(rows_NW[:, 1:])
    head, got = apply_fn(params, inputs)
    if aux is not None:
        aux.update(got)
    if temperature != 1.0:  # logits / T = x (W / T): scale the head, not the (B, T, V) logits
        head = dataclasses.replace(head, w_DV=head.w_DV / temperature)
    return -cross_entropy(head, targets), weights


def weights(mask_NT, loss_type: str, max_new_tokens: int, rows=None, tokens=None):
    """Each token's weight in the batch's loss. `mask_NT`: completion masks of these rows; `rows`, `tokens`:
    the whole batch's row and completion-token counts (default: these rows', when they are the batch)."""
    rows = mask_NT.shape[0] if rows is None else rows
    tokens = mask_NT.sum() if tokens is None else tokens
    if loss_type == "grpo":
        return mask_NT / jnp.maximum(mask_NT.sum(-1, keepdims=True), 1.0) / rows
    if loss_type == "dr_grpo":
        return mask_NT / (rows * max_new_tokens)
    return mask_NT / jnp.maximum(tokens, 1.0)  # bnpo, dapo: over the batch's completion tokens


def token_terms(logps_NT, old_NT, ref_NT, adv_N, mask_NT, g: GRPO):
    """(per-token loss (N, T), statistics as masked token sums {kl, clip_ratio/low|high|region}): TRL's terms."""
    ratio = jnp.exp(logps_NT - old_NT)
    eps_high = g.epsilon if g.epsilon_high is None else g.epsilon_high
    a = adv_N[:, None]
    clipped = jnp.clip(ratio, 1 - g.epsilon, 1 + eps_high)
    loss = -jnp.minimum(ratio * a, clipped * a)
    stats = {}
    if g.beta:
        d = ref_NT - logps_NT
        kl = jnp.exp(d) - d - 1
        if g.bias_correction_kl:
            kl = kl * ratio
        loss = loss + g.beta * kl
        stats["kl"] = jax.lax.stop_gradient((kl * mask_NT).sum())
    low = jax.lax.stop_gradient((ratio < 1 - g.epsilon) & (a < 0)).astype(jnp.float32)
    high = jax.lax.stop_gradient((ratio > 1 + eps_high) & (a > 0)).astype(jnp.float32)
    stats |= {
        "clip_ratio/low_mean": (low * mask_NT).sum(),
        "clip_ratio/high_mean": (high * mask_NT).sum(),
        "clip_ratio/region_mean": (jnp.maximum(low, high) * mask_NT).sum(),
    }
    return loss, stats


def loss_sums(apply_fn: ApplyFn, params, rows_NW, adv_N, old_NT, ref_NT, w_NT, g: GRPO, aux_weight: float = 0.0):
    """(this slice's share of the batch loss, {statistic: masked token sum}). `old_NT` None: on-policy
    (the ratio is 1 with the gradient of logp, as TRL's detach); `w_NT`: `weights` of the whole batch.
    `aux_weight`: a MoE policy's auxiliary objective enters times this (1 / the batch's routed positions:
    its mean, as the LM objective adds it), its share logged as `aux_loss`."""
    aux = {}
    logps, mask = token_logps(apply_fn, params, rows_NW, g.temperature, aux)
    old = jax.lax.stop_gradient(logps) if old_NT is None else old_NT
    per_token, stats = token_terms(logps, old, ref_NT, adv_N, mask, g)
    total = (per_token * w_NT).sum()
    if aux_weight and "objective" in aux:
        term = aux["objective"] * aux_weight
        total = total + term
        stats["aux_loss"] = jax.lax.stop_gradient(term)
    return total, stats | {"completion_tokens": mask.sum()}
