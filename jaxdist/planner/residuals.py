"""What one decoder layer saves for its backward pass, read from JAX itself rather than a formula.

`jax.vjp` returns its backward function as a pytree whose leaves are the residuals the forward keeps
for the backward (under `jax.checkpoint` with a remat policy: exactly those the policy saves). Traced
with `jax.make_jaxpr` on one Block of the model (nothing is allocated) at a symbolic sequence length T
(`jax.export.symbolic_shape`), the residuals split into three kinds by how they grow with T: the layer's weights (constant: the scan
stacks its parameter shards, counted with the parameters), per-token activations (linear) and the
T x T attention scores (quadratic; a residual of both, as gpt-oss's T x (T + 1) scores with their sink
column, counted in each by its coefficients). The per-device bytes of a layer are then

    B_local * (per_token * T + per_token_pair * T^2)

with heads, kv heads and the MLP width divided by tp (the Megatron layout splits them; B·T·D rows are
replicated over tp), traced once per (model, tp, remat policy) and cached.

The residuals are read from the jaxpr of that backward function, and one buffer is counted once: JAX
lists a value once per use (each of q, k, v's matmuls keeps its own reshape of the normed input; two
identical masked-score computations), while XLA shares the buffer of a reshape or broadcast of the
same size (a bitcast) and merges identical computations (CSE). Residuals are therefore keyed by the
computation that makes them, looking through same-size reshapes, and counted once per key.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax import export

from jaxdist.config import ModelConfig
from jaxdist.models import registry
from jaxdist.models.decoder_layers import REMAT_POLICIES

TRACE_T = 16  # where the symbolic sizes are evaluated: the per-token and quadratic terms are exact at any T


@dataclasses.dataclass(frozen=True)
class Saved:
    per_token: float  # bytes per token (float32 activations)
    per_token_pair: float  # bytes per (query, key) pair: the materialised attention scores


@functools.lru_cache(maxsize=256)
def saved_per_layer(model: ModelConfig, tp: int, policy: str) -> Saved:
    """Residual bytes of one layer, per token and per token pair, float32, on a device holding 1/tp of
    the heads and of the MLP (dense layers and experts that see every token; the caller models
    dispatched MoE and context-parallel attention)."""

    layer, state = _traced_layer(model, tp, policy)
    (T,) = export.symbolic_shape("T")  # one trace: every residual's size is a polynomial in T
    x = jax.ShapeDtypeStruct((1, T, model.d_model), jnp.float32)
    try:
        jaxpr = jax.make_jaxpr(lambda x, s: jax.tree.leaves(jax.vjp(layer, x, s)[1]))(x, state).jaxpr
    except jax.errors.InconclusiveDimensionOperation:  # the layer branches on T's value: count at two
        return listed_per_layer(model, tp, policy)  # concrete lengths, unmerged
    linear = pairs = 0.0
    for v in unique_outputs(jaxpr):
        # a T^2 + b T + c from three lengths (gpt-oss's sink column makes T x (T + 1) scores), checked at a fourth
        s1, s2, s3, s4 = (_size(v, k * TRACE_T) for k in (1, 2, 3, 4))
        a = (s3 - 2 * s2 + s1) / (2 * TRACE_T**2)
        b = (s2 - s1) / TRACE_T - 3 * a * TRACE_T
        if s4 != s1 + 15 * a * TRACE_T**2 + 3 * b * TRACE_T:
            raise AssertionError(f"residual of shape {v.aval.shape} is not constant, linear or quadratic in T")
        linear, pairs = linear + b, pairs + a
    return Saved(linear, pairs)


@functools.lru_cache(maxsize=64)
def listed_per_layer(model: ModelConfig, tp: int, policy: str) -> Saved:
    """saved_per_layer with every leaf of the backward function's pytree counted as often as JAX lists
    it (`jax.eval_shape` at two concrete lengths; nothing merged): for context parallelism, whose
    attention (jaxdist.parallel.context) is not the Block's traced here, so the Block's merges do not
    describe its program (jaxdist.planner.memory)."""

    layer, state = _traced_layer(model, tp, policy)

    def sizes(T: int) -> list[int]:
        x = jax.ShapeDtypeStruct((1, T, model.d_model), jnp.float32)
        backward = jax.eval_shape(lambda x, s: jax.vjp(layer, x, s)[1], x, state)
        return [leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(backward)]

    a, b = sizes(TRACE_T), sizes(2 * TRACE_T)
    linear = sum(x for x, y in zip(a, b) if y == 2 * x)
    return Saved(linear / TRACE_T, sum(x for x, y in zip(a, b) if y == 4 * x) / TRACE_T**2)


@functools.lru_cache(maxsize=64)
def other_per_token(model: ModelConfig, tp: int, policy: str) -> float:
    """Bytes per token, averaged over the stack's layers, that the architecture's other layer kinds
    (registry.Architecture.other_layers: Qwen3-Next's gated DeltaNet) save beyond the `Block` each of them
    stands in for: share x (the kind's residuals per token - the Block's at model.seq_len, its scores
    included), float32, 0 where every layer is a Block. A kind is traced at two concrete lengths, whole
    multiples of its trace-length multiple (the delta rule pads to whole chunks), merged as
    `saved_per_layer` merges; the difference of the two is its per-token bytes."""
    kinds = registry.of(model).other_layers
    if kinds is None:
        return 0.0
    base = saved_per_layer(model, tp, policy)
    block = base.per_token + base.per_token_pair * model.seq_len
    extra = 0.0
    for factory, share, multiple in kinds(model, tp):
        T = -(-model.seq_len // multiple) * multiple
        layer, state = _traced_layer(model, tp, policy, factory)

        def size(t: int, layer=layer, state=state) -> int:
            x = jax.ShapeDtypeStruct((1, t, model.d_model), jnp.float32)
            jaxpr = jax.make_jaxpr(lambda x, s: jax.tree.leaves(jax.vjp(layer, x, s)[1]))(x, state).jaxpr
            return sum(_size(v, t) for v in unique_outputs(jaxpr))

        extra += share * ((size(2 * T) - size(T)) / T - block)
    return extra


def _traced_layer(model: ModelConfig, tp: int, policy: str, block=None):
    """(layer(x_BTD, state) under the remat policy, the abstract state) of one dense Block (or the layer
    `block(cfg, rngs)` makes) as one device computes it under tp (nothing is allocated)."""

    block = block or registry.of(model).block
    graphdef, state = nnx.split(nnx.eval_shape(lambda: block(_local(model, tp), nnx.Rngs(params=0))))

    def layer(x, state):
        return nnx.merge(graphdef, state)(x, jnp.arange(x.shape[1]))

    if policy != "none":
        layer = jax.checkpoint(layer, policy=REMAT_POLICIES[policy], prevent_cse=False)
    return layer, state


def _local(model: ModelConfig, tp: int) -> ModelConfig:
    """The layer one device computes under tp: 1/tp of the heads and of the MLP, dense, float32. Experts
    that see every token (registry `dense_experts`) stay, all of them (the step gathers them whole), 1/tp
    of each one's width."""
    dense_experts = registry.of(model).dense_experts and model.moe_experts
    return dataclasses.replace(
        model,
        num_heads=model.num_heads // tp,
        num_kv_heads=max(1, model.num_kv_heads // tp),
        mlp_dim=model.mlp_dim // tp,
        moe_experts=model.moe_experts if dense_experts else 0,
        moe_mlp_dim=model.moe_mlp_dim // tp if dense_experts else model.moe_mlp_dim,
        compute_dtype="float32",
    )


def _size(v, t: int) -> int:
    """Bytes of jaxpr variable v at T = t."""
    return math.prod(_dim(d, t) for d in v.aval.shape) * v.aval.dtype.itemsize


def _dim(d, t: int) -> int:
    """A dimension (an int, or a polynomial in the symbolic length T) at T = t."""
    return d if isinstance(d, int) else int(eval(str(d).replace("^", "**"), {"T": t}))


BITCASTS = ("reshape", "broadcast_in_dim", "squeeze", "expand_dims")  # same-size: XLA shares the buffer


def unique_outputs(jaxpr) -> list:
    """The jaxpr's output variables, one per distinct buffer (module docstring), in first-seen order."""
    producer = {v: e for e in jaxpr.eqns for v in e.outvars}
    inputs = {v: i for i, v in enumerate(jaxpr.invars)}
    keys: dict = {}

    def key(v):
        if not hasattr(v, "aval") or type(v).__name__ == "Literal":
            return ("literal", repr(getattr(v, "val", v)))
        if v in inputs:
            return ("input", inputs[v])
        if v not in producer:  # a constant the trace closed over (Qwen3-Next's Block): a buffer of its own
            return ("constant", id(v))
        if v not in keys:
            e = producer[v]
            if e.primitive.name in BITCASTS and v.aval.size == e.invars[0].aval.size:
                keys[v] = key(e.invars[0])
            else:
                params = tuple(sorted((k, str(p)) for k, p in e.params.items()))
                keys[v] = hash((e.primitive.name, params, tuple(key(i) for i in e.invars), e.outvars.index(v)))
        return keys[v]

    seen: dict = {}
    for v in jaxpr.outvars:
        if hasattr(v, "aval") and type(v).__name__ != "Literal":
            seen.setdefault(key(v), v)
    return list(seen.values())
