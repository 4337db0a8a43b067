"""Vocabulary-attributable memory at Llama 3 8B shapes, from the compiled step (compile only, 8 CPU devices).

    nice -n 10 python scripts/memory/loss_memory.py [--seq 2048] [--mesh fsdp=8] [--impl blockwise] [--vocab 128256 256]

For each (mesh, loss impl, vocab) it compiles `configs/llama3-8b.yaml` with 2 layers, float32 compute,
global batch 8 (`python -m jaxdist.bench --compile-only`, abstract inputs: nothing is allocated) and
prints one JSON line with the per-device argument / temp / output bytes; then temp(V) - temp(V=256),
the part of the working set the vocabulary costs. Slow: each compile of these shapes takes minutes here.
"""

import argparse
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--mesh", nargs="+", default=["fsdp=8"])
    p.add_argument("--impl", nargs="+", default=["blockwise"])
    p.add_argument("--vocab", type=int, nargs="+", default=[128256, 256])
    args = p.parse_args()
    from jaxdist import config
    from jaxdist.analysis import bench
    from jaxdist.distributed.platform import setup_platform

    setup_platform(8)
    for mesh in args.mesh:
        for impl in args.impl:
            temps = {}
            for vocab in args.vocab:
                cfg = config.load(
                    "configs/llama3-8b.yaml",
                    [
                        "model.num_layers=2",
                        f"model.seq_len={args.seq}",
                        "train.global_batch=8",
                        "model.compute_dtype=float32",
                        f"model.vocab_size={vocab}",
                        f"model.loss_impl={impl}",
                    ],
                )
                r = bench.compile_only(cfg, mesh)
                b = r["bytes_per_device"]
                temps[vocab] = b["temp"]
                print(
                    json.dumps(
                        {
                            "mesh": mesh,
                            "impl": impl,
                            "vocab": vocab,
                            "seq": args.seq,
                            **b,
                            "total": b["arguments"] + b["temp"] + b["outputs"] - b["aliased"],
                            "compile_s": round(r["compile_s"], 1),
                        }
                    ),
                    flush=True,
                )
            if len(temps) > 1:
                big, small = max(temps), min(temps)
                print(
                    json.dumps(
                        {
                            "mesh": mesh,
                            "impl": impl,
                            "seq": args.seq,
                            "vocab_attributable_temp": temps[big] - temps[small],
                        }
                    ),
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
