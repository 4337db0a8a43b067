"""Issue 18's throughput target in one process: dense `tiny` at fsdp=8 against `tiny-moe` (same active
parameters) at ep=8, dropless and capacity dispatch, each timed by `jaxdist.analysis.bench.measure`.

    nice -n 10 python scripts/bench/moe_bench.py [--steps 10] [--rounds 2]

Rounds interleave the three programs (dense, dropless, capacity, dense, ...) so that a change in the
shared machine's load hits all of them; each line is one measurement, the summary takes each one's
best round. Ratios are tokens/s over dense's. Every MoE measurement also reports the routing it ran
with, before its first step and after its last (all steps train on the same random batch): per layer,
the fullest expert's assignments on the fullest device (of N = 128 tokens there, balanced = N·K/E =
32), the dropless tier that load selects (slots per expert, the all-to-all's size), the rows the
fullest expert receives from all devices (balanced 256), the rows dropless computes over the rows
routed (each expert's load rounded up to whole chunks of N·K/E) and the assignments capacity mode drops.
"""

from __future__ import annotations

import argparse
import functools
import json

RUNS = {
    "dense tiny fsdp=8": (None, "fsdp=8", []),
    "tiny-moe ep=8 dropless": ("configs/tiny-moe.yaml", "ep=8", ["model.moe_dispatch=dropless"]),
    "tiny-moe ep=8 capacity": ("configs/tiny-moe.yaml", "ep=8", ["model.moe_dispatch=capacity"]),
}


_FORWARD = {}


def _one_device_forward(cfg):
    """The model's forward on one device, returning its expert loads per layer (built once per config)."""
    import jax

    from jaxdist.distributed import mesh as mesh_mod
    from jaxdist.training import step

    if str(cfg) not in _FORWARD:
        prog = step.build_program(cfg, mesh_mod.mesh_from_string("fsdp=1", devices=jax.devices()[:1]))
        _FORWARD[str(cfg)] = prog, jax.jit(lambda p, t: prog.apply_fn(p, t)[1]["moe_load"])
    return _FORWARD[str(cfg)]


def routing(cfg, prog, tokens, state) -> dict:
    """Per layer, over the devices' local tokens (ep=8, batch 8: one sequence per device): the fullest
    expert's count, the dropless tier it selects, and capacity mode's dropped fraction."""
    import jax
    import numpy as np

    from jaxdist.parallel import moe as moe_parallel

    single, forward = _one_device_forward(cfg)
    params = jax.device_put(jax.device_get(state.params), jax.devices()[0])
    seqs = np.asarray(jax.device_get(tokens))[:, :-1]
    shards = prog.batch_shards()
    rows = len(seqs) // shards
    m = cfg.model
    N = rows * m.seq_len
    with single.activate():
        loads = np.stack([np.asarray(forward(params, seqs[d * rows : (d + 1) * rows])) for d in range(shards)])
    fullest = loads.max(-1).max(0)  # (layers,): the pmax the dropless dispatch takes
    tiers = moe_parallel.dropless_tiers(N, m.moe_experts, m.moe_topk)
    C = moe_parallel.capacity(N, m.moe_experts, m.moe_topk, m.moe_capacity_factor)
    dropped = np.maximum(loads - C, 0).sum((0, 2)) / loads.sum((0, 2))
    chunk = moe_parallel.chunk_rows(N, m.moe_experts, m.moe_topk)
    per_expert = loads.sum(0)  # (layers, E): rows each expert receives from every device
    return {
        "fullest_of_N": [int(f) for f in fullest],
        "N": N,
        "dropless_slots": [tiers[int(moe_parallel.select_tier(f, tiers))] for f in fullest],
        # dropless compute: each expert's received rows rounded up to whole chunks, over the real rows
        "expert_rows_max": [int(x) for x in per_expert.max(-1)],
        "dropless_compute_over_routed": [
            round(float(x), 3) for x in (np.ceil(per_expert / chunk) * chunk).sum(-1) / per_expert.sum(-1)
        ],
        "capacity_slots": C,
        "capacity_dropped_fraction": [round(float(x), 3) for x in dropped],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    from jaxdist import config
    from jaxdist.analysis import bench
    from jaxdist.distributed.platform import setup_platform

    setup_platform(8)
    best = {}
    for r in range(args.rounds):
        for name, (path, mesh, overrides) in RUNS.items():
            cfg = config.load(path, overrides)
            probe = functools.partial(routing, cfg) if path else None
            rec = bench.measure(cfg, mesh, args.warmup, args.steps, probe=probe)
            keys = ("tokens_per_sec", "loss", "mfu", "probe")
            print(json.dumps({"run": name, "round": r, **{k: rec[k] for k in keys if k in rec}}), flush=True)
            best[name] = max(best.get(name, 0.0), rec["tokens_per_sec"])
    dense = best["dense tiny fsdp=8"]
    print(json.dumps({name: {"tokens_per_sec": v, "ratio_to_dense": v / dense} for name, v in best.items()}))


if __name__ == "__main__":
    main()
