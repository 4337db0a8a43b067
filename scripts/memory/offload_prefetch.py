"""Does XLA fetch the next layer's parameters while this layer computes? (offload.params=host)

    python scripts/memory/offload_prefetch.py [--out DIR]      # on a GPU: scripts/gpu_check.sh runs it

Compiles a small model's train step with parameters in host memory twice: as jaxdist compiles it, and
with XLA:GPU's opt-in `xla_gpu_enable_pipelined_host_offloading` (off by default in XLA), whose
pipeliner moves a loop's host-to-device copy one iteration ahead: layer i+1's fetch issued during
layer i. Prints one JSON line: per variant the host<->device copies of the optimized program
(`copy-start` / `copy-done`, in while bodies and elsewhere), and whether 3 training steps give the
same losses with the flag as without (the flag changes when copies land, never what is computed).
With --out it writes both optimized programs there, to read the schedule (copy-start before the
layer's dots).

On CPU both counts are 0: XLA:CPU strips memory placements before partitioning (pass
strip-memory-placement-annotations), so this needs a GPU.
"""

import argparse
import json
import os
import re
import sys
from pathlib import Path

FLAG = "xla_gpu_enable_pipelined_host_offloading"
COMP_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")


def copies(text: str) -> dict:
    """copy-start / copy-done counts, split by whether their computation is a while body."""
    bodies = set(re.findall(r"\bbody=%?([\w.\-]+)", text))
    out = {"copy_start_in_loops": 0, "copy_start_elsewhere": 0, "copy_done": 0}
    current = None
    for line in text.splitlines():
        if m := COMP_RE.match(line):
            current = m.group(2)
        elif " copy-start(" in line:
            out["copy_start_in_loops" if current in bodies else "copy_start_elsewhere"] += 1
        elif " copy-done(" in line:
            out["copy_done"] += 1
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT"))
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args()
    from jaxdist.train import setup_platform

    setup_platform(1)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxdist import config
    from jaxdist.distributed import mesh as mesh_mod
    from jaxdist.training import step

    overrides = [f"model.num_layers={args.layers}", "offload.params=host", "model.remat=full"]
    overrides += ["train.global_batch=4", "train.grad_accum_steps=2", "train.steps=3", "optim.warmup_steps=1"]
    cfg = config.load(None, overrides)
    prog = step.build_program(cfg, mesh_mod.mesh_from_string("fsdp=1", jax.devices()[:1]))
    shape = (cfg.train.global_batch, cfg.model.seq_len + 1)
    tokens = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=prog.batch_sharding)
    batches = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (3, *shape), dtype=np.int32)
    init = jax.device_get(prog.init_state(0))
    record = {"check": "offload_prefetch", "platform": jax.devices()[0].platform, "flag": FLAG}
    losses = {}
    for name, options in (("default", None), ("pipelined", {FLAG: True})):
        compiled = prog.train_step.lower(prog.abstract_state, tokens).compile(options)
        text = compiled.as_text()
        record[name] = copies(text)
        if args.out:
            Path(args.out, f"offload_prefetch_{name}.hlo.txt").write_text(text)
        state, seen = jax.device_put(init, prog.state_shardings), []
        for b in batches:
            state, metrics = compiled(state, jax.device_put(b, prog.batch_sharding))
            seen.append(float(metrics["loss"]))
        losses[name] = seen
    record["losses"] = losses
    record["identical"] = losses["default"] == losses["pipelined"]
    print(json.dumps(record), flush=True)
    return 0 if record["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
