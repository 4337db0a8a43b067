"""The gradient stage of the preference objectives: both rows of each pair in one forward, the frozen
reference, micro-batch accumulation, and the held-out evaluation's sums.

A batch row is one pair record (`jaxdist.data.prefprep`): `2 x (seq_len + 1)` tokens, the chosen row then
the rejected row, completion tokens marked by the loss mask. `(B, 2W) -> (2B, W)` is a reshape that keeps
each device's rows on it (row b becomes rows 2b, 2b + 1, on the same batch shard), so the chosen and the
rejected rows of every pair go through one forward of the sharded model, on whatever mesh the model is on.

The reference (objectives with one, e.g. DPO) is computed on the fly, in the same step, without gradient:
- with LoRA (`lora.rank > 0`): the same parameters with the adapters zeroed: `W x + (alpha / r) B (A x)` is
  then exactly the frozen base `W x` (TRL's "adapters disabled"): no second copy of the weights;
- without: a frozen copy of the parameters the run started from (the `--restore`d or imported model),
  kept as the stage's state (`TrainState.reducer_state`), sharded like the parameters and saved in each
  checkpoint, so a resumed run keeps its reference. Costs one float32 copy of the parameters.
Either way it costs one more forward per step (no backward), about a third of the step's FLOPs.
A MoE policy's auxiliary objective (balance and z losses) is added to the training loss as the LM
objective adds it (`pair_sums`); the held-out evaluation leaves it out, as the LM's does.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxdist.adapters import tree as adapters
from jaxdist.data import loss_mask
from jaxdist.parallel.loss import ApplyFn, cross_entropy
from jaxdist.parallel.microbatch import split_microbatches
from jaxdist.reduce.gradients import GradientStage


def as_rows(tokens_BR):
    """(B, 2W) pair records -> (2B, W) rows: chosen of pair b at row 2b, its rejected at 2b + 1."""
    B, R = tokens_BR.shape
    return tokens_BR.reshape(2 * B, R // 2)


def sequence_logps(apply_fn: ApplyFn, params, rows_NW, aux: dict | None = None):
    """(summed log-probs of the completion tokens, their count), per row (N,): the targets the loss mask keeps.
    `aux`: filled with the model's auxiliary outputs (MoE: `objective`, the balance and z losses' sum)."""
    inputs_NT = loss_mask.split(rows_NW[:, :-1])[0]
    targets_NT, weights_NT = loss_mask.split(rows_NW[:, 1:])
    head, got = apply_fn(params, inputs_NT)
    if aux is not None:
        aux.update(got)
    logps_NT = -cross_entropy(head, targets_NT)
    return (logps_NT * weights_NT).sum(-1), weights_NT.sum(-1)


def chosen_tokens(tokens_BR):
    """Completion tokens of the chosen rows of a batch of pair records (what ORPO's NLL averages over)."""
    return loss_mask.split(as_rows(tokens_BR)[0::2, 1:])[1].sum()


def pair_sums(apply_fn: ApplyFn, loss: Callable, obj, params, reference, tokens_BR, per_token, with_aux=False):
    """(summed loss over the pairs, {statistic: sum over the pairs}). `reference`: the reference's
    parameters, or None for a reference-free objective. `per_token`: pairs / chosen completion tokens of
    the whole batch, the weight of a term TRL averages over tokens (so the sum / pairs is its token mean).
    `with_aux` (training): a MoE policy's auxiliary objective is added as the LM objective adds it, a mean
    over every routed position of the batch: its sum over these rows / (2 x (W - 1)) per pair, so that the
    stage's division by the pairs makes it the sum / (rows x positions); logged as `aux_loss`."""
    rows = as_rows(tokens_BR)
    aux = {}
    logps, counts = (x.reshape(-1, 2) for x in sequence_logps(apply_fn, params, rows, aux))
    ref = None
    if reference is not None:
        ref = jax.lax.stop_gradient(sequence_logps(apply_fn, jax.lax.stop_gradient(reference), rows)[0].reshape(-1, 2))
    total, stats = summed(loss(logps, counts, ref, obj), per_token)
    if with_aux and "objective" in aux:
        term = aux["objective"] / (2 * (rows.shape[1] - 1))
        total = total + term
        stats["aux_loss"] = jax.lax.stop_gradient(term)
    return total, stats


def summed(terms, per_token):
    """A loss's `Terms` -> (loss sum, {statistic: sum}) in per-pair units: divided by the pairs, TRL's means
    (a token term, ORPO's NLL, weighted by `per_token` = pairs / chosen tokens: its token mean)."""
    total = terms.losses.sum()
    stats = {k: v.sum() for k, v in terms.stats.items()}
    if terms.token_sums is not None:
        total = total + terms.token_sums.sum() * per_token
        stats["nll_loss"] = jax.lax.stop_gradient(terms.token_sums.sum() * per_token)
    return total, stats


def pair_stage(apply_fn: ApplyFn, cfg, loss: Callable, needs_reference: bool) -> GradientStage:
    """The stage (`jaxdist.reduce.gradients.GradientStage`) for a pairwise objective under the implicit
    data-parallel reduction. State: the frozen reference copy (full fine-tuning with a reference), else ()."""
    lora, M, obj = bool(cfg.lora.rank), cfg.train.grad_accum_steps, cfg.objective
    keeps_copy = needs_reference and not lora

    def objective(trained, fixed, copy, tokens, per_token):
        params = adapters.combine(trained, fixed) if lora else trained
        reference = None
        if needs_reference:  # LoRA: adapters off (zeros) = the base; else the stored copy
            reference = adapters.combine(jax.tree.map(jnp.zeros_like, trained), fixed) if lora else copy
        return pair_sums(apply_fn, loss, obj, params, reference, tokens, per_token, with_aux=True)

    grad_fn = jax.value_and_grad(objective, has_aux=True)

    def apply(params, tokens, state, step):
        trained, fixed = (adapters.trainable(params), adapters.frozen(params)) if lora else (params, None)
        pairs = tokens.shape[0]
        per_token = pairs / chosen_tokens(tokens)  # of the whole batch: micro-batch sums add up to its means
        if M == 1:
            (total, stats), grads = grad_fn(trained, fixed, state, tokens, per_token)
        else:

            def body(carry, micro):
                (l, s), g = grad_fn(trained, fixed, state, micro, per_token)
                return jax.tree.map(jnp.add, carry, (g, l, s)), None

            micro = split_microbatches(tokens, M)
            shapes = jax.eval_shape(lambda t: grad_fn(trained, fixed, state, t, per_token)[0][1], micro[0])
            init = (
                jax.tree.map(jnp.zeros_like, trained),
                jnp.zeros((), jnp.float32),
                jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes),
            )
            (grads, total, stats), _ = jax.lax.scan(body, init, micro)
        metrics = {k: v / pairs for k, v in stats.items()}
        return jax.tree.map(lambda g: g / pairs, grads), total / pairs, state, metrics

    return GradientStage(
        init=(lambda trained: jax.tree.map(jnp.copy, trained)) if keeps_copy else (lambda trained: ()),
        apply=apply,
        state_specs=(lambda specs: specs) if keeps_copy else (lambda specs: ()),
        name="pairs",
    )


def pair_eval(apply_fn: ApplyFn, cfg, loss: Callable, needs_reference: bool) -> Callable:
    """`eval_step(params, reference_state, tokens) -> (loss_sum, pairs, {statistic: sum})` on held-out pairs."""
    lora, obj = bool(cfg.lora.rank), cfg.objective

    def eval_step(params, state, tokens):
        reference = None
        if needs_reference:
            if lora:
                reference = adapters.combine(
                    jax.tree.map(jnp.zeros_like, adapters.trainable(params)), adapters.frozen(params)
                )
            else:
                reference = state
        pairs = jnp.float32(tokens.shape[0])
        total, stats = pair_sums(apply_fn, loss, obj, params, reference, tokens, pairs / chosen_tokens(tokens))
        return total, pairs, stats

    return eval_step
