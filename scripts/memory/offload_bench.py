"""Device vs host bytes of the compiled train step with each offload, at Llama 3 8B shapes (compile only).

    nice -n 10 python scripts/memory/offload_bench.py [--seq 256] [--mesh fsdp=8]

Compiles `configs/llama3-8b.yaml` with 2 layers (global batch 8, abstract inputs: nothing is allocated)
with no offload, offload.params=host, offload.optimizer=host and offload.activations=host (with
model.remat=none instead of the config's full), and prints
bench's per-device `bytes_per_device` for each (device arguments / temp and host arguments) and its
`host_transfers` (host<->device bytes per device per step, counted from the step's moves), then
checks, two-sided within 2%, that offloading the parameters moves exactly their bytes per device from
device to host arguments. The parameter bytes do not depend on the sequence, so a short one keeps the
compiles quick; LLVM's optimisations are off (they change the machine code, not the buffers).
"""

import argparse
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"]
).strip()

KINDS = {"none": [], "params": ["offload.params=host"], "optimizer": ["offload.optimizer=host"]}
KINDS["activations"] = ["model.remat=none", "offload.activations=host"]  # the config sets remat=full


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--mesh", default="fsdp=8")
    p.add_argument("--kinds", nargs="+", default=list(KINDS))
    args = p.parse_args()
    from jaxdist import config
    from jaxdist.analysis import bench
    from jaxdist.distributed import mesh as mesh_mod
    from jaxdist.distributed.platform import setup_platform
    from jaxdist.observe import report
    from jaxdist.training import step

    setup_platform(8)
    import jax

    base = ["model.num_layers=2", f"model.seq_len={args.seq}", "train.global_batch=8"]
    rows = {}
    for kind in args.kinds:
        cfg = config.load("configs/llama3-8b.yaml", base + KINDS[kind])
        prog = step.build_program(cfg, mesh_mod.mesh_from_string(args.mesh, jax.devices()))
        param_bytes, opt_bytes = report.param_and_state_bytes(prog)
        record = bench.compile_only(cfg, args.mesh)
        b, moved = record["bytes_per_device"], record["host_transfers"]
        rows[kind] = dict(b, param_bytes=param_bytes, opt_bytes=opt_bytes, **moved)
        print(json.dumps({"offload": kind, "mesh": args.mesh, "seq": args.seq, **rows[kind]}), flush=True)
    ok = True
    if {"none", "params"} <= set(rows):
        moved = rows["none"]["arguments"] - rows["params"]["arguments"]
        want = rows["params"]["param_bytes"]
        ratio = moved / want
        host_ratio = rows["params"]["host_arguments"] / want
        ok = abs(ratio - 1) <= 0.02 and abs(host_ratio - 1) <= 0.02
        print(
            f"params offload: device arguments fall by {moved:,} B = {ratio:.4f} x the parameters' {want:,} B "
            f"per device; host arguments {host_ratio:.4f} x  -> {'OK' if ok else 'FAIL'} (within 2%)"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
