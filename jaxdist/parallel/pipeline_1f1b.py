"""Table-driven pipeline schedules (1F1B, interleaved 1F1B, zero bubble) in one SPMD program, with per-micro-batch VJPs.

GPipe / circular (`jaxdist.parallel.pipeline`) differentiate through the whole schedule, so every stage
keeps one input per iteration: memory grows with the micro-batch count M. Here gradients are computed
by the schedule itself: a `lax.scan` over the slots of a static table (`jaxdist.parallel.schedules`),
inside `shard_map` manual over pp. In each slot each stage runs, by `lax.switch` on its table entry:

- idle;
- F(v, i): the stage's chunk v on micro-batch i's input (stage 0, chunk 0: the embedding of its
  tokens), sent on to the next stage by `ppermute`; the last virtual stage does nothing here (its B
  computes the loss);
- B(v, i): `jax.vjp` of the chunk at its saved input (the forward is recomputed, as remat does), with
  the gradient received from the next stage (the last virtual stage: head + cross-entropy, cotangent
  1); the weight gradient is added in place to this stage's accumulator, the input gradient goes back
  by `ppermute` (stage 0, chunk 0: into the embedding table's gradient);
- with the backward split (zb_h1, zb_v): B(v, i) the input gradient only, W(v, i) the weight gradient
  only, later, from the same kept input and arrived gradient.

MoE layers: each chunk's VJP differentiates its layers' aux objective too (the balance and z losses are
sums over the micro-batch's tokens, so they split over micro-batches), weighted as the model's
`combine_aux` averages it over the stack; B's aux sums are accumulated per chunk and leave, in layer
order, as the step's MoE statistics.

Activations and gradients that arrive wait in small buffers whose slots the table assigns
(`schedule_buffers.buffers`): at most P stage inputs per stage for 1F1B, whatever M is. Every slot sends one
activation forward and one gradient backward (zeros when there is nothing to send).

The result (summed loss, gradients of the sum) leaves through a `jax.custom_vjp` whose forward runs the
schedule and whose backward scales the gradients it saved, so the gradient stages (`jax.grad` of the
objective, accumulation, explicit reductions) use it unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxdist.data import loss_mask
from jaxdist.parallel import schedule_buffers, schedules
from jaxdist.parallel.loss import cross_entropy
from jaxdist.parallel.microbatch import split_microbatches


def layer_order(x_SVG, table: schedules.Table):
    """Per-stage rows (P, V G, ...) -> the model's layer order (as `pipeline.from_stages`)."""
    P, V = table.stages, table.repeats
    x = x_SVG.reshape(P * V, x_SVG.shape[1] // V, *x_SVG.shape[2:])
    x = x[np.argsort(schedules.stage_groups(P, V, table.placement).ravel())]
    return x.reshape(-1, *x.shape[2:])


AXIS, STACK = "pp", "blocks"
# lax.switch branches
IDLE, F_FIRST, F_MID, F_LAST, B_FIRST, B_MID, B_LAST, W_FIRST, W_MID, W_LAST = range(10)
BRANCHES = ("idle", "F first", "F", "F last", "B first", "B", "B last", "W first", "W", "W last")
# action kind -> lax.switch branch (idle, forward, backward, weight gradient)
SWITCH = np.array([0, 1, 1, 0, 2, 2, 2, 3, 3, 3], np.int32)


def branch_table(table: schedules.Table) -> np.ndarray:
    """(slots, P, lanes) action kind refined by first / last virtual stage."""
    s = np.arange(table.stages)[None, :, None]
    first = (s == 0) & (table.chunk == 0)
    last = (s == table.last[0]) & (table.chunk == table.last[1])
    refine = lambda f, m, lst: np.where(first, f, np.where(last, lst, m))
    out = np.select(
        [table.kind == schedules.FWD, table.kind == schedules.BWD, table.kind == schedules.WGT],
        [refine(F_FIRST, F_MID, F_LAST), refine(B_FIRST, B_MID, B_LAST), refine(W_FIRST, W_MID, W_LAST)],
        IDLE,
    )
    return out.astype(np.int32)


def switch_constants(table: schedules.Table) -> tuple[dict, list[list[int]], schedule_buffers.Buffers]:
    """(the per-slot tables the scan reads, per lane the lax.switch branches it compiles, the buffers).
    Per lane, only the branches its table uses are compiled (two lanes: idle/forward, idle/backward)."""
    bufs = schedule_buffers.buffers(table)
    kinds = branch_table(table)
    used = [sorted(set(SWITCH[kinds[..., lane]].ravel().tolist()) | {0}) for lane in range(table.lanes)]
    remap = [np.searchsorted(u, SWITCH[kinds[..., lane]]).astype(np.int32) for lane, u in enumerate(used)]
    consts = {
        "branch": kinds,
        "switch": np.stack(remap, axis=-1),
        "chunk": table.chunk,
        "mb": table.mb,
        "x_read": np.maximum(bufs.x_read, 0),
        "g_read": np.maximum(bufs.g_read, 0),
        # an action whose output goes the other way round the ring (V placement's chunk 1)
        "flip": ~schedules.sends_down(schedules.FWD, table.chunk, table.placement),
    }
    # only the arrivals the table has (a ring placement: activations from below, gradients from above)
    consts |= {f"in {pool} {src}": a for (pool, src), a in bufs.arrive.items() if (a >= 0).any()}
    return consts, used, bufs


def schedule_objective(graphdef, pl, positions_T=None) -> Callable:
    """`objective(params, tokens_BT1) -> (loss_sum, (loss_sum, token_count, {}))` for `jaxdist.reduce.gradients`,
    its gradient computed by the table's schedule (custom VJP). `params` are staged (`to_stages`)."""
    table = pl.table()
    consts, used, bufs = switch_constants(table)

    def run(params, tokens_BT1, scale):
        """(objective sum, gradients of it, per stage the branches run, (cross-entropy sum, the layers'
        aux sums in layer order or None)) — the schedule. `scale` weighs the MoE aux objective."""
        rest = {k: v for k, v in params.items() if k != STACK}
        model = nnx.merge(graphdef, params)
        sched = _Schedule(graphdef, model, nnx.split(model.blocks)[0], pl, table, consts, used, bufs, positions_T)
        specs_stack = jax.tree.map(lambda _: P(AXIS), params[STACK])
        specs_rest = jax.tree.map(lambda _: P(), rest)
        acc, racc, loss, counts, aux = jax.shard_map(
            sched.per_rank,
            in_specs=(specs_stack, specs_rest, P(), P()),
            out_specs=(specs_stack, specs_rest, P(), P(AXIS), P(AXIS)),
            axis_names={AXIS},
            check_vma=False,
        )(params[STACK], rest, split_microbatches(tokens_BT1, pl.microbatches), scale)
        if not aux:  # dense
            return loss, {**racc, STACK: acc}, counts, (loss, None)
        combined = model.combine_aux(jax.tree.map(lambda a: layer_order(a, table), aux))
        return loss + scale * combined["objective"], {**racc, STACK: acc}, counts, (loss, combined)

    @jax.custom_vjp
    def objective(params, tokens_BT1, scale):
        total, _, _, parts = run(params, tokens_BT1, scale)
        return total, parts

    def fwd(params, tokens_BT1, scale):
        total, grads, _, parts = run(params, tokens_BT1, scale)
        return (total, parts), grads

    def bwd(grads, g):  # only the objective sum is differentiated; `scale` depends on the tokens alone
        return jax.tree.map(lambda a: (g[0] * a).astype(a.dtype), grads), None, None

    objective.defvjp(fwd, bwd)

    def objective_sums(params, tokens_BT1, order_T=None, scale=1.0):
        sparse = bool(nnx.merge(graphdef, params).cfg.moe_experts)  # trace time only
        weight = jnp.float32((scale() if callable(scale) else scale) if sparse else 0.0)
        total, (loss, combined) = objective(params, tokens_BT1, weight)
        count = loss_mask.split(tokens_BT1[:, 1:])[1].sum()  # the targets the loss mask keeps
        if combined is None:
            return total, (loss, count, {})
        stats = {k: v for k, v in combined.items() if k != "objective"}
        stats["moe_routed"] = jnp.float32(tokens_BT1.shape[0] * (tokens_BT1.shape[1] - 1))
        return total, (loss, count, stats)

    # (P, 4): per stage, the slots its lax.switch ran idle / forward / backward / weight gradient (the
    # program's own count)
    objective_sums.executed = lambda params, tokens_BT1: run(params, tokens_BT1, jnp.float32(0))[2]
    objective_sums.table = table
    return objective_sums


@dataclasses.dataclass(frozen=True)
class _Schedule:
    """What every rank shares: the model's pieces, the plan, the table and its constants."""

    graphdef: Any
    model: Any  # the merged model: its layer-running methods
    blocks_def: Any
    pl: Any
    table: schedules.Table
    consts: dict
    used: list
    bufs: schedule_buffers.Buffers
    positions_T: Any

    def per_rank(self, stack, rest, tokens_MbT1, scale):
        """Inside shard_map (manual over pp): the scan over the table's slots -> (chunk gradients,
        non-stack gradients summed over stages, loss, branches run, this stage's chunks' aux sums)."""
        V, G = self.pl.repeats, self.pl.layers_per_group
        local = jax.tree.map(lambda a: a[0].reshape(V, G, *a.shape[2:]), stack)  # (V, G, ...)
        rank = _Rank(self, stack, rest, local, tokens_MbT1, scale)
        carry, _ = jax.lax.scan(rank.body, rank.init(), jnp.arange(self.table.slots))
        _, _, _, acc, racc, loss, counts, aux = carry
        acc = jax.tree.map(lambda a: a.reshape(1, V * G, *a.shape[2:]), acc)
        aux = jax.tree.map(lambda a: a.reshape(1, V * G, *a.shape[2:]), aux)
        # Non-stack gradients live on stage 0 (embedding) and the last stage (norm, head): sum them.
        return acc, jax.lax.psum(racc, AXIS), jax.lax.psum(loss, AXIS), counts[None], aux


def _ran(b):  # which branch ran, counted, to read the bubble off the program
    return jnp.arange(4) == b


class _Rank:
    """One pipeline rank inside the shard_map: its chunks' forward and backward, and the scan body that
    runs one slot of the table.

    Three branches, so the chunk is compiled twice (forward; forward + backward) whatever the stage:
    first / last are per-device flags, handled by small conds inside. A table with the backward split
    (zb_h1) has a fourth: its B branch is the VJP with respect to the stage input only (sent back at
    once, with the loss on the last stage) and its W branch the VJP with respect to the weights (the
    chunk's and, first / last, the embedding's, final norm's and head's) from the kept input and the
    kept arrived gradient; each recomputes the chunk's forward. Each returns (sent forward, sent
    backward, chunk grads, other grads, loss, which branch ran)."""

    def __init__(self, sched: _Schedule, stack, rest, local, tokens_MbT1, scale):
        self.sched, self.stack, self.rest, self.local, self.tokens = sched, stack, rest, local, tokens_MbT1
        self.s = jax.lax.axis_index(AXIS)
        zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)
        x_like = jax.eval_shape(self.embed, rest, tokens_MbT1[0, :, :-1])
        self.zx = jnp.zeros(x_like.shape, x_like.dtype)
        self.zg, self.zr = zeros(jax.tree.map(lambda a: a[0], local)), zeros(rest)
        self.zacc = zeros(local)
        # MoE: one chunk's per-layer aux sums ({} when dense), and the weight of their objective in the
        # step's: the model's combine_aux averages it over every layer entry of the whole stack
        group = jax.tree.map(lambda a: a[0], local)
        aux_like = jax.eval_shape(lambda g, x: self.chunk_aux(g, x)[1], group, self.zx)
        self.zaux = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), aux_like)
        if aux_like:
            G, units = sched.pl.layers_per_group, sched.pl.layers_per_group * sched.pl.repeats * sched.pl.stages
            self.aux_weight = scale / (units * (aux_like["objective"].size // G))
        self.c = {k: jnp.asarray(v) for k, v in sched.consts.items()}
        S = sched.pl.stages
        self.fwd_perm = [(k, (k + 1) % S) for k in range(S)]
        self.bwd_perm = [(k, (k - 1) % S) for k in range(S)]
        split = sched.table.split_backward
        self.every = [self.idle, self.forward, self.backward_input if split else self.backward, self.weight]
        self.flips = bool(sched.consts["flip"].any())  # V placement: directions depend on the chunk
        self.keeps_own = any(k.endswith(" own") for k in sched.consts)  # a stage feeds itself (V's turn)

    def whole(self, r):  # the model with `r` as its non-stack parameters (embedding, final norm, head)
        return nnx.merge(self.sched.graphdef, {**r, STACK: self.stack})

    def chunk_aux(self, group, x):
        """(the chunk's output, its layers' aux sums stacked by layer; {} when dense)."""
        blocks = nnx.merge(self.sched.blocks_def, group)
        y, aux = self.sched.model.run_layers_aux(x, blocks, positions_T=self.sched.positions_T)
        return y, ({} if aux is None else aux)

    def chunk(self, group, x):
        return self.chunk_aux(group, x)[0]

    def embed(self, r, tok_bT):  # chat data: a masked-out token is stored ~id (jaxdist.data.loss_mask)
        return self.whole(r).embed(loss_mask.split(tok_bT)[0])

    def head_loss(self, r, y, tgt_bT):  # only the targets the loss mask keeps count
        ids_bT, weights_bT = loss_mask.split(tgt_bT)
        return (cross_entropy(self.whole(r).head(y), ids_bT) * weights_bT).sum()

    def stage_input(self, r, x, tok, first):  # stage 0, chunk 0: the embedding of its tokens
        return jax.lax.cond(first, lambda: self.embed(r, tok).astype(x.dtype), lambda: x)

    def idle(self, group, x, dy, tok, tgt, first, last):  # also F of the last virtual stage: B computes it
        return self.zx, self.zx, self.zg, self.zr, jnp.zeros((), jnp.float32), _ran(0), self.zaux

    def forward(self, group, x, dy, tok, tgt, first, last):
        y = self.chunk(group, self.stage_input(self.rest, x, tok, first))
        return y, self.zx, self.zg, self.zr, jnp.zeros((), jnp.float32), _ran(1), self.zaux

    def scalar(self, g, r, x, dy, tok, tgt, first, last):
        """The loss (last virtual stage), else <y, dy>, plus the chunk's weighted MoE aux objective: its
        VJP is the chunk's. Aux: (the cross-entropy sum or 0, the chunk's aux sums)."""
        y, aux = self.chunk_aux(g, self.stage_input(r, x, tok, first))
        dot = lambda: jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))
        ce = jax.lax.cond(last, lambda: self.head_loss(r, y, tgt).astype(jnp.float32), lambda: jnp.float32(0))
        value = jnp.where(last, ce, dot())
        if aux:
            value = value + self.aux_weight * jnp.sum(aux["objective"]).astype(jnp.float32)
        return value, (ce, aux)

    def backward(self, group, x, dy, tok, tgt, first, last):
        f = lambda g, r, x: self.scalar(g, r, x, dy, tok, tgt, first, last)
        _, vjp, (ce, aux) = jax.vjp(f, group, self.rest, x, has_aux=True)
        dg, dr, dx = vjp(jnp.ones((), jnp.float32))
        return self.zx, dx, dg, dr, ce, _ran(2), aux

    def backward_input(self, group, x, dy, tok, tgt, first, last):  # B of a split backward: dx only
        _, vjp, (ce, aux) = jax.vjp(
            lambda x: self.scalar(group, self.rest, x, dy, tok, tgt, first, last), x, has_aux=True
        )
        (dx,) = vjp(jnp.ones((), jnp.float32))
        return self.zx, dx, self.zg, self.zr, ce, _ran(2), aux

    def weight(self, group, x, dy, tok, tgt, first, last):  # W of a split backward: the weights' gradients
        f = lambda g, r: self.scalar(g, r, x, dy, tok, tgt, first, last)
        _, vjp, _ = jax.vjp(f, group, self.rest, has_aux=True)
        dg, dr = vjp(jnp.ones((), jnp.float32))
        return self.zx, self.zx, dg, dr, jnp.zeros((), jnp.float32), _ran(3), self.zaux

    def init(self):
        """(received forward, received backward, input buffers, gradient buffers, chunk gradients,
        other gradients, loss, branches run, the chunks' aux sums)."""
        buf = lambda n: jnp.zeros((n, *self.zx.shape), self.zx.dtype)
        bufs = self.sched.bufs
        zero = jnp.zeros((), jnp.float32)
        recv = {"down": self.zx, "up": self.zx} | ({"own": self.zx} if self.keeps_own else {})
        aux = jax.tree.map(lambda a: jnp.zeros((self.sched.pl.repeats, *a.shape), a.dtype), self.zaux)
        return (recv, buf(bufs.x_size), buf(bufs.g_size), self.zacc, self.zr, zero, jnp.zeros(4, jnp.int32), aux)

    def lane(self, t, lane, xbuf, gbuf):
        """Run lane `lane`'s table entry of slot t -> (chunk v, and what the branch returns)."""
        c, s = self.c, self.s
        kind, v, i = c["branch"][t, s, lane], c["chunk"][t, s, lane], c["mb"][t, s, lane]
        group = jax.tree.map(lambda a: a[v], self.local)
        tok_bT1 = self.tokens[i]
        x, dy = xbuf[c["x_read"][t, s, lane]], gbuf[c["g_read"][t, s, lane]]
        first = (kind == F_FIRST) | (kind == B_FIRST) | (kind == W_FIRST)
        last = (kind == F_LAST) | (kind == B_LAST) | (kind == W_LAST)
        operands = (group, x, dy, tok_bT1[:, :-1], tok_bT1[:, 1:], first, last)
        branches = [self.every[b] for b in self.sched.used[lane]]
        return v, jax.lax.switch(c["switch"][t, s, lane], branches, *operands)

    def body(self, carry, t):
        """One slot: file what arrived (from stage s-1, from s+1, the stage's own output), run the lanes,
        send the outputs on: down the ring (s -> s+1) and up (s -> s-1)."""
        recv, xbuf, gbuf, acc, racc, loss, counts, auxacc = carry
        pools = {"x": xbuf, "g": gbuf}
        for pool, src in ((p, src) for p in "xg" for src in ("down", "up", "own")):
            if f"in {pool} {src}" in self.c:
                pools[pool] = _put(pools[pool], self.c[f"in {pool} {src}"][t, self.s], recv[src])
        xbuf, gbuf = pools["x"], pools["g"]
        down, up = self.zx, self.zx
        for lane in range(self.sched.table.lanes):  # two lanes: a forward, then a backward
            v, (y, dx, dg, dr, li, took, aux) = self.lane(t, lane, xbuf, gbuf)
            acc = jax.tree.map(lambda a, g, v=v: a.at[v].add(g), acc, dg)
            auxacc = jax.tree.map(lambda a, x, v=v: a.at[v].add(x), auxacc, aux)  # B's (once per micro-batch)
            racc = jax.tree.map(jnp.add, racc, dr)
            if self.flips:  # one action per slot: y or dx is zero; chunk 1 of a V sends each the other way
                flip = self.c["flip"][t, self.s, lane]
                y, dx = jnp.where(flip, dx, y), jnp.where(flip, y, dx)
            down, up, loss, counts = down + y, up + dx, loss + li, counts + took
        recv = {"down": jax.lax.ppermute(down, AXIS, self.fwd_perm), "up": jax.lax.ppermute(up, AXIS, self.bwd_perm)}
        if self.keeps_own:
            recv["own"] = down + up  # the one output of the slot, whichever way it went
        return (recv, xbuf, gbuf, acc, racc, loss, counts, auxacc), None


def _put(buf, slot, value):
    """buf[slot] = value where slot >= 0."""
    i = jnp.maximum(slot, 0)
    return jax.lax.dynamic_update_index_in_dim(buf, jnp.where(slot >= 0, value, buf[i]), i, 0)
