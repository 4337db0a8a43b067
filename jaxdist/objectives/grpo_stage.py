"""GRPO's gradient stage: the train step's `GradientStage` over a batch of scored rollouts.

The batch is one int32 array, so the trainer's step (batch sharding, micro-batches, non-finite guard,
optimizer, donated state) carries it unchanged: row n is `W = seq_len + 1` tokens (prompt then completion
from position 0, right-padded, loss mask on the completion: `jaxdist.data.loss_mask`), then 1 column
holding its advantage and `W - 1` columns holding the sampling policy's per-token log-probs, as float32
bit patterns (`pack` / `unpack`). The old log-probs are read only when `iterations > 1` (TRL: with one
iteration the ratio is 1, its gradient that of the log-prob).

The reference (for beta > 0), as DPO's (`jaxdist.objectives.pairs`): with LoRA the same parameters with
the adapters zeroed (the base, no second copy); without, a frozen float32 copy of the parameters the run
started from, kept as the stage's state (sharded like the parameters). Its log-probs cost one forward
without backward per step. A MoE policy's auxiliary objective is added as the LM objective adds it (a
mean over the batch's routed positions; `aux_loss`). Micro-batches (`train.grad_accum_steps`) add up to the whole batch's loss:
each token's weight uses the whole batch's row and token counts (`grpo.weights`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist.adapters import tree as adapters
from jaxdist.data import loss_mask
from jaxdist.objectives import grpo
from jaxdist.parallel.loss import ApplyFn
from jaxdist.parallel.microbatch import split_microbatches
from jaxdist.reduce.gradients import GradientStage


def pack(rows_NW: np.ndarray, adv_N: np.ndarray, old_NT: np.ndarray | None = None) -> np.ndarray:
    """(N, W) encoded rows, (N,) advantages, (N, W - 1) old log-probs -> the stage's (N, 2W) int32 batch."""
    N, W = rows_NW.shape
    old = np.zeros((N, W - 1), np.float32) if old_NT is None else np.asarray(old_NT, np.float32)
    floats = np.concatenate([np.asarray(adv_N, np.float32)[:, None], old], axis=1)
    return np.concatenate([np.asarray(rows_NW, np.int32), floats.view(np.int32)], axis=1)


def unpack(batch_NR):
    """-> (rows (N, W), advantages (N,), old log-probs (N, W - 1))."""
    W = batch_NR.shape[1] // 2
    floats = jax.lax.bitcast_convert_type(batch_NR[:, W:], jnp.float32)
    return batch_NR[:, :W], floats[:, 0], floats[:, 1:]


def reference_of(lora: bool, trained, fixed, copy):
    """The reference's parameters: LoRA's base (adapters zeroed), else the stored copy."""
    if lora:
        return adapters.combine(jax.tree.map(jnp.zeros_like, trained), fixed)
    return copy


def grpo_stage(apply_fn: ApplyFn, cfg, g: grpo.GRPO) -> GradientStage:
    """The stage for `g` on `cfg` (its LoRA setting and `train.grad_accum_steps`)."""
    lora, M = bool(cfg.lora.rank), cfg.train.grad_accum_steps
    keeps_copy = g.beta > 0 and not lora

    def objective(trained, fixed, copy, micro, rows_total, tokens_total):
        params = adapters.combine(trained, fixed) if lora else trained
        rows, adv, old = unpack(micro)
        ref = None
        if g.beta:
            reference = jax.lax.stop_gradient(reference_of(lora, trained, fixed, copy))
            ref = jax.lax.stop_gradient(grpo.token_logps(apply_fn, reference, rows, g.temperature)[0])
        mask = loss_mask.split(rows[:, 1:])[1]
        w = grpo.weights(mask, g.loss_type, g.max_new_tokens, rows_total, tokens_total)
        aux_weight = 1.0 / (rows_total * (rows.shape[1] - 1))  # MoE aux: a mean over the batch's routed positions
        return grpo.loss_sums(apply_fn, params, rows, adv, old if g.iterations > 1 else None, ref, w, g, aux_weight)

    grad_fn = jax.value_and_grad(objective, has_aux=True)

    def apply(params, batch, state, step):
        trained, fixed = (adapters.trainable(params), adapters.frozen(params)) if lora else (params, None)
        rows_total = batch.shape[0]
        tokens_total = loss_mask.split(unpack(batch)[0][:, 1:])[1].sum()
        if M == 1:
            (loss, stats), grads = grad_fn(trained, fixed, state, batch, rows_total, tokens_total)
        else:

            def body(carry, micro):
                (l, s), gr = grad_fn(trained, fixed, state, micro, rows_total, tokens_total)
                return jax.tree.map(jnp.add, carry, (gr, l, s)), None

            micro = split_microbatches(batch, M)
            shapes = jax.eval_shape(
                lambda t: grad_fn(trained, fixed, state, t, rows_total, tokens_total)[0][1], micro[0]
            )
            init = (
                jax.tree.map(jnp.zeros_like, trained),
                jnp.zeros((), jnp.float32),
                jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes),
            )
            (grads, loss, stats), _ = jax.lax.scan(body, init, micro)
        tokens = jnp.maximum(stats.pop("completion_tokens"), 1.0)
        aux = {"aux_loss": stats.pop("aux_loss")} if "aux_loss" in stats else {}  # already the batch's mean
        metrics = {k: v / tokens for k, v in stats.items()} | {"completion_length": tokens / rows_total} | aux
        if "clip_ratio/region_mean" in metrics:
            metrics["clip_ratio"] = metrics["clip_ratio/region_mean"]
        return grads, loss, state, metrics

    return GradientStage(
        init=(lambda trained: jax.tree.map(jnp.copy, trained)) if keeps_copy else (lambda trained: ()),
        apply=apply,
        state_specs=(lambda specs: specs) if keeps_copy else (lambda specs: ()),
        name="grpo",
    )


def old_logps_fn(apply_fn: ApplyFn, temperature: float) -> Callable:
    """`(params, rows_NW) -> per-token log-probs (N, W - 1)` of the sampling policy (for iterations > 1)."""
    return lambda params, rows: grpo.token_logps(apply_fn, params, rows, temperature)[0]
