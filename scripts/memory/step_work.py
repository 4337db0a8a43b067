"""Work per train step read from the compiled program (issue 42): matmul FLOPs with loops unrolled,
their ratio to the model's 6·N·tokens + attention, collective launches and bytes by kind, temp bytes.

    python scripts/memory/step_work.py                       # llama3-8b shape, 2 layers, seq 1024, batch 8, fsdp=8
    python scripts/memory/step_work.py --layers 2 4 8 --hlo-dir /tmp/hlo
    python scripts/memory/step_work.py --config tiny --mesh fsdp=8 -- model.loss_impl=naive

Per device. XLA's cost_analysis counts each while body once; here every dot counts its trip counts
(jaxdist.distributed.hlo_work). Compiles at the 8B shape take minutes on a small CPU machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

DEFAULT = [
    "model.seq_len=1024",
    "train.global_batch=8",
    "model.compute_dtype=bfloat16",
    "model.remat=full",
]


def measure(cfg, mesh_text: str, hlo_path: str | None = None) -> dict:
    import jax
    import jax.numpy as jnp

    from jaxdist.analysis import measure as m
    from jaxdist.distributed import hlo, hlo_work
    from jaxdist.distributed import mesh as mesh_mod
    from jaxdist.models import flops
    from jaxdist.observe import metrics

    devices = jax.devices()
    mesh = mesh_mod.mesh_from_string(mesh_text, devices)
    t0 = time.perf_counter()
    compiled = m.compile_train_step(cfg, mesh)
    text = compiled.as_text()
    if hlo_path:
        with open(hlo_path, "w") as f:
            f.write(text)
    tokens = cfg.train.global_batch * cfg.model.seq_len / len(devices)
    model = flops.flops_per_token(cfg.model) * tokens
    mm = hlo_work.matmul_flops(text)
    colls = hlo.summarize(hlo.collectives(text))
    # XLA:CPU runs a bf16 all-gather in float32 (converts around a float32 gather; a bitcast to uint16 or
    # a uint32 pair is folded back into it): the weights gathered in the compute dtype (the layers'
    # weight_gather and the head's head_gather scopes) would send half these bytes on a GPU.
    size = jnp.dtype(cfg.model.compute_dtype).itemsize
    weights = [c for c in hlo.per_step(hlo.collectives(text)) if c.kind == "all-gather" and _weight(c.line)]
    cpu_f32 = sum(c.sent_bytes * c.count for c in weights if "= f32[" in c.line)
    mem = metrics.compiled_memory(compiled) or {}
    return {
        "layers": cfg.model.num_layers,
        "vocab": cfg.model.vocab_size,
        "compile_s": round(time.perf_counter() - t0, 1),
        "matmul_flops": mm,
        "model_flops": model,
        "ratio": mm / model,
        "collectives": {k: {"count": int(v["count"]), "bytes": v["bytes"]} for k, v in colls.items()},
        # the compute-dtype weights' gathers at their dtype's size (float32 on XLA:CPU): computed, not measured
        "gather_bytes_gpu": colls.get("all-gather", {}).get("bytes", 0.0) - cpu_f32 * (1 - size / 4),
        "temp": mem.get("temp"),
        **planned(cfg, mesh_text, len(devices)),
        "arguments": mem.get("arguments"),
    }


def planned(cfg, mesh_text: str, n: int) -> dict:
    """The planner's all-gather launches and bytes for this step: on CPU (to compare with the compiled
    program) and on an H100 (bf16 gathers: to compare with gather_bytes_gpu)."""
    from jaxdist.distributed.mesh import parse_mesh
    from jaxdist.planner import comms, hardware
    from jaxdist.planner.layout import Layout
    from jaxdist.planner.traffic import by_kind

    out = {}
    for name, key in (("cpu", "planner_gather_bytes"), ("h100-80gb", "planner_gather_bytes_gpu")):
        traffic = comms.step_traffic(Layout(cfg, parse_mesh(mesh_text, n), hardware.get(name)))
        out[key] = by_kind(traffic).get("all-gather", 0.0)
        out["planner_gathers"] = sum(t.count for t in traffic if t.kind == "all-gather")
    return out


def _weight(line: str) -> bool:
    from jaxdist.parallel import loss_blocks, matmul

    return f"/{loss_blocks.HEAD_GATHER}/" in line or f"/{matmul.WEIGHT_GATHER}/" in line


def row(r: dict) -> str:
    c = r["collectives"]
    ag = c.get("all-gather", {"count": 0, "bytes": 0})
    red = [c[k] for k in ("all-reduce", "reduce-scatter") if k in c]
    rc, rb = sum(x["count"] for x in red), sum(x["bytes"] for x in red)
    return (
        f"| {r['layers']} | {r['matmul_flops']:.3e} ({r['ratio']:.2f}x) | {ag['count']}, {ag['bytes'] / 1e9:.2f} GB"
        f" ({r['gather_bytes_gpu'] / 1e9:.2f} GB in the compute dtype; planner {r['planner_gathers']},"
        f" {r['planner_gather_bytes'] / 1e9:.2f} / {r['planner_gather_bytes_gpu'] / 1e9:.2f} GB)"
        f" | {rc}, {rb / 1e9:.2f} GB | {r['temp'] / 1e9:.2f} GB |"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="llama3-8b")
    p.add_argument("--mesh", default="fsdp=8")
    p.add_argument("--layers", type=int, nargs="+", default=[2])
    p.add_argument("--hlo-dir", default=None, help="write each optimized HLO here")
    p.add_argument("--json", action="store_true", help="one JSON line per measurement instead of a table")
    p.add_argument("overrides", nargs="*", help="section.key=value (after the defaults above)")
    args = p.parse_args(argv)

    from jaxdist import config
    from jaxdist.distributed.platform import setup_platform

    setup_platform(8)
    if not args.json:
        print(
            "| layers | matmul FLOPs (x model) | all-gathers (CPU bytes; weights at the compute dtype's size) | all-reduce + reduce-scatter | temp |"
        )
        print("|---|---|---|---|---|")
    for n in args.layers:
        defaults = DEFAULT if args.config == "llama3-8b" else []
        cfg = config.load(args.config, [*defaults, f"model.num_layers={n}", *args.overrides])
        path = os.path.join(args.hlo_dir, f"step_{n}.hlo") if args.hlo_dir else None
        r = measure(cfg, args.mesh, path)
        print(json.dumps(r) if args.json else row(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
