"""Context parallelism's collectives: the K/V exchange over cp for each context_impl (allgather, ring,
ulysses), forward, recompute and backward (jaxdist.planner.comms's docstring says what the compiler
emits)."""

from __future__ import annotations

from jaxdist.distributed.hlo import ring_bytes
from jaxdist.planner.layout import Layout
from jaxdist.planner.traffic import Traffic


def context_traffic(lay: Layout, layer_steps: int) -> list[Traffic]:
    """K/V exchange over cp (module docstring); `layer_steps` layer applications per step."""
    m, cp, tp = lay.cfg.model, lay.cp, lay.mesh["tp"]
    kv = lay.micro_batch * m.seq_len * m.num_kv_heads * m.head_dim / tp * lay.act_bytes  # one of K, V
    q = kv * m.num_heads / m.num_kv_heads
    fwd = 2 if m.remat == "full" else 1  # the recomputed forward exchanges again
    out = []
    if m.context_impl == "allgather":
        out.append(
            Traffic(
                "cp",
                "all-gather",
                "K and V",
                2 * fwd * layer_steps * ring_bytes("all-gather", cp, kv),
                2 * fwd * layer_steps,
            )
        )
        out.append(
            Traffic(
                "cp",
                "reduce-scatter",
                "K and V gradients",
                2 * layer_steps * ring_bytes("reduce-scatter", cp, kv),
                2 * layer_steps,
            )
        )
    elif m.context_impl == "ring":
        block = kv / cp
        n_fwd, n_bwd, n_grad = 2 * (cp - 1) * fwd, 2 * (cp - 1), 2 * cp
        out.append(
            Traffic(
                "cp",
                "collective-permute",
                "K/V blocks (fwd + bwd)",
                (n_fwd + n_bwd) * layer_steps * block,
                (n_fwd + n_bwd) * layer_steps,
            )
        )
        out.append(
            Traffic(
                "cp",
                "collective-permute",
                "dK/dV blocks home (float32)",
                n_grad * layer_steps * block * 4 / lay.act_bytes,
                n_grad * layer_steps,
            )
        )
    else:  # ulysses: q, k, v and the output each way; each all-to-all's result is 1/cp of the tensor
        passes = fwd + 1
        out.append(
            Traffic(
                "cp",
                "all-to-all",
                "heads <-> sequence",
                passes * layer_steps * ring_bytes("all-to-all", cp, (2 * q + 2 * kv) / cp),
                4 * passes * layer_steps,
            )
        )
    return out
