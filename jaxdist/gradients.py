"""The gradient stage: token-weighted loss sums, micro-batch split and accumulation, the implicit stage.

A leaf: it knows nothing of the trainer, the mesh or the config. `jaxdist.step` picks a stage from its
table (implicit here; the explicit data-parallel reduction in `jaxdist.parallel.reduce`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import optax


def token_loss_sums(apply_fn: Callable, params, tokens_BT1, order_T=None) -> tuple[jax.Array, jax.Array]:
    """Summed next-token cross-entropy and the token count (token-weighted, so sums of micro-batches
    divide into exactly the full-batch mean). `order_T` (context parallelism): the positions in the
    order the model computes them — inputs and targets are reordered alike, so the sums are unchanged."""
    inputs_BT, targets_BT = tokens_BT1[:, :-1], tokens_BT1[:, 1:]
    if order_T is not None:
        inputs_BT, targets_BT = (jnp.take(x, jnp.asarray(order_T), axis=1) for x in (inputs_BT, targets_BT))
    logits_BTV = apply_fn(params, inputs_BT)
    # One-hot labels, not a gather: the vocab dim stays tp-sharded (a reduction across shards), and
    # XLA's SPMD partitioner crashes on that gather inside a dp-manual shard_map (jax 0.10.2).
    labels_BTV = jax.nn.one_hot(targets_BT, logits_BTV.shape[-1], dtype=logits_BTV.dtype)
    losses_BT = optax.softmax_cross_entropy(logits_BTV, labels_BTV)
    return losses_BT.sum(), jnp.asarray(targets_BT.size, jnp.float32)


def split_microbatches(x_B, microbatches: int):
    """(B, ...) -> (M, B/M, ...) taking rows m, m+M, ...: each device keeps its own rows (no resharding).
    Used for gradient accumulation and for the pipeline's micro-batches."""
    return x_B.reshape(x_B.shape[0] // microbatches, microbatches, *x_B.shape[1:]).swapaxes(0, 1)


def accumulate_gradients(apply_fn: Callable, params, tokens_BT1, microbatches: int, order_T=None):
    """Sum of loss and gradients over micro-batches (a scan: one compiled forward/backward).
    Returns (grad_sum, loss_sum, token_count)."""
    grad_fn = jax.value_and_grad(lambda p, t: token_loss_sums(apply_fn, p, t, order_T), has_aux=True)
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


def implicit_gradients(apply_fn: Callable, microbatches: int, order_T=None) -> GradientStage:
    """Plain jit: XLA partitions the batch and inserts the gradient all-reduce itself."""
    def apply(params, tokens, state, step):
        grads, loss, count = accumulate_gradients(apply_fn, params, tokens, microbatches, order_T)
        return jax.tree.map(lambda g: g / count, grads), loss / count, state, {}
    return GradientStage(init=lambda params: (), apply=apply)
