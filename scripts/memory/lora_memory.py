"""What LoRA / QLoRA saves, read from the compiled train step (compile only: nothing is allocated).

    python scripts/memory/lora_memory.py                       # llama3-8b, 2 layers, fsdp=8, global batch 8
    python scripts/memory/lora_memory.py --layers 2 --seq-len 2048 --rank 16

For full fine-tuning and for LoRA with a float32, bfloat16, int8 and NF4 base: per-device argument
bytes (the train state's shards + the batch) and temp bytes (XLA's scratch for the step) from
`memory_analysis()`, the optimizer state's bytes, and the layer matrices' stored bytes per entry (embedding and head stay
bfloat16 under int8 / NF4, as QLoRA keeps them).
The model is llama3-8b's shape with fewer layers (the 8 CPU devices compile it in a minute or two).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def nbytes(tree) -> int:
    import jax
    import numpy as np

    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


def layer_matrix_bytes(params) -> tuple[int, int]:
    """(stored bytes, entries) of the layer matrices (codes and scales, or the float weights)."""
    import jax
    import numpy as np

    from jaxdist.adapters.lora import IN_DIMS, SCALE

    stored = entries = 0
    for path, a in jax.tree_util.tree_leaves_with_path(params["blocks"]):
        key = str(getattr(path[-1], "key", ""))
        if key in IN_DIMS or key.removesuffix(SCALE) in IN_DIMS and key.endswith(SCALE):
            stored += int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
        if key in IN_DIMS:
            entries += int(np.prod(a.shape)) * (2 if a.dtype == np.uint8 else 1)  # NF4: two per byte
    return stored, entries


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="llama3-8b")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--mesh", default="fsdp=8")
    p.add_argument("--rank", type=int, default=16)
    args = p.parse_args(argv)

    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp

    from jaxdist import config
    from jaxdist.adapters import tree as adapters
    from jaxdist.distributed import hlo
    from jaxdist.distributed import mesh as mesh_mod
    from jaxdist.training import step

    base = config.load(
        args.config,
        [
            f"model.num_layers={args.layers}",
            f"model.seq_len={args.seq_len}",
            f"train.global_batch={args.batch}",
            "train.eval_every=0",
        ],
    )
    mesh = mesh_mod.mesh_from_string(args.mesh)
    rows = [("full fine-tuning", dict(rank=0))]
    rows += [(f"LoRA r={args.rank}, {d} base", dict(rank=args.rank, base_dtype=d)) for d in ("float32", "bfloat16")]
    rows += [(f"QLoRA r={args.rank}, {d} base", dict(rank=args.rank, base_dtype=d)) for d in ("int8", "nf4")]
    MB = 2**20
    print(f"{args.config} with {args.layers} layers, seq {args.seq_len}, global batch {args.batch}, mesh {args.mesh}")
    print(
        "| run | argument MiB / device | temp MiB / device | optimizer state MiB (all devices) | trained params | layer matrices: stored bytes / entry | all-gather MiB sent / device / step |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, lora in rows:
        cfg = base.replace(lora=lora)
        prog = step.build_program(cfg, mesh)
        tokens = jax.ShapeDtypeStruct((args.batch, args.seq_len + 1), jnp.int32, sharding=prog.batch_sharding)
        compiled = prog.train_step.lower(prog.abstract_state, tokens).compile()
        mem = compiled.memory_analysis()
        params = prog.abstract_state.params
        trained = adapters.trainable(params) if lora["rank"] else params
        stored, entries = layer_matrix_bytes(params)
        gathered = hlo.summarize(hlo.collectives(compiled.as_text())).get("all-gather", {}).get("bytes", 0.0)
        print(
            f"| {name} | {mem.argument_size_in_bytes / MB:,.0f} | {mem.temp_size_in_bytes / MB:,.0f} | "
            f"{nbytes(prog.abstract_state.opt_state) / MB:,.1f} | {sum(a.size for a in jax.tree.leaves(trained)):,} | "
            f"{stored / entries:.3f} | {gathered / MB:,.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
