"""The blockwise loss's view of the output head (jaxdist/parallel/loss.py): how many vocabulary rows a
block holds and how many blocks one all-gather brings (`block_rows`, `plan_for`, `Plan`), the (D, S, nb,
vb) view of the head and its blocks, the scan over them with one gather per chunk of blocks, a block's
logits and its targets' positions."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxdist.distributed.sharding import Rules, constrain
from jaxdist.errors import JaxdistError
from jaxdist.parallel import context

HEAD_GATHER = "head_gather"  # the jax scope of the head's all-gathers (tests count them in the HLO)
BLOCK_BYTES = 32 * 2**20  # auto block: one block's float32 logits, weight, gradient per device under this


@dataclasses.dataclass(frozen=True)
class Plan:
    """How the blockwise loss spends memory to save work. The head is all-gathered `chunk` blocks at a
    time (one collective per chunk and pass, each block then sliced locally from it); `keep_logits`
    keeps each block's float32 logits from the forward for the backward, which then does no second
    matmul over the vocabulary (the forward's logits, the input and the weight gradients: 3 passes,
    not 4)."""

    chunk: int
    keep_logits: bool


def plan_for(tokens: int, vb: int, nb: int, d_model: int, dtype, gather_mib: int, keep_mib: int) -> Plan:
    """Per device: the most blocks (a divisor of nb, at least 1) whose gathered head (d_model x blocks·vb
    in `dtype`) takes at most `gather_mib` MiB; keep the logits when all of them (tokens x nb·vb in
    `dtype`, the compute dtype they are kept in) take at most `keep_mib` MiB."""
    size = jnp.dtype(dtype).itemsize
    chunk = max(
        k for k in range(1, nb + 1) if nb % k == 0 and (k == 1 or k * vb * d_model * size <= gather_mib * 2**20)
    )
    return Plan(chunk, 0 < tokens * nb * vb * size <= keep_mib * 2**20)


def token_rules(rules: Rules | None) -> Rules | None:
    """Rules for the flattened (B·T) token dim, named "batch" here: when cp splits the sequence, the
    flattened dim is split over the batch axes and then cp (row-major), so each device keeps its own
    tokens — not an all-gather of the sequence."""
    if rules is None or not context.splits_sequence():
        return rules
    return {**rules, "batch": tuple(rules["batch"]) + tuple(rules["seq"])}


def mesh_size(rules, name: str) -> int:
    """Devices the logical axis `name` is split over here (manual axes of an enclosing shard_map excluded)."""
    mesh = jax.sharding.get_abstract_mesh()
    if rules is None or mesh.empty:
        return 1
    return math.prod(mesh.shape[a] for a in rules[name] if a not in mesh.manual_axes)


def vocab_shards(rules) -> int:
    return mesh_size(rules, "vocab")


def batch_shards(rules) -> int:
    return mesh_size(rules, "batch")


def block_rows(vocab: int, shards: int, tokens: int, d_model: int, block: int = 0) -> int:
    """Vocab rows per block on each device: `block` if given (it must divide V / shards), else the
    largest divisor of V / shards whose float32 block of logits (tokens x rows) and of gathered weight
    or its unreduced gradient (d_model x rows) each stay under BLOCK_BYTES."""
    local = vocab // shards
    if block:
        if local % block:
            raise JaxdistError(
                f"model.loss_block={block} must divide the vocab rows per device, "
                f"model.vocab_size={vocab} / {shards} vocab shards = {local}; "
                f"use a divisor of {local} or 0 (automatic)"
            )
        return block
    limit = max(1, BLOCK_BYTES // (4 * max(tokens, d_model, 1)))
    return max(d for d in range(1, min(local, limit) + 1) if local % d == 0)


def head_blocks(w_DV, shards: int, vb: int):
    """(D, V) -> (D, S, nb, vb), a reshape (no copy): [:, s, j] holds rows s·V/S + j·vb + k, so block j
    is vb rows of every shard s."""
    D, V = w_DV.shape
    return constrain(w_DV.reshape(D, shards, V // (shards * vb), vb), ("embed", "vocab", None, None))


def block(w_DSnv, j):
    """Block j (D, S, vb), sliced on the unsharded block axis (local on every device)."""
    return jax.lax.dynamic_index_in_dim(w_DSnv, j, axis=2, keepdims=False)


def dot(spec: str, a, b):
    """einsum in the operands' dtype, then float32 (as the naive head: bf16 matmuls give bf16; XLA:CPU
    cannot run a stand-alone bf16 x bf16 -> f32 dot)."""
    return jnp.einsum(spec, a, b).astype(jnp.float32)


def gathered_chunk(w_DSkv, dtype):
    """A chunk of blocks (D, S, k, vb) in the compute dtype, cast on its shard and then all-gathered
    over fsdp in one collective, for every matmul of its blocks."""
    with jax.named_scope(HEAD_GATHER):
        w = constrain(w_DSkv.astype(dtype), ("embed", "vocab", None, None))
        return constrain(w, (None, "vocab", None, None))


def block_logits(x_ND, w_DSv):
    """One block's float32 logits (N, S, vb) from its gathered weight."""
    out = dot("nd,dsv->nsv", x_ND, w_DSv)
    return constrain(out, ("batch", "vocab", None))


def target_mask(targets_N, j, shape, nb: int):
    """Where block j's logits (N, S, vb) hold each token's target (all False for a target elsewhere)."""
    vb = shape[2]
    s_y, r = targets_N // (nb * vb), targets_N % (nb * vb)
    hit_N = r // vb == j
    s_iota = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    v_iota = jax.lax.broadcasted_iota(jnp.int32, shape, 2)
    return hit_N[:, None, None] & (s_iota == s_y[:, None, None]) & (v_iota == (r % vb)[:, None, None])


def chunks(w_DSnv, chunk: int):
    """(D, S, nb, vb) -> (D, S, nc, chunk, vb): chunk c holds blocks c·chunk .. c·chunk + chunk - 1."""
    D, S, nb, vb = w_DSnv.shape
    return constrain(w_DSnv.reshape(D, S, nb // chunk, chunk, vb), ("embed", "vocab", None, None, None))


def scan_blocks(w_blocks, dtype, chunk: int, body, carry, xs):
    """scan `body(carry, (j, w_j, x_j))` over the head's blocks j, each block's gathered weight
    w_j (D, S, vb) sliced from its chunk's copy, which is all-gathered once (an outer scan over chunks)."""
    nb = w_blocks.shape[2]
    w_chunks = chunks(w_blocks, chunk)
    split = lambda a: None if a is None else a.reshape(nb // chunk, chunk, *a.shape[1:])

    def outer(carry, c_x):
        c, x_c = c_x
        w_c = gathered_chunk(block(w_chunks, c), dtype)
        inner = lambda carry, i_x: body(carry, (c * chunk + i_x[0], block(w_c, i_x[0]), i_x[1]))
        return jax.lax.scan(inner, carry, (jnp.arange(chunk), x_c))

    carry, ys = jax.lax.scan(outer, carry, (jnp.arange(nb // chunk), split(xs)))
    return carry, None if ys is None else ys.reshape(nb, *ys.shape[2:])
