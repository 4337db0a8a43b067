"""Expert parallelism over the `ep` mesh axis: tokens go to their experts' devices and back by all-to-all.

One `jax.shard_map`, manual over every mesh axis that is not manual already (the explicit dp
reduction may have made dp manual outside). Expert weights (E, D, F) carry logical names
('expert', 'embed', 'mlp'): the expert dim stays split over ep (each device owns E/ep experts), the
fsdp shards of `embed` are all-gathered here by hand, and the tp-split inner dim `mlp` stays split
(Megatron: each tp rank computes a slice of F, the output is summed over tp). Per device:

  N local tokens, their top-K experts (N, K) and renormalised gates (N, K)
  -> slot of each assignment in its expert's buffer: a stable sort by expert gives its rank in the
     group; assignments are ordered all first choices, then all second ones (GShard), so when a buffer
     overflows it is the weaker choices that drop
  -> dispatch buffer (E, C, D), C slots per expert; assignments ranked past C are dropped (counted)
  -> all_to_all over ep: split by destination device, received as (ep sources, E/ep, C, D)
  -> SwiGLU of each local expert over its ep·C rows (one batched matmul per weight)
  -> all_to_all back, combine: y_n = sum_k gate_nk * out[e_nk, slot_nk]

Dispatch modes: capacity, C = ceil(factor · N·K / E); dropless (default): a token sends at most one
row to any expert (its K choices are distinct), so C = N can never drop. XLA:CPU cannot run a ragged
all-to-all (`ragged-all-to-all` is UNIMPLEMENTED in its thunk emitter, jax 0.10.2) and its matmuls cost
their padded size (`jax.lax.ragged_dot` too: XLA:CPU expands it into one masked dense matmul per group,
measured here at the same time for 64 or 512 rows per group), so dropless splits the work in two:
- data movement in tiers: C = ceil(f·N·K/E) for f in DROPLESS_TIERS, then N. Every device's
  (source, expert) counts (one psum over ep of an (ep, E) integer table) and one pmax over the axes it makes manual
  pick the smallest tier that holds the fullest expert anywhere; `lax.switch` runs only that tier's
  buffer, all-to-all and return. Each direction sends E·C·D elements per device for the tier taken
  (worst case E·N·D; a perfectly balanced ragged exchange K·N·D). The switches move data only
  (linear in the rows, integer residuals): nothing is rematerialised.
- compute on the rows actually received: each local expert's rows from every source are packed
  contiguously (their counts are in the table) and `grouped_ffn.expert_chunks` runs the SwiGLU over them in chunks
  of 2·N·K/E rows, a loop whose trip count is the expert's load in chunks. So compute follows the real
  load, rounded up per expert by less than one chunk, whatever the tier; shapes stay static.
Nothing is ever dropped. The packed buffer holds an expert's worst case, ep·N rows, so it and the
two pre-activations kept for the backward are sized for that, zeros past the load.
"""

from __future__ import annotations

import functools
import math
from typing import Any, cast

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxdist.config import Config
from jaxdist.distributed.sharding import Rules, current_rules, drop_axes, logical_to_spec
from jaxdist.errors import JaxdistError
from jaxdist.parallel import fp8_experts
from jaxdist.parallel.grouped_ffn import chunk_rows, expert_chunks
from jaxdist.parallel.matmul import fp8_mode

EXPERT, INNER = "expert", "mlp"  # logical names of the expert dim and the tp-split inner dim


def capacity(tokens: int, experts: int, topk: int, factor: float | None) -> int:
    """Slots per expert for `tokens` local tokens: dropless (factor None) = tokens, the worst case."""
    if factor is None:
        return tokens
    return max(1, min(tokens, math.ceil(factor * tokens * topk / experts)))


def a2a_bytes_per_direction(tokens: int, cfg_model, dtype_bytes: int, ep: int) -> float:
    """Bytes one device sends per all-to-all of one MoE layer (ring model, (ep-1)/ep of the buffer)."""
    m = cfg_model
    factor = None if m.moe_dispatch == "dropless" else m.moe_capacity_factor
    C = capacity(tokens, m.moe_experts, m.moe_topk, factor)
    return m.moe_experts * C * m.d_model * dtype_bytes * (ep - 1) / ep


