"""Work per train step read from the compiled program (issue 42): matmul FLOPs with loops unrolled,
their ratio to the model's 6·N·tokens + attention, collective launches and bytes by kind, temp bytes.

    python scripts/memory/step_work.py                       # llama3-8b shape, 2 layers, seq 1024, batch 8, fsdp=8
    python scripts/memory/step_work.py --layers 2 4 8 --hlo-dir /tmp/hlo
    python scripts/memory/step_work.py --config tiny --mesh fsdp=8 -- model.loss_impl=naive
    python scripts/memory/step_work.py --layers 2 4 8 --source /path/to/old/worktree --dump /tmp/d

Per device. XLA's cost_analysis counts each while body once; here every dot counts its trip counts
(jaxdist.distributed.hlo_work). Compiles at the 8B shape take minutes on a small CPU machine.

`--source DIR` compiles with the jaxdist of another checkout (e.g. a worktree of main before issue 42)
in a child process and reads its program with this checkout's parser, so both sides are read alike
(the compute-dtype bytes need this checkout's gather scopes: an old program's are its CPU bytes).
`--dump DIR` also writes the compiled HloProto and prints `peak`: the bytes XLA's heap simulator holds
at its peak and the largest buffers live there (jaxdist.planner.heap). `remat_flops`: the analytic
matmul FLOPs under full remat (jaxdist.models.flops.full_remat_flops_per_token: 6·N + the recompute's
2·N_layers less w_down + the attention's 4 passes), what a step without extra passes computes.
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


# run by `--source`'s child process with the other checkout first on its path: only APIs both sides have
CHILD = """
import json, sys
from jaxdist.distributed.platform import setup_platform
setup_platform(8)
import jax
from jaxdist import config
from jaxdist.analysis import measure
from jaxdist.distributed import mesh
name, mesh_text, out, *overrides = sys.argv[1:]
c = measure.compile_train_step(config.load(name, overrides), mesh.mesh_from_string(mesh_text, jax.devices()))
open(out, "w").write(c.as_text())
m = c.memory_analysis()
print(json.dumps({"temp": int(m.temp_size_in_bytes), "arguments": int(m.argument_size_in_bytes)}))
"""


def compile_elsewhere(source: str, name: str, mesh_text: str, overrides: list[str], hlo_path: str) -> dict:
    """Compile the step with `source`'s jaxdist in a child process: the optimized HLO goes to `hlo_path`,
    the memory figures come back."""
    import subprocess

    env = {**os.environ, "PYTHONPATH": os.path.abspath(source)}
    cmd = [sys.executable, "-c", CHILD, name, mesh_text, hlo_path, *overrides]
    done = subprocess.run(cmd, env=env, cwd=source, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"compiling in {source} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(cfg, mesh_text: str, hlo_path: str | None = None, source: str | None = None, overrides=()) -> dict:
    import jax
    import jax.numpy as jnp

    from jaxdist.analysis import measure as m
    from jaxdist.distributed import hlo, hlo_work
    from jaxdist.distributed import mesh as mesh_mod
    from jaxdist.models import flops
    from jaxdist.observe import metrics

    devices = jax.devices()
    t0 = time.perf_counter()
    if source:
        path = hlo_path or os.path.join(os.environ.get("TMPDIR", "/tmp"), f"step_work_{os.getpid()}.hlo")
        mem = compile_elsewhere(source, *overrides[:1], mesh_text, list(overrides[1:]), path)
        with open(path) as f:
            text = f.read()
    else:
        compiled = m.compile_train_step(cfg, mesh_mod.mesh_from_string(mesh_text, devices))
        text = compiled.as_text()
        mem = metrics.compiled_memory(compiled) or {}
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
    size = 4 if cfg.model.compute_dtype == "auto" else jnp.dtype(cfg.model.compute_dtype).itemsize  # auto: f32 on CPU
    weights = [c for c in hlo.per_step(hlo.collectives(text)) if c.kind == "all-gather" and _weight(c.line)]
    cpu_f32 = sum(c.sent_bytes * c.count for c in weights if "= f32[" in c.line)
    return {
        "layers": cfg.model.num_layers,
        "vocab": cfg.model.vocab_size,
        "compile_s": round(time.perf_counter() - t0, 1),
        "matmul_flops": mm,
        "model_flops": model,
        "ratio": mm / model,
        "remat_flops": flops.full_remat_flops_per_token(cfg.model) * tokens,
        "collectives": {k: {"count": int(v["count"]), "bytes": v["bytes"]} for k, v in colls.items()},
        # the compute-dtype weights' gathers at their dtype's size (float32 on XLA:CPU): computed, not measured
        "gather_bytes_gpu": colls.get("all-gather", {}).get("bytes", 0.0) - cpu_f32 * (1 - size / 4),
        "temp": mem.get("temp"),
        **({} if source else planned(cfg, mesh_text, len(devices))),  # this checkout's planner: its own program
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


def peak(folder: str, since: float, layers: int, text: str) -> dict:
    """The heap simulator's peak of the train step dumped into `folder` after `since` (the proto is kept
    as step_{layers}.hlo.pb there, every buffer live at the peak in step_{layers}.peak.json): bytes live,
    the 12 largest buffers there (defining instruction, bytes) and their bytes by kind (`kinds`)."""
    import glob

    from jaxdist.planner import heap

    (newest,) = [
        f for f in glob.glob(f"{folder}/*train_step*after_optimizations.hlo.pb") if os.path.getmtime(f) >= since
    ][-1:]
    kept = os.path.join(folder, f"step_{layers}.hlo.pb")
    os.replace(newest, kept)
    with open(kept, "rb") as f:
        top = max(heap.simulator_peaks(f.read()), key=lambda p: p.live)
    with open(os.path.join(folder, f"step_{layers}.peak.json"), "w") as f:
        json.dump({"live": top.live, "at": top.at, "buffers": top.buffers}, f)
    return {"live": top.live, "at": top.at, "kinds": kinds(top.buffers, text, layers), "buffers": top.buffers[:12]}


def kinds(buffers, text: str, layers: int) -> dict:
    """Bytes of the peak's buffers by what defines them, read from the optimized HLO: `argument copies`
    (a copy of an entry parameter: the old optimizer moments, copied at the step's start because the
    non-finite guard selects between them and the updated ones), `zero-filled` (a broadcast constant:
    the backward scan's gradient accumulators and the embedding/head gradients' initial zeros), each
    `stacked` when its leading dimension is the layer count, and `other`."""
    import re

    line = {m.group(1): m.group(0) for m in re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*$", text, re.M)}
    out: dict[str, int] = {}
    for name, size in buffers:
        text_of = line.get(name, "")
        stacked = re.search(rf"= \w+\[{layers},", text_of) is not None
        if re.search(r" copy\(%?param[.\d]*\)", text_of):
            kind = "argument copies"
        elif name.startswith("wrapped_broadcast") or re.search(r" copy\(%?wrapped_broadcast", text_of):
            kind = "zero-filled"
        else:
            kind = "other"
        key = f"{kind}, stacked" if stacked and kind != "other" else kind
        out[key] = out.get(key, 0) + size
    return dict(sorted(out.items()))


def _weight(line: str) -> bool:
    from jaxdist.parallel import loss_blocks, matmul

    return f"/{loss_blocks.HEAD_GATHER}/" in line or f"/{matmul.WEIGHT_GATHER}/" in line


def row(r: dict) -> str:
    c = r["collectives"]
    ag = c.get("all-gather", {"count": 0, "bytes": 0})
    red = [c[k] for k in ("all-reduce", "reduce-scatter") if k in c]
    rc, rb = sum(x["count"] for x in red), sum(x["bytes"] for x in red)
    planner = ""
    if "planner_gathers" in r:  # not for --source: this checkout's planner plans this checkout's program
        planner = (
            f" ({r['gather_bytes_gpu'] / 1e9:.2f} GB in the compute dtype; planner {r['planner_gathers']},"
            f" {r['planner_gather_bytes'] / 1e9:.2f} / {r['planner_gather_bytes_gpu'] / 1e9:.2f} GB)"
        )
    return (
        f"| {r['layers']} | {r['matmul_flops']:.3e} ({r['ratio']:.2f}x) | {ag['count']}, {ag['bytes'] / 1e9:.2f} GB"
        f"{planner} | {rc}, {rb / 1e9:.2f} GB | {r['temp'] / 1e9:.2f} GB | {r['remat_flops']:.3e} |"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="llama3-8b")
    p.add_argument("--mesh", default="fsdp=8")
    p.add_argument("--layers", type=int, nargs="+", default=[2])
    p.add_argument("--hlo-dir", default=None, help="write each optimized HLO here")
    p.add_argument("--json", action="store_true", help="one JSON line per measurement instead of a table")
    p.add_argument("--source", default=None, help="compile with this checkout's jaxdist (a child process)")
    p.add_argument("--dump", default=None, help="write the HloProto here and report the heap's peak buffers")
    p.add_argument("overrides", nargs="*", help="section.key=value (after the defaults above)")
    args = p.parse_args(argv)

    from jaxdist import config
    from jaxdist.distributed.platform import setup_platform

    if args.dump:
        flags = [f"--xla_dump_to={args.dump}", "--xla_dump_hlo_module_re=.*train_step.*", "--xla_dump_hlo_as_proto"]
        os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *flags]).strip()
    setup_platform(8)
    if not args.json:
        print(
            "| layers | matmul FLOPs (x model) | all-gathers (CPU bytes; weights at the compute dtype's size) | all-reduce + reduce-scatter | temp | remat=full analytic FLOPs |"
        )
        print("|---|---|---|---|---|---|")
    for n in args.layers:
        defaults = DEFAULT if args.config == "llama3-8b" else []
        overrides = [*defaults, f"model.num_layers={n}", *args.overrides]
        cfg = config.load(args.config, overrides)
        folder = args.hlo_dir or args.dump  # --dump keeps the HLO text too: peak() reads it
        path = os.path.join(folder, f"step_{n}.hlo") if folder else None
        started = time.time()
        r = measure(cfg, args.mesh, path, args.source, [args.config, *overrides])
        if args.dump:
            with open(os.path.join(folder, f"step_{n}.hlo")) as f:
                r["peak"] = peak(args.dump, started, n, f.read())
        print(json.dumps(r) if args.json else row(r), flush=True)
        if args.dump and not args.json:
            kinds_gb = ", ".join(f"{k} {v / 1e9:.3f}" for k, v in r["peak"]["kinds"].items())
            print(f"|   | peak {r['peak']['live'] / 1e9:.3f} GB at {r['peak']['at']}: {kinds_gb} GB |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
