"""Table-driven pipeline schedules (1F1B, interleaved 1F1B) in one SPMD program, with per-micro-batch VJPs.

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
  by `ppermute` (stage 0, chunk 0: into the embedding table's gradient).

Activations and gradients that arrive wait in small buffers whose slots the table assigns
(`schedules.buffers`): at most P stage inputs per stage for 1F1B, whatever M is. Every slot sends one
activation forward and one gradient backward (zeros when there is nothing to send).

The result (summed loss, gradients of the sum) leaves through a `jax.custom_vjp` whose forward runs the
schedule and whose backward scales the gradients it saved, so the gradient stages (`jax.grad` of the
objective, accumulation, explicit reductions) use it unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxdist import loss_mask
from jaxdist.gradients import split_microbatches
from jaxdist.loss import cross_entropy
from jaxdist.parallel import schedules

AXIS, STACK = "pp", "blocks"
# lax.switch branches
IDLE, F_FIRST, F_MID, F_LAST, B_FIRST, B_MID, B_LAST = range(7)
BRANCHES = ("idle", "F first", "F", "F last", "B first", "B", "B last")
SWITCH = np.array([0, 1, 1, 0, 2, 2, 2], np.int32)  # action kind -> lax.switch branch (idle, forward, backward)


def branch_table(table: schedules.Table) -> np.ndarray:
    """(slots, P, lanes) action kind refined by first / last virtual stage."""
    P, V = table.stages, table.repeats
    s = np.arange(P)[None, :, None]
    first = (s == 0) & (table.chunk == 0)
    last = (s == P - 1) & (table.chunk == V - 1)
    fwd = np.where(first, F_FIRST, np.where(last, F_LAST, F_MID))
    bwd = np.where(first, B_FIRST, np.where(last, B_LAST, B_MID))
    out = np.where(table.kind == schedules.FWD, fwd, np.where(table.kind == schedules.BWD, bwd, IDLE))
    return out.astype(np.int32)


def schedule_objective(graphdef, pl, positions_T=None) -> Callable:
    """`objective(params, tokens_BT1) -> (loss_sum, (loss_sum, token_count, {}))` for `jaxdist.gradients`,
    its gradient computed by the table's schedule (custom VJP). `params` are staged (`to_stages`)."""
    table = schedules.build(pl.schedule, pl.stages, pl.microbatches, pl.repeats)
    bufs = schedules.buffers(table)
    kinds = branch_table(table)
    # Per lane, only the branches its table uses are compiled (two lanes: idle/forward, idle/backward).
    used = [sorted(set(SWITCH[kinds[..., lane]].ravel().tolist()) | {0}) for lane in range(table.lanes)]
    remap = [np.searchsorted(u, SWITCH[kinds[..., lane]]).astype(np.int32) for lane, u in enumerate(used)]
    consts = {
        "branch": kinds,
        "switch": np.stack(remap, axis=-1),
        "chunk": table.chunk,
        "mb": table.mb,
        "x_in": bufs.x_in,
        "g_in": bufs.g_in,
        "x_read": np.maximum(bufs.x_read, 0),
        "g_read": np.maximum(bufs.g_read, 0),
    }
    S, V, G = pl.stages, pl.repeats, pl.layers_per_group

    def run(params, tokens_BT1):
        """(loss_sum, gradients of loss_sum) — the schedule."""
        rest = {k: v for k, v in params.items() if k != STACK}
        model = nnx.merge(graphdef, params)
        blocks_def, _ = nnx.split(model.blocks)
        tokens_MbT1 = split_microbatches(tokens_BT1, pl.microbatches)

        def per_rank(stack, rest, tokens_MbT1):
            local = jax.tree.map(lambda a: a[0].reshape(V, G, *a.shape[2:]), stack)  # (V, G, ...)
            s = jax.lax.axis_index(AXIS)

            def whole(r):  # the model with `r` as its non-stack parameters (embedding, final norm, head)
                return nnx.merge(graphdef, {**r, STACK: stack})

            def chunk(group, x):
                return model.run_layers_aux(x, nnx.merge(blocks_def, group), positions_T=positions_T)[0]

            def embed(r, tok_bT):  # chat data: a masked-out token is stored ~id (jaxdist.loss_mask)
                return whole(r).embed(loss_mask.split(tok_bT)[0])

            def head_loss(r, y, tgt_bT):  # only the targets the loss mask keeps count
                ids_bT, weights_bT = loss_mask.split(tgt_bT)
                return (cross_entropy(whole(r).head(y), ids_bT) * weights_bT).sum()

            zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)
            tok0 = tokens_MbT1[0, :, :-1]
            x_like = jax.eval_shape(embed, rest, tok0)
            zx = jnp.zeros(x_like.shape, x_like.dtype)
            zg, zr = zeros(jax.tree.map(lambda a: a[0], local)), zeros(rest)

            # Three branches, so the chunk is compiled twice (forward; forward + backward) whatever the
            # stage: first / last are per-device flags, handled by small conds inside.
            # Each: (sent forward, sent backward, chunk grads, other grads, loss, which branch ran).
            ran = lambda b: jnp.arange(3) == b  # counted, to read the bubble off the program

            def idle(group, x, dy, tok, tgt, first, last):  # also F of the last virtual stage: B computes it
                return zx, zx, zg, zr, jnp.zeros((), jnp.float32), ran(0)

            def stage_input(r, x, tok, first):  # stage 0, chunk 0: the embedding of its tokens
                return jax.lax.cond(first, lambda: embed(r, tok).astype(x.dtype), lambda: x)

            def forward(group, x, dy, tok, tgt, first, last):
                return chunk(group, stage_input(rest, x, tok, first)), zx, zg, zr, jnp.zeros((), jnp.float32), ran(1)

            def backward(group, x, dy, tok, tgt, first, last):
                def scalar(g, r, x):  # the loss (last virtual stage), else <y, dy>: its VJP is the chunk's
                    y = chunk(g, stage_input(r, x, tok, first))
                    dot = lambda: jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))
                    return jax.lax.cond(last, lambda: head_loss(r, y, tgt).astype(jnp.float32), dot)

                out, vjp = jax.vjp(scalar, group, rest, x)
                dg, dr, dx = vjp(jnp.ones((), jnp.float32))
                return zx, dx, dg, dr, jnp.where(last, out, 0.0), ran(2)

            every = [idle, forward, backward]
            c = {k: jnp.asarray(v) for k, v in consts.items()}
            fwd_perm = [(k, (k + 1) % S) for k in range(S)]
            bwd_perm = [(k, (k - 1) % S) for k in range(S)]

            def put(buf, slot, value):
                """buf[slot] = value where slot >= 0."""
                i = jnp.maximum(slot, 0)
                return jax.lax.dynamic_update_index_in_dim(buf, jnp.where(slot >= 0, value, buf[i]), i, 0)

            def body(carry, t):
                recv_f, recv_b, xbuf, gbuf, acc, racc, loss, counts = carry
                xbuf = put(xbuf, c["x_in"][t, s], recv_f)
                gbuf = put(gbuf, c["g_in"][t, s], recv_b)
                send_f, send_b = zx, zx
                for lane in range(table.lanes):  # two lanes: a forward, then a backward
                    kind, v, i = c["branch"][t, s, lane], c["chunk"][t, s, lane], c["mb"][t, s, lane]
                    group = jax.tree.map(lambda a, v=v: a[v], local)
                    tok_bT1 = tokens_MbT1[i]
                    x, dy = xbuf[c["x_read"][t, s, lane]], gbuf[c["g_read"][t, s, lane]]
                    first, last = (kind == F_FIRST) | (kind == B_FIRST), (kind == F_LAST) | (kind == B_LAST)
                    operands = (group, x, dy, tok_bT1[:, :-1], tok_bT1[:, 1:], first, last)
                    branches = [every[b] for b in used[lane]]
                    y, dx, dg, dr, li, took = jax.lax.switch(c["switch"][t, s, lane], branches, *operands)
                    acc = jax.tree.map(lambda a, g, v=v: a.at[v].add(g), acc, dg)
                    racc = jax.tree.map(jnp.add, racc, dr)
                    send_f, send_b, loss, counts = send_f + y, send_b + dx, loss + li, counts + took
                recv_f = jax.lax.ppermute(send_f, AXIS, fwd_perm)
                recv_b = jax.lax.ppermute(send_b, AXIS, bwd_perm)
                return (recv_f, recv_b, xbuf, gbuf, acc, racc, loss, counts), None

            buf = lambda n: jnp.zeros((n, *zx.shape), zx.dtype)
            init = (zx, zx, buf(bufs.x_size), buf(bufs.g_size), zeros(local), zr, jnp.zeros((), jnp.float32))
            init = (*init, jnp.zeros(3, jnp.int32))
            carry, _ = jax.lax.scan(body, init, jnp.arange(table.slots))
            _, _, _, _, acc, racc, loss, counts = carry
            acc = jax.tree.map(lambda a: a.reshape(1, V * G, *a.shape[2:]), acc)
            # Non-stack gradients live on stage 0 (embedding) and the last stage (norm, head): sum them.
            return acc, jax.lax.psum(racc, AXIS), jax.lax.psum(loss, AXIS), counts[None]

        specs_stack = jax.tree.map(lambda _: P(AXIS), params[STACK])
        specs_rest = jax.tree.map(lambda _: P(), rest)
        acc, racc, loss, counts = jax.shard_map(
            per_rank,
            in_specs=(specs_stack, specs_rest, P()),
            out_specs=(specs_stack, specs_rest, P(), P(AXIS)),
            axis_names={AXIS},
            check_vma=False,
        )(params[STACK], rest, tokens_MbT1)
        return loss, {**racc, STACK: acc}, counts

    @jax.custom_vjp
    def objective(params, tokens_BT1):
        return run(params, tokens_BT1)[0]

    def fwd(params, tokens_BT1):
        loss, grads, _ = run(params, tokens_BT1)
        return loss, grads

    def bwd(grads, g):
        return jax.tree.map(lambda a: (g * a).astype(a.dtype), grads), None

    objective.defvjp(fwd, bwd)

    def objective_sums(params, tokens_BT1, order_T=None):
        loss = objective(params, tokens_BT1)
        count = loss_mask.split(tokens_BT1[:, 1:])[1].sum()  # the targets the loss mask keeps
        return loss, (loss, count, {})

    # (P, 3): per stage, the slots its lax.switch ran idle / forward / backward (the program's own count)
    objective_sums.executed = lambda params, tokens_BT1: run(params, tokens_BT1)[2]
    objective_sums.table = table
    return objective_sums