def check(cfg: Config, mesh, rules: Rules) -> None:
    """MoE constraints that need the mesh, as one-line errors."""
    m = cfg.model
    if not m.moe_experts:
        return
    ep = math.prod(mesh.shape[a] for a in rules.get(EXPERT, ()))
    if m.moe_experts % ep:
        raise JaxdistError(
            f"model.moe_experts={m.moe_experts} experts cannot be split over ep={ep} devices; "
            f"use an ep that divides {m.moe_experts}"
        )


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def route_slots(idx_NK, experts: int, C: int):
    """Slot (expert·C + rank) of each assignment, flattened first choices first: (K·N,) int32, with
    E·C for dropped ones, and the keep mask. Rank = position among its expert's assignments in a
    stable sort by expert."""
    e = idx_NK.T.reshape(-1)  # (K·N,), k-major
    order = jnp.argsort(e, stable=True)
    counts = jnp.bincount(e, length=experts)
    starts = jnp.cumsum(counts) - counts
    rank_sorted = jnp.arange(e.shape[0], dtype=jnp.int32) - starts[e[order]].astype(jnp.int32)
    rank = jnp.zeros_like(rank_sorted).at[order].set(rank_sorted)
    keep = rank < C
    return jnp.where(keep, e * C + rank, experts * C).astype(jnp.int32), keep


# Dropless capacity tiers, as factors of the balanced load N·K/E: the step takes the smallest tier that
# holds the fullest expert's assignments on every device, else the worst case C = N.
DROPLESS_TIERS = (1.25, 2.0)


def dropless_tiers(tokens: int, experts: int, topk: int) -> tuple[int, ...]:
    """Distinct slot counts a dropless layer may run with, smallest first, the last = tokens."""
    tiers = {capacity(tokens, experts, topk, f) for f in DROPLESS_TIERS} | {tokens}
    return tuple(sorted(tiers))


def select_tier(fullest, tiers):
    """Index of the smallest tier with at least `fullest` slots (the last tier holds every token)."""
    return jnp.sum(fullest > jnp.asarray(tiers[:-1]))


def _swiglu(x_RD, w_gate_DF, w_up_DF, w_down_FD, fp8="off") -> jax.Array:
    """One expert over its rows; with `fp8` (tensorwise, rowwise) each matmul is `fp8_experts.dot`."""
    dt = x_RD.dtype

    def mm(a, w) -> jax.Array:
        return a @ w.astype(dt) if fp8 == "off" else fp8_experts.dot(a, w.astype(dt), fp8)

    h = jax.nn.silu(mm(x_RD, w_gate_DF)) * mm(x_RD, w_up_DF)
    return mm(h, w_down_FD)


def _dispatch(x_ND, idx_NK, gate_NK, w_gate, w_up, w_down, *, experts, C, ep_axes, fp8="off"):
    """Capacity mode: slots, dispatch buffer, all-to-all, experts over every slot, all-to-all back,
    combine: -> (y_ND, keep)."""
    N, D = x_ND.shape
    K = idx_NK.shape[-1]
    slot, keep = route_slots(idx_NK, experts, C)
    token = jnp.tile(jnp.arange(N), K)
    buf = jnp.zeros((experts * C, D), x_ND.dtype).at[slot].set(x_ND[token], mode="drop")
    ep = math.prod(jax.lax.axis_size(a) for a in ep_axes) if ep_axes else 1
    El = experts // ep
    buf = buf.reshape(ep, El * C, D)
    if ep > 1:  # send each destination its experts' rows; receive (source, El·C, D)
        buf = jax.lax.all_to_all(buf, ep_axes, 0, 0, tiled=True)
    rows_ERD = buf.reshape(ep, El, C, D).swapaxes(0, 1).reshape(El, ep * C, D)
    out_ERD = jax.vmap(functools.partial(_swiglu, fp8=fp8))(rows_ERD, w_gate, w_up, w_down)
    out = out_ERD.reshape(El, ep, C, D).swapaxes(0, 1).reshape(ep, El * C, D)
    if ep > 1:  # back to the devices the tokens came from
        out = jax.lax.all_to_all(out, ep_axes, 0, 0, tiled=True)
    picked = jnp.take(out.reshape(experts * C, D), slot, axis=0, mode="fill", fill_value=0)
    gate = gate_NK.T.reshape(-1, 1).astype(x_ND.dtype)
    return (picked * gate).reshape(K, N, D).sum(0), keep


def _compact_index(recv_SE, C: int, R: int):
    """Received slot (source s, local expert j, rank r) -> its row in the compacted (El·R) buffer, where
    expert j's rows from every source lie contiguously from j·R; slots past the source's count -> El·R."""
    ep, El = recv_SE.shape
    offset_SE = jnp.cumsum(recv_SE, axis=0) - recv_SE
    r = jnp.arange(C)[None, None, :]
    dest = jnp.arange(El)[None, :, None] * R + offset_SE[:, :, None] + r
    return jnp.where(r < recv_SE[:, :, None], dest, El * R).reshape(-1).astype(jnp.int32)


