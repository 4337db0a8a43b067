"""The gradient stage: token-weighted loss sums, micro-batch accumulation, the implicit stage.

It knows nothing of the trainer, the mesh or the config (the micro-batch split is parallel/microbatch.py). `jaxdist.training.step` picks a stage from its
table (implicit here; the explicit data-parallel reduction in `jaxdist.reduce.explicit`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxdist.data import loss_mask
from jaxdist.distributed import offload
from jaxdist.models.moe import metrics_from_sums
from jaxdist.parallel import pipeline
from jaxdist.parallel.loss import ApplyFn, cross_entropy
from jaxdist.parallel.matmul import reduce_in
from jaxdist.parallel.microbatch import split_microbatches


def token_loss_sums(apply_fn: ApplyFn, params, tokens_BT1, order_T=None) -> tuple[jax.Array, jax.Array]:
    """Summed next-token cross-entropy and the token count (token-weighted, so sums of micro-batches
    divide into exactly the full-batch mean). Only the targets the loss mask keeps count, in both
    (`jaxdist.data.loss_mask`; data without a mask: every target). `apply_fn(params, tokens) -> (head, aux)`
    gives the model's final hidden states and head (`jaxdist.parallel.loss.Head`), not logits: the loss applies
    it; aux (MoE sums) is not part of this loss (`objective_sums` adds it).
    `order_T` (context parallelism): the positions in the order the model computes them — inputs and
    targets are reordered alike, so the sums are unchanged."""
    sums, _ = _loss_sums_and_aux(apply_fn, params, tokens_BT1, order_T)
    return sums


def _loss_sums_and_aux(apply_fn: ApplyFn, params, tokens_BT1, order_T) -> tuple[tuple[jax.Array, jax.Array], dict]:
    """(`token_loss_sums`, the model's aux) from one forward."""
    inputs_BT, targets_BT = tokens_BT1[:, :-1], tokens_BT1[:, 1:]
    if order_T is not None:
        inputs_BT, targets_BT = (jnp.take(x, jnp.asarray(order_T), axis=1) for x in (inputs_BT, targets_BT))
    # Chat data: only the masked-in targets count. Decoded after the reorder, elementwise (a float weight
    # array reordered by `take` would be all-gathered over cp).
    inputs_BT = loss_mask.split(inputs_BT)[0]
    targets_BT, weights_BT = loss_mask.split(targets_BT)
    head, aux = apply_fn(params, inputs_BT)
    losses_BT = cross_entropy(head, targets_BT)
    return ((losses_BT * weights_BT).sum(), weights_BT.sum()), aux


def batch_count(tokens_BT1):
    """The kept targets of a batch (what its loss sums are divided by): every position without a mask."""
    return loss_mask.split(tokens_BT1[:, 1:])[1].sum()


def aux_scale(tokens_BT1):
    """The weight that makes the auxiliary objective a mean over the routed tokens, not over the kept
    targets: the stage divides the objective sum by the kept-target count, and the router sees every
    position, masked or not (as transformers' Mixtral / Qwen3-MoE `load_balancing_loss_func` averages
    over the attention mask's tokens, whatever the labels mask). kept targets / positions of the batch
    the stage divides by: exactly 1.0 without a mask (x * 1.0 is x, so unmasked runs are unchanged)."""
    kept = loss_mask.split(tokens_BT1[:, 1:])[1].sum()
    return kept / (tokens_BT1.shape[0] * (tokens_BT1.shape[1] - 1))


def objective_sums(apply_fn: ApplyFn, params, tokens_BT1, order_T=None, scale: float | Callable[[], Any] = 1.0):
    """The training objective: `token_loss_sums` plus the model's auxiliary objective times `scale`
    (`aux_scale` of the whole batch the sums are divided over; a callable is called only when the model
    has an aux objective, so a dense model's program holds none of it). Returns (objective_sum,
    (cross_entropy_sum, token_count, stats)); all are sums, so micro-batches add up; MoE stats gain
    `moe_routed`, the positions routed, which their per-token metrics divide by.
    A pipelined apply_fn with its own objective (a table schedule that computes its gradients itself,
    behind a custom VJP: `pipeline.PipelinedApply.objective`) is used as it is."""
    if isinstance(apply_fn, pipeline.PipelinedApply) and apply_fn.objective is not None:
        return apply_fn.objective(params, tokens_BT1, order_T, scale)
    (loss, count), aux = _loss_sums_and_aux(apply_fn, params, tokens_BT1, order_T)
    stats = {k: v for k, v in aux.items() if k != "objective"}
    if "objective" not in aux:
        return loss, (loss, count, stats)
    stats["moe_routed"] = jnp.float32(tokens_BT1.shape[0] * (tokens_BT1.shape[1] - 1))
    return loss + aux["objective"] * (scale() if callable(scale) else scale), (loss, count, stats)


def on_device_gradients(
    apply_fn: ApplyFn, order_T=None, scale: float | Callable[[], Any] = 1.0, divide_by=None
) -> Callable:
    """`grad_fn(params, tokens)` for host-resident parameters: differentiated with respect to zeros in
    device memory added to the fetched copies (`offload.differentiable`), so the gradients are device
    arrays, as the gradient sums and the update want them. `divide_by`: as `accumulate_with_stats`'s."""

    def objective(deltas, params, tokens):
        total, aux = objective_sums(apply_fn, offload.differentiable(params, deltas), tokens, order_T, scale)
        return (total if divide_by is None else total / divide_by), aux

    grad_fn = jax.value_and_grad(objective, has_aux=True)

    def on_device(params, tokens):
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype), params)
        return grad_fn(zeros, params, tokens)

    return on_device


