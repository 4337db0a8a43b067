"""The context-parallel memory table (docs: long sequences): per-device temp bytes of the compiled train step.

    nice -n 10 python scripts/memory/cp_memory.py [--seq 8192] [--cases "1 xla" "tp=2 xla" "cp=2 ring" ...]

`tiny` (4 layers, d 256, 4 heads / 2 kv heads), `model.seq_len=SEQ train.global_batch=1`, compiled
with abstract inputs (nothing allocated; `memory_analysis()` temp bytes per device) on 8 simulated CPU
devices. Each case is "MESH IMPL": MESH a mesh string ("1" = one device), IMPL `model.context_impl`
("xla" = the default, for meshes without cp). Prints one JSON line per case, then the table with each
case's ratio to the first. Compiles take ~1-3 min each at seq 8192 here.
"""

import argparse
import json
import math
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

CASES = ["1 xla", "tp=2 xla", "cp=2 ring", "cp=8 allgather", "cp=8 ring"]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--cases", nargs="+", default=CASES)
    args = p.parse_args()
    from jaxdist.distributed.platform import setup_platform

    setup_platform(8)
    import jax

    from jaxdist import config
    from jaxdist.analysis import measure
    from jaxdist.distributed import mesh as mesh_mod

    rows = []
    for case in args.cases:
        mesh_text, impl = case.split()
        mesh_text = "fsdp=1" if mesh_text == "1" else mesh_text
        n = math.prod(int(part.split("=")[1]) for part in mesh_text.split(","))
        overrides = [f"model.seq_len={args.seq}", "train.global_batch=1"]
        if impl != "xla":
            overrides.append(f"model.context_impl={impl}")
        cfg = config.load(args.config, overrides)
        mesh = mesh_mod.mesh_from_string(mesh_text, jax.devices()[:n])
        temp = measure.compile_train_step(cfg, mesh).memory_analysis().temp_size_in_bytes
        rows.append((case, temp))
        print(json.dumps({"mesh": mesh_text, "impl": impl, "seq_len": args.seq, "temp_bytes": temp}), flush=True)
    print("| mesh | impl | temp bytes / device | vs first |\n| --- | --- | --- | --- |")
    for case, temp in rows:
        mesh_text, impl = case.split()
        print(f"| {mesh_text} | {impl} | {temp / 1e9:.2f} GB | 1/{rows[0][1] / temp:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