def _dropless_there(x_ND, idx_NK, recv_SE, *, experts, C, R, ep_axes):
    """Tier C's dispatch, data movement only: slots, buffer, all-to-all, compacted rows (El·R, D)."""
    N, D = x_ND.shape
    K = idx_NK.shape[-1]
    ep, El = recv_SE.shape
    slot, _ = route_slots(idx_NK, experts, C)  # C holds the fullest expert: nothing drops
    buf = jnp.zeros((experts * C, D), x_ND.dtype).at[slot].set(x_ND[jnp.tile(jnp.arange(N), K)], mode="drop")
    if ep > 1:  # send each destination its experts' rows; receive (source, El·C, D)
        buf = jax.lax.all_to_all(buf.reshape(ep, El * C, D), ep_axes, 0, 0, tiled=True)
    dest = _compact_index(recv_SE, C, R)
    return jnp.zeros((El * R, D), x_ND.dtype).at[dest].set(buf.reshape(-1, D), mode="drop")


def _dropless_back(out_RD, idx_NK, recv_SE, *, experts, C, R, ep_axes):
    """Tier C's way back: compacted expert outputs -> slots -> all-to-all -> each assignment's row (K·N, D)."""
    D = out_RD.shape[-1]
    ep, El = recv_SE.shape
    slot, _ = route_slots(idx_NK, experts, C)
    buf = jnp.take(out_RD, _compact_index(recv_SE, C, R), axis=0, mode="fill", fill_value=0)
    if ep > 1:  # back to the devices the tokens came from
        buf = jax.lax.all_to_all(buf.reshape(ep, El * C, D), ep_axes, 0, 0, tiled=True)
    return jnp.take(buf.reshape(experts * C, D), slot, axis=0, mode="fill", fill_value=0)


def _dropless(x_ND, idx_NK, gate_NK, w_gate, w_up, w_down, *, experts, ep_axes, all_axes, fp8="off"):
    """Dropless: every device's (source, expert) counts (one psum over ep) give the smallest tier that
    holds the fullest expert anywhere (one pmax, the same tier on every device) and each local expert's
    received rows; `lax.switch` runs that tier's data movement, `expert_chunks` the experts on the rows
    actually received. Both switches move data only (linear, integer residuals), so nothing is
    rematerialised."""
    N, D = x_ND.shape
    K = idx_NK.shape[-1]
    ep = math.prod(jax.lax.axis_size(a) for a in ep_axes) if ep_axes else 1
    El = experts // ep
    counts_E = jnp.bincount(idx_NK.reshape(-1), length=experts).astype(jnp.int32)
    if ep > 1:
        me = jax.lax.axis_index(ep_axes)
        counts_SE = jax.lax.psum(jnp.zeros((ep, experts), jnp.int32).at[me].set(counts_E), ep_axes)
        recv_SE = jax.lax.dynamic_slice_in_dim(counts_SE, me * El, El, axis=1)
    else:
        counts_SE, recv_SE = counts_E[None], counts_E[None]
    fullest = jnp.max(counts_SE)
    if all_axes:
        fullest = jax.lax.pmax(fullest, all_axes)
    tiers = dropless_tiers(N, experts, K)
    tier = select_tier(fullest, tiers)
    chunk = chunk_rows(N, experts, K)
    R = math.ceil(ep * N / chunk) * chunk  # an expert receives at most every source's N tokens
    kw = dict(experts=experts, R=R, ep_axes=ep_axes)
    there = [functools.partial(_dropless_there, C=C, **kw) for C in tiers]
    rows = jax.lax.switch(tier, there, x_ND, idx_NK, recv_SE)
    dt = x_ND.dtype
    ws = (w.astype(dt) for w in (w_gate, w_up, w_down))
    # a functools.partial(jax.custom_vjp) function: pyright cannot carry its return type through both
    out = cast(jax.Array, expert_chunks(rows.reshape(El, R, D), recv_SE.sum(0), *ws, chunk, fp8))
    back = [functools.partial(_dropless_back, C=C, **kw) for C in tiers]
    picked = jax.lax.switch(tier, back, out.reshape(El * R, -1), idx_NK, recv_SE)
    gate = gate_NK.T.reshape(-1, 1).astype(x_ND.dtype)
    return (picked * gate).reshape(K, N, -1).sum(0)