def accumulate_gradients(apply_fn: ApplyFn, params, tokens_BT1, microbatches: int, order_T=None):
    """Sum of loss and gradients over micro-batches (a scan: one compiled forward/backward).
    Returns (grad_sum, loss_sum, token_count)."""
    return accumulate_with_stats(apply_fn, params, tokens_BT1, microbatches, order_T)[:3]


def accumulate_with_stats(
    apply_fn: ApplyFn, params, tokens_BT1, microbatches: int, order_T=None, scale=None, divide_by=None
):
    """`accumulate_gradients` plus the model's summed statistics (MoE: aux losses, loads, drops).
    Gradients are of the objective (loss + auxiliary objective); loss_sum is the cross-entropy.
    `scale`: the auxiliary objective's weight (`aux_scale`, or a callable giving it); None = that of
    `tokens_BT1` (the whole batch under plain jit; a replica's own under a per-replica stage, which
    passes the global one). `divide_by`: differentiate the objective over this (the batch's kept-target
    count), so the gradients come out as means and no pass divides them afterwards."""
    scale = (lambda: aux_scale(tokens_BT1)) if scale is None else scale

    def objective(p, t):
        total, aux = objective_sums(apply_fn, p, t, order_T, scale)
        return (total if divide_by is None else total / divide_by), aux

    grad_fn = jax.value_and_grad(objective, has_aux=True)
    if any(offload.on_host(p) for p in jax.tree.leaves(params)):  # offload.params=host
        grad_fn = on_device_gradients(apply_fn, order_T, scale, divide_by)
    if microbatches == 1:
        (_, (loss, count, stats)), grads = grad_fn(params, tokens_BT1)
        return grads, loss, count, stats

    def body(carry, tokens):
        (_, (loss, count, stats)), grads = grad_fn(params, tokens)
        return jax.tree.map(jnp.add, carry, (grads, loss, count, stats)), None

    micro = split_microbatches(tokens_BT1, microbatches)
    shapes = jax.eval_shape(lambda p, t: grad_fn(p, t)[0][1][2], params, micro[0])
    # Gradient sums on the device, wherever the parameters live (offload.params=host).
    zeros = (
        jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype), params),
        jnp.zeros((), jnp.float32),
        jnp.zeros((), jnp.float32),
    )
    init = (*zeros, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes))
    (grads, loss, count, stats), _ = jax.lax.scan(body, init, micro)
    return grads, loss, count, stats


@dataclasses.dataclass(frozen=True)
class GradientStage:
    """How gradients are computed and reduced over data-parallel replicas.

    `init(params) -> state`; `apply(params, tokens, state, step) -> (mean_grads, mean_loss, state, metrics)`;
    `state_specs(param_specs) -> PartitionSpecs of that state` (residuals are sharded like parameters).
    """

    init: Callable
    apply: Callable
    state_specs: Callable = lambda param_specs: ()
    name: str = "implicit"


def implicit_gradients(apply_fn: ApplyFn, microbatches: int, order_T=None, reduce_dtype="float32") -> GradientStage:
    """Plain jit: XLA partitions the batch and inserts the gradient reduction itself, in `reduce_dtype`
    for the bf16 weight gradients of the layers' matrices and the head (`jaxdist.parallel.matmul.reduce_in`;
    the embedding's and the norms' stay float32)."""

    def apply(params, tokens, state, step):
        # The mean's divisor enters the backward as its seed, not as a division of every gradient after
        # it: dividing afterwards by a count read from the batch (the loss mask's kept targets) cost an
        # extra vocabulary-table-sized float32 buffer (+0.26 GB temp at llama3-8b's vocabulary, fsdp=8;
        # the count was a constant before the loss mask, which XLA folded into the embedding's scatter).
        count = batch_count(tokens)
        with reduce_in(reduce_dtype):
            grads, loss, _, stats = accumulate_with_stats(
                apply_fn, params, tokens, microbatches, order_T, divide_by=count
            )
        return grads, loss / count, state, metrics_from_sums(stats, count)

    return GradientStage(init=lambda params: (), apply=apply)


def partial_gradients(apply_fn: ApplyFn, microbatches: int, split: Callable, combine: Callable, order_T=None):
    """The implicit stage over part of the parameters (LoRA: the adapters). `split(params) -> (trained,
    frozen)`, `combine(trained, frozen) -> params`: gradients, and their accumulation buffers, exist for
    `trained` only; the frozen part is a constant of the differentiated function (no gradient computed)."""

    def apply(params, tokens, state, step):
        trained, fixed = split(params)

        def apply_trained(t, x):
            return apply_fn(combine(t, fixed), x)

        grads, loss, count, stats = accumulate_with_stats(apply_trained, trained, tokens, microbatches, order_T)
        return jax.tree.map(lambda g: g / count, grads), loss / count, state, metrics_from_sums(stats, count)

    return GradientStage(init=lambda params: (), apply=apply, name="implicit-partial")
