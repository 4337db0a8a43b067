"""Routing at initialisation (docs/moe.md): the fullest expert's load per layer in tiny-moe at init.

    python scripts/studies/moe_init_routing.py [--sequences 8] [--seed 0]

tiny-moe's initial parameters (train.seed 0) on random tokens, one sequence of 128 tokens at a time
(what one ep=8 device holds; top-2 of 8 experts: 32 assignments per expert is balanced), for the shipped
embedding (tiny's 0.02 table times model.embed_scale = 16) and for the plain 0.02 table (the same
table / 16). Prints, per table and layer, the fullest expert's load over the sequences (min-max, and
the worst), as one JSON line per table. tests/test_moe.py::test_tiny_moe_init_keeps_tokens_apart_for_the_router
asserts the bounds (scaled within 64 at every layer, plain above 64 above layer 0) on the same inputs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--sequences", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    import jax
    import numpy as np

    from jaxdist import config
    from jaxdist.distributed import mesh as mesh_mod
    from jaxdist.training import step

    # Capacity C = N (factor E/K) drops nothing and compiles one branch; the loads are the routing's.
    cfg = config.load("configs/tiny-moe.yaml", ["model.moe_dispatch=capacity", "model.moe_capacity_factor=4"])
    prog = step.build_program(cfg, mesh_mod.mesh_from_string("fsdp=1", devices=jax.devices()[:1]))
    params = prog.init_state(0).params
    plain = {**params, "embed_VD": params["embed_VD"] / cfg.model.embed_scale}
    rng = np.random.default_rng(args.seed)
    tokens = rng.integers(0, cfg.model.vocab_size, (args.sequences, 1, cfg.model.seq_len), dtype=np.int32)
    with prog.activate():  # one sequence per call, as in the test
        load = jax.jit(lambda p, t: prog.apply_fn(p, t)[1]["moe_load"])
        for name, table in (("scaled (shipped)", params), ("plain 0.02", plain)):
            fullest = np.array([np.asarray(load(table, t)).max(-1) for t in tokens])  # (sequences, layers)
            ranges = [f"{int(lo)}-{int(hi)}" for lo, hi in zip(fullest.min(0), fullest.max(0))]
            worst = [int(x) for x in fullest.max(0)]  # the test's statistic: per layer, over the sequences
            print(json.dumps({"embedding": name, "fullest_per_layer_min_max": ranges, "worst_per_layer": worst}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