def _local(
    x_BTD,
    logits_BTE,
    w_gate,
    w_up,
    w_down,
    *,
    route,
    experts,
    factor,
    ep_axes,
    gather,
    inner_axes,
    seq_axes=(),
    all_axes=(),
    fp8="off",
    route_args=(),
):
    """The per-device program (or the whole program without a mesh: ep_axes = ()). Top-K runs here,
    on local tokens: left to the automatic partitioner it all-gathers the router scores."""
    idx_BTK, gate_BTK = route(logits_BTE, *route_args)
    B, T, D = x_BTD.shape
    K = idx_BTK.shape[-1]
    N = B * T
    for i, axes in gather:  # the fsdp shards of the expert weights (and their gradients' reduce-scatter)
        w_gate, w_up = (jax.lax.all_gather(w, axes, axis=i, tiled=True) for w in (w_gate, w_up))
    for i, axes in gather:
        w_down = jax.lax.all_gather(w_down, axes, axis=2 if i == 1 else 1, tiled=True)
    args = (x_BTD.reshape(N, D), idx_BTK.reshape(N, K), gate_BTK.reshape(N, K), w_gate, w_up, w_down)
    if factor is not None:
        C = capacity(N, experts, K, factor)
        y_ND, keep = _dispatch(*args, experts=experts, C=C, ep_axes=ep_axes, fp8=fp8)
    else:  # dropless: nothing is ever dropped
        y = _dropless(*args, experts=experts, ep_axes=ep_axes, all_axes=all_axes, fp8=fp8)
        y_ND, keep = y, jnp.ones(N * K, bool)
    if inner_axes:  # each tp rank computed a slice of the experts' inner dim
        y_ND = jax.lax.psum(y_ND, inner_axes)
    dropped_B = (~keep).reshape(K, B, T).sum((0, 2)).astype(jnp.float32)
    counts_BE = jax.nn.one_hot(idx_BTK, experts, dtype=jnp.float32).sum((1, 2))
    if seq_axes:  # cp splits each sequence: per-sequence counts sum over its shards
        dropped_B, counts_BE = jax.lax.psum((dropped_B, counts_BE), seq_axes)
    return y_ND.reshape(B, T, D), dropped_B, counts_BE


def expert_ffn(x_BTD, logits_BTE, w_gate_EDF, w_up_EDF, w_down_EFD, names, factor: float | None, route, route_args=()):
    """Route tokens by their router logits and apply the experts. Returns y_BTD, dropped assignments
    per sequence (B,) and assignments per sequence and expert (B, E).
    `names`: the logical names of w_gate (('expert', 'embed', 'mlp')); `factor` None = dropless;
    `route(logits_BTE, *route_args) -> (expert ids, gates)`, each (B, T, K); `route_args`: small arrays it
    reads (DeepSeek-V3's selection bias), passed in replicated (captured instead, under an outer shard_map
    over pp they would carry that context's mesh into this one)."""
    experts = w_gate_EDF.shape[0]
    mesh, rules = jax.sharding.get_abstract_mesh(), current_rules()
    kw: dict[str, Any] = dict(
        route=route, experts=experts, factor=factor, fp8=fp8_mode()
    )  # model.fp8: set around the scan
    if rules is None or mesh.empty:
        return _local(
            x_BTD, logits_BTE, w_gate_EDF, w_up_EDF, w_down_EFD, ep_axes=(), gather=(), inner_axes=(),
            route_args=tuple(route_args), **kw,
        )  # fmt: skip
    done = set(mesh.manual_axes)
    manual = frozenset(a for a in mesh.axis_names if a not in done)
    spec = lambda n: drop_axes(logical_to_spec(n, rules, "moe"), done)
    x_spec, w_spec = spec(("batch", "seq", None)), spec(tuple(names))
    down_spec = P(w_spec[0], w_spec[2], w_spec[1])
    used = lambda i: _axes(w_spec[i])
    gather = tuple((i, used(i)) for i in (1,) if used(i))
    seq_axes = tuple(a for a in _axes(x_spec[1]) if mesh.shape[a] > 1)
    # the dropless tier is chosen alike on every device of the axes manual here. Not across axes already
    # manual outside (pp): a table pipeline schedule runs the layer inside its per-slot lax.switch, where
    # the other pp ranks run other branches, so a pmax over pp would wait for them (XLA:CPU aborts after
    # 40 s); the ep groups never span pp ranks, so the tier need not agree across them.
    every = tuple(a for a in mesh.axis_names if a not in done)
    n = len(route_args)
    body = lambda *a: _local(
        *a[:5], ep_axes=used(0), gather=gather, inner_axes=used(2), seq_axes=seq_axes, all_axes=every,
        route_args=a[5:], **kw,
    )  # fmt: skip
    # check_vma off: a size-1 cp axis still appears in x_spec; the per-sequence counts are summed over
    # the axes that really split the sequence (seq_axes) and replicated over the rest.
    fn = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(x_spec, x_spec, w_spec, w_spec, down_spec) + (P(),) * n,
        out_specs=(x_spec, P(x_spec[0]), P(x_spec[0])),
        axis_names=manual,
        check_vma=False,
    )
    return fn(x_BTD, logits_BTE, w_gate_EDF, w_up_EDF, w_down_EFD, *route_args)
