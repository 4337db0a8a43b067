"""FP8 under remat and pipeline parallelism, against one device: loss and the worst gradient gap.

    python scripts/studies/fp8_meshes.py          # ~2 min on 2 idle cores

tests/test_fp8.py covers fsdp=8 and fsdp=4,tp=2 (no remat, no micro-batches); this adds remat=full on
fsdp=8 and pp=2,fsdp=4. Current scaling takes each activation's amax over the tokens the matmul sees, so
a run split into micro-batches quantises with per-micro-batch scales: the pipelined run (2 micro-batches)
is compared with one device at train.grad_accum_steps=2, the same split. With one undivided batch on
the one device, the gradients differ by FP8's own rounding (up to ~12% of the largest entry), not by
a bug: print both with --also-undivided.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

import jax
import numpy as np
from conftest import MICRO_MODEL, compiled_gradients, learnable_batches

from jaxdist import config
from jaxdist.distributed import mesh as mesh_mod
from jaxdist.parallel import pipeline
from jaxdist.training import step


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", default="tensorwise", choices=["tensorwise", "rowwise"])
    ap.add_argument("--also-undivided", action="store_true", help="pp=2 against one undivided batch too")
    args = ap.parse_args()
    model = dict(MICRO_MODEL, num_layers=2, num_kv_heads=2, fp8=args.mode)
    base = config.load(None, []).replace(model=model, train=dict(steps=1, global_batch=8))
    batch = learnable_batches(base, 1)[0]
    params = None

    def run(cfg, mesh_text):
        nonlocal params
        n = 1 if mesh_text == "fsdp=1" else 8
        prog = step.build_program(cfg, mesh_mod.mesh_from_string(mesh_text, jax.devices()[:n]))
        params = jax.device_get(prog.init_state(0).params) if params is None else params
        staged = pipeline.to_stages(params, prog.pipeline) if prog.pipeline else params
        grads, loss = compiled_gradients(prog)(
            jax.device_put(staged, prog.state_shardings.params), jax.device_put(batch, prog.batch_sharding)
        )
        grads = jax.device_get(grads)
        return float(loss), pipeline.from_stages(grads, prog.pipeline) if prog.pipeline else grads

    cases = [("remat=full, fsdp=8", dict(model=dict(remat="full")), "fsdp=8", 1)]
    cases.append(("pp=2,fsdp=4 (2 micro-batches)", {}, "pp=2,fsdp=4", 2))
    if args.also_undivided:
        cases.append(("pp=2,fsdp=4 vs an undivided batch", {}, "pp=2,fsdp=4", 1))
    print(f"| model.fp8={args.mode} | one device's split | loss gap | worst gradient gap (of the largest entry) |")
    print("| --- | --- | --- | --- |")
    for name, over, mesh_text, accum in cases:
        cfg = base.replace(**over)
        ref_loss, ref = run(cfg.replace(train=dict(grad_accum_steps=accum)), "fsdp=1")
        loss, grads = run(cfg, mesh_text)
        worst = max(
            float(np.abs(g - r).max() / np.abs(r).max()) for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref))
        )
        print(f"| {name} | {accum} micro-batch(es) | {abs(loss - ref_loss) / ref_loss:.1e} | {worst:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
