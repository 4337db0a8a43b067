"""The gradient stage: token-weighted loss sums, micro-batch split and accumulation, the implicit stage.

A leaf: it knows nothing of the trainer, the mesh or the config. `jaxdist.step` picks a stage from its
table (implicit here; the explicit data-parallel reduction in `jaxdist.parallel.reduce`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from jaxdist import loss


def token_loss_sums(apply_fn: Callable, params, tokens_BT1) -> tuple[jax.Array, jax.Array]:
    """Summed next-token cross-entropy and the token count (token-weighted, so sums of micro-batches
    divide into exactly the full-batch mean). `apply_fn(params, tokens, features=True)` gives the
    model's final hidden states and head (`jaxdist.loss.Head`), not logits: the loss applies the head."""
    inputs_BT, targets_BT = tokens_BT1[:, :-1], tokens_BT1[:, 1:]
    losses_BT = loss.cross_entropy(apply_fn(params, inputs_BT, features=True), targets_BT)
    return losses_BT.sum(), jnp.asarray(targets_BT.size, jnp.float32)


def split_microbatches(x_B, microbatches: int):
    """(B, ...) -> (M, B/M, ...) taking rows m, m+M, ...: each device keeps its own rows (no resharding).
    Used for gradient accumulation and for the pipeline's micro-batches."""
    return x_B.reshape(x_B.shape[0] // microbatches, microbatches, *x_B.shape[1:]).swapaxes(0, 1)


def accumulate_gradients(apply_fn: Callable, params, tokens_BT1, microbatches: int):
    """Sum of loss and gradients over micro-batches (a scan: one compiled forward/backward).
    Returns (grad_sum, loss_sum, token_count)."""
    grad_fn = jax.value_and_grad(lambda p, t: token_loss_sums(apply_fn, p, t), has_aux=True)
    if microbatches == 1:
        (loss, count), grads = grad_fn(params, tokens_BT1)
        return grads, loss, count

    def body(carry, tokens):
        g_acc, l_acc, n_acc = carry
        (loss, count), grads = grad_fn(params, tokens)
        return (jax.tree.map(jnp.add, g_acc, grads), l_acc + loss, n_acc + count), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    init = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
    (grads, loss, count), _ = jax.lax.scan(body, init, split_microbatches(tokens_BT1, microbatches))
    return grads, loss, count


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


def implicit_gradients(apply_fn: Callable, microbatches: int) -> GradientStage:
    """Plain jit: XLA partitions the batch and inserts the gradient all-reduce itself."""
    def apply(params, tokens, state, step):
        grads, loss, count = accumulate_gradients(apply_fn, params, tokens, microbatches)
        return jax.tree.map(lambda g: g / count, grads), loss / count, state, {}
    return GradientStage(init=lambda params: (), apply=apply)
