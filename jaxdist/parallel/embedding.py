"""The embedding lookup on the sharded table, without gathering the table on any device.

The table (V, D) is split vocab -> tp rows and embed -> fsdp columns; tokens (B, T) batch -> (dp,
fsdp). Letting XLA partition `take(table, tokens)` gathers the whole table's embed dim first (V/tp·D
per device: 2.1 GB for Llama 3 8B in float32), and the partitioner crashes on the gather inside a
dp-manual shard_map with tp > 1 (jax 0.10.2). Instead, a small shard_map over exactly the axes that
split the table and the tokens does it by hand:
  1. all-gather the (int) tokens over the embed axes: each device sees its fsdp group's tokens;
  2. look them up in the local (V/tp, D/fsdp) shard; rows of other vocab shards are zero, and a psum
     over the vocab axes fills them in (one B·T·D/fsdp all-reduce);
  3. all-to-all over the embed axes: send each device its own tokens' slice of D, receive every D slice
     of its own tokens -> (B_local, T, D) as the layers want it.
The table's gradient is then a local scatter-add into its own shard. Out-of-vocab tokens give NaN rows,
as `jnp.take` does (the non-finite guard then skips the step).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxdist.distributed.sharding import constrain, current_rules


def _axes(rules, name: str, mesh) -> tuple[str, ...]:
    """Mesh axes of logical `name` that are live here: size > 1 and not already manual."""
    return tuple(a for a in rules[name] if a not in mesh.manual_axes and mesh.shape[a] > 1)


def lookup(table_VD, tokens_BT, dtype):
    """Rows of `table_VD` for `tokens_BT` -> (B, T, D) in `dtype`, sharded ("batch", "seq", None)."""
    mesh, rules = jax.sharding.get_abstract_mesh(), current_rules()
    if rules is None or mesh.empty:
        return jnp.take(table_VD, tokens_BT, axis=0).astype(dtype)
    vocab, embed = _axes(rules, "vocab", mesh), _axes(rules, "embed", mesh)
    batch, seq = _axes(rules, "batch", mesh), _axes(rules, "seq", mesh)
    token_axes = set(batch) | set(seq)
    if not set(embed) <= set(batch) or set(vocab) & token_axes:
        # Rules this scheme does not cover: let XLA gather the table's embed dim (correct, more memory).
        table = constrain(table_VD, ("vocab", None))
        return constrain(jnp.take(table, tokens_BT, axis=0).astype(dtype), ("batch", "seq", None))
    if not (vocab or embed):
        return constrain(jnp.take(table_VD, tokens_BT, axis=0).astype(dtype), ("batch", "seq", None))
    B, T = tokens_BT.shape
    if B % math.prod(mesh.shape[a] for a in batch) or T % math.prod(mesh.shape[a] for a in seq):
        # A batch the mesh does not split evenly (a few prompts in generation, an odd test batch):
        # XLA's own gather of the table is correct there, if heavier.
        table = constrain(table_VD, ("vocab", None))
        return jnp.take(table, tokens_BT, axis=0).astype(dtype)

    V = table_VD.shape[0]
    spec = lambda axes: None if not axes else axes[0] if len(axes) == 1 else axes

    def local(table_vd, tokens_bt):
        tokens = jax.lax.all_gather(tokens_bt, embed, axis=0, tiled=True) if embed else tokens_bt
        if vocab:
            shard = table_vd.shape[0]
            offset = jax.lax.axis_index(vocab) * shard
            idx = tokens - offset
            mine = (idx >= 0) & (idx < shard)
            x = jnp.where(mine[..., None], jnp.take(table_vd, jnp.where(mine, idx, 0), axis=0), 0.0)
            x = jax.lax.psum(x, vocab)
        else:
            x = jnp.take(table_vd, tokens, axis=0)
        x = jnp.where(((tokens >= 0) & (tokens < V))[..., None], x, jnp.nan).astype(dtype)
        if embed:
            x = jax.lax.all_to_all(x, embed, split_axis=0, concat_axis=2, tiled=True)
        return x

    fn = jax.shard_map(
        local,
        in_specs=(P(spec(vocab), spec(embed)), P(spec(batch), spec(seq))),
        out_specs=P(spec(batch), spec(seq), None),
        axis_names=set(vocab) | set(embed) | token_axes,
    )
    return fn(table_VD, tokens_BT)
