"""Convergence and bytes of the data-parallel reducers: train `tiny` on dp=8 under each method.

    python scripts/studies/compression_study.py --out runs/compression_study            # all methods, 300 steps
    python scripts/studies/compression_study.py --methods "topk 1%" --out runs/compression_study   # one more row

Every method trains the same steps from the same seed on the same data (the default corpus). For each
it records final train loss, eval loss (every steps/10), the dp bytes per step read from the compiled
train step — steady state (after any dense warm-up; DiLoCo: averaged over its sync period) and the
run average over train.steps (warm-up included) — and both ratios against dense float32. Results are
merged into OUT/results.json by label (so methods can run in separate processes); the table goes to
OUT/table.md and eval loss against cumulative bytes sent to OUT/pareto.png. `--scaling` adds how top-k's ratio moves with the replica count N and the kept ratio
(bytes of the reduction alone, compiled per mesh: cheap, no model).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import sys
from pathlib import Path

METHODS = {  # label -> reduce.* overrides (every other knob at its default)
    "dense": dict(method="dense"),
    "implicit": dict(method="implicit"),  # XLA's own all-reduce: dense summed in another order, the noise floor
    "int8": dict(method="int8"),
    "int8 block 64": dict(method="int8", int8=dict(block_size=64)),
    "powersgd r=4": dict(method="powersgd", powersgd=dict(rank=4)),
    "powersgd r=4 warm-up 5%": dict(method="powersgd", powersgd=dict(rank=4), warmup_fraction=0.05),
    "powersgd r=4 no warm-up": dict(method="powersgd", powersgd=dict(rank=4), warmup_fraction=0.0),
    "topk 1%": dict(method="topk", ratio=0.01),  # DGC on each replica's Adam-scaled update (reduce.topk.dgc=update)
    "topk 0.1%": dict(method="topk", ratio=0.001),
    "topk 1% dgc=gradient": dict(method="topk", ratio=0.01, topk=dict(dgc="gradient")),  # DGC's sum fed to Adam, b1=0
    "topk 0.1% dgc=gradient": dict(method="topk", ratio=0.001, topk=dict(dgc="gradient")),
    "topk 1% dgc=off": dict(method="topk", ratio=0.01, topk=dict(dgc="off")),  # plain error feedback, dense warm-up
    "topk 1% b2=0.999": dict(method="topk", ratio=0.01, optim=dict(b2=0.999)),  # Adam's memory >> 1/density
    "topk 1% warm-up from 25%": dict(method="topk", ratio=0.01, topk=dict(warmup_density=0.25)),
    "topk 0.1% dgc=off": dict(method="topk", ratio=0.001, topk=dict(dgc="off")),
    "demo 1%": dict(method="demo", ratio=0.01),
    "demo 0.1%": dict(method="demo", ratio=0.001),
    "demo 0.24%": dict(method="demo", ratio=0.0024),  # 10 of 4,096 per tile: the densest at >= 100x
    "diloco H=16": dict(method="diloco", diloco=dict(sync_every=16)),
    "diloco H=16 Nesterov 0.7/0.9": dict(method="diloco", diloco=dict(sync_every=16, outer_lr=0.7, outer_momentum=0.9)),
    "diloco H=16 b2=0.99": dict(method="diloco", diloco=dict(sync_every=16), optim=dict(b2=0.99)),
    "diloco H=16 clip 0": dict(method="diloco", diloco=dict(sync_every=16), optim=dict(clip_norm=0.0)),
    "diloco H=16 int8": dict(method="diloco", diloco=dict(sync_every=16, outer_codec="int8")),
    # Adam's second moment frozen after the warm-up (1-bit Adam); measured worse here, so off by default
    "powersgd r=4 frozen variance": dict(method="powersgd", powersgd=dict(rank=4), freeze_variance=True),
    "topk 1% frozen variance": dict(method="topk", ratio=0.01, freeze_variance=True),
    "topk 1% frozen variance floor=mean": dict(method="topk", ratio=0.01, freeze_variance=True, variance_floor=1.0),
    "topk 0.1% frozen variance floor=mean": dict(method="topk", ratio=0.001, freeze_variance=True, variance_floor=1.0),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="YAML config (default: configs/tiny.yaml)")
    p.add_argument("--mesh", default="dp=8")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--out", default="runs/compression_study")
    p.add_argument("--methods", nargs="*", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--scaling", action="store_true", help="also tabulate top-k bytes against N and ratio")
    p.add_argument("--replot", action="store_true", help="only redo table and plot from OUT/results.json")
    p.add_argument("--bytes-from", default=None, help="results.json of the same shape (another seed): reuse its bytes")
    p.add_argument("overrides", nargs="*", help="extra section.key=value overrides for every run")
    return p.parse_args(argv)


def run_method(label, base, mesh, out: Path, known=None):
    """`known`: a stored row of the same method and shape (another seed): its bytes are reused, which
    saves compiling the step twice (the bytes do not depend on the seed)."""
    import jaxdist
    from jaxdist.analysis import measure
    from jaxdist.reduce import registry

    knobs = dict(METHODS[label])  # reduce.* overrides, and optim.* ones under "optim"
    cfg = base.replace(optim=knobs.pop("optim", {}), reduce=knobs)
    steps, warm_steps = cfg.train.steps, min(registry.warmup_steps(cfg), cfg.train.steps)
    shape = bytes_shape(cfg)
    if known:
        check_same_shape(label, known, shape)
        steady, run = known["dp_bytes_per_step"], known["run_bytes_per_step"]
    else:  # steady and run average (warm-up stages each at their own bytes) from the compiled step
        steady, run = measure.run_bytes_per_step(cfg, mesh, measure.compile_train_step(cfg, mesh).as_text())
    # the warm-up's mean bytes per step (for the cumulative-bytes plot)
    warm = (run * steps - steady * (steps - warm_steps)) / warm_steps if warm_steps else steady
    run_dir = out / label.replace(" ", "_").replace("%", "pct").replace("=", "").replace("(", "").replace(")", "")
    shutil.rmtree(run_dir, ignore_errors=True)  # a rerun starts afresh (metrics.jsonl would append)
    result = jaxdist.run(cfg, run_dir, log=lambda *a, **k: None)
    if result.steps < cfg.train.steps:  # stopped early (a signal): no row rather than a wrong one
        raise SystemExit(f"{label}: stopped at step {result.steps} of {cfg.train.steps}; nothing recorded")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    curve = [(r["step"], r["loss"]) for r in records if "loss" in r and not r.get("summary")]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r and not r.get("summary")]
    return {
        "label": label,
        "final_loss": result.final_loss,
        "eval_loss": result.eval_loss,
        "dp_bytes_per_step": steady,
        "warmup_bytes_per_step": warm,
        "warmup_steps": warm_steps,
        "run_bytes_per_step": run,
        "sync_every": registry.sync_every(cfg),
        "steps": steps,
        "curve": curve,
        "evals": evals,
        "tokens_per_sec": result.tokens_per_sec,
        "shape": shape,
    }


def bytes_shape(cfg) -> dict:
    """What a row's bytes depend on: the model, the mesh, the steps (run average) and the reduce knobs."""
    import dataclasses

    return {
        "model": dataclasses.asdict(cfg.model),
        "mesh": cfg.mesh.shape,
        "steps": cfg.train.steps,
        "reduce": dataclasses.asdict(cfg.reduce),
    }


def check_same_shape(label: str, known: dict, shape: dict) -> None:
    """--bytes-from reuses a stored row's bytes only for the same model, mesh, steps and knobs."""
    stored = known.get("shape")
    if stored is None:
        raise SystemExit(f"--bytes-from: its {label!r} row does not record its shape; rerun without --bytes-from")
    for part in shape:
        if stored.get(part) != shape[part]:
            diff = part
            if isinstance(shape[part], dict):
                there = stored.get(part) or {}
                keys = [k for k in shape[part] if there.get(k) != shape[part][k]]
                diff = ", ".join(f"{part}.{k}={there.get(k)} there, {shape[part][k]} here" for k in keys)
            else:
                diff = f"{part}={stored.get(part)} there, {shape[part]} here"
            raise SystemExit(
                f"--bytes-from: its {label!r} row was measured for another setup ({diff}); rerun without --bytes-from"
            )


def cumulative_bytes(r, step):
    """Bytes sent by `step`: DiLoCo's in whole exchanges (at every H-th step and the last; the loss's few
    bytes per step are counted with them), any other method's warm-up and steady steps at their rates."""
    if r.get("sync_every", 1) > 1:
        h, steps = r["sync_every"], r["steps"]
        exchanges = step // h + (step == steps and steps % h > 0)
        return r["run_bytes_per_step"] * steps * exchanges / -(-steps // h)
    w = min(step, r["warmup_steps"])
    return w * r["warmup_bytes_per_step"] + (step - w) * r["dp_bytes_per_step"]


def topk_scaling(base, ratios=(0.1, 0.01, 0.001), replicas=(2, 4, 8)):
    """dp bytes of the reduction alone (dense vs top-k), compiled for each N on the first N devices."""
    import jax

    from jaxdist.analysis import measure
    from jaxdist.distributed import mesh as mesh_mod

    rows = []
    for n in replicas:
        mesh = mesh_mod.mesh_from_string(f"dp={n}", jax.devices()[:n])

        def bytes_of(knobs, mesh=mesh):
            return measure.dp_bytes_per_step(
                measure.compile_reduction(base.replace(reduce=knobs), mesh).as_text(), mesh
            )

        dense = bytes_of(dict(method="dense"))
        for r in ratios:
            sent = bytes_of(dict(method="topk", ratio=r))
            rows.append(
                {
                    "N": n,
                    "ratio": r,
                    "dense_bytes": dense,
                    "topk_bytes": sent,
                    "compression": dense / sent,
                    "2/(N*ratio)": 2 / (n * r),
                }
            )
    return rows


def plot(results, path: Path, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in results:
        steps, losses = zip(*r["evals"])
        sent = [max(cumulative_bytes(r, s), 1.0) for s in steps]
        ax.plot(
            sent,
            losses,
            marker="o",
            ms=3,
            label=f"{r['label']} (eval {r['eval_loss']:.3f}, {r['ratio_run']:.1f}x run avg)",
        )
    ax.set_xscale("log")
    ax.set_xlabel("cumulative bytes sent per device across dp")
    ax.set_ylabel("eval loss")
    ax.set_title(f"{title}: eval loss against bytes sent (same seed, same data)", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    args = parse_args(argv)
    from jaxdist.distributed.platform import setup_platform

    setup_platform(8)
    from jaxdist import config
    from jaxdist.distributed import mesh as mesh_mod

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    eval_every = max(args.steps // 10, 1)
    base = config.load(
        args.config,
        [
            f"train.steps={args.steps}",
            f"train.eval_every={eval_every}",
            "train.log_every=5",
            "checkpoint.every=0",
            f"mesh.shape={args.mesh}",
            *args.overrides,
        ],
    )
    mesh = mesh_mod.mesh_from_string(args.mesh)
    stored = out / "results.json"
    results = json.loads(stored.read_text()) if stored.exists() else []
    known = {r["label"]: r for r in json.loads(Path(args.bytes_from).read_text())} if args.bytes_from else {}
    for label in [] if args.replot else args.methods:
        row = run_method(label, base, mesh, out, known.get(label))
        with open(out / ".lock", "w") as lock:  # methods may run in parallel processes
            fcntl.flock(lock, fcntl.LOCK_EX)
            results = [r for r in json.loads(stored.read_text()) if r["label"] != label] if stored.exists() else []
            results.append(row)
            results.sort(key=lambda r: list(METHODS).index(r["label"]) if r["label"] in METHODS else 99)
            stored.write_text(json.dumps(results, indent=1))  # kept as each run ends
        print(f"{label}: done, final loss {row['final_loss']:.4f}", file=sys.stderr, flush=True)
    dense = next((r for r in results if r["label"] == "dense"), None)
    m = base.model
    shaped = any(o.startswith("model.") for o in args.overrides)  # not the config's own shape
    title = (
        f"{args.config or 'tiny'}{' reshaped' if shaped else ''} (d_model {m.d_model}, {m.num_layers} layers, "
        f"seq {m.seq_len}), mesh {args.mesh}, "
        f"{args.steps} steps, seed {base.train.seed}"
    )
    lines = [
        f"{title}; steady = after the dense "
        "warm-up (DiLoCo: averaged over a sync period), run = averaged over all steps, warm-up included",
        "| method | final train loss | eval loss | eval vs dense | dense warm-up steps | dp bytes/step steady "
        "| dp bytes/step run | ratio steady | ratio run |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        r["ratio"] = dense["dp_bytes_per_step"] / r["dp_bytes_per_step"] if dense else float("nan")
        r["ratio_run"] = dense["dp_bytes_per_step"] / r["run_bytes_per_step"] if dense else float("nan")
        rel = f"{(r['eval_loss'] / dense['eval_loss'] - 1) * 100:+.2f}%" if dense else "-"
        lines.append(
            f"| {r['label']} | {r['final_loss']:.4f} | {r['eval_loss']:.4f} | {rel} | {r['warmup_steps']} | "
            f"{r['dp_bytes_per_step']:,.0f} | {r['run_bytes_per_step']:,.0f} | {r['ratio']:.1f}x | "
            f"{r['ratio_run']:.1f}x |"
        )
    floor = next((r for r in results if r["label"] == "implicit"), None)
    if dense and floor:
        lines += [
            "",
            f"noise floor: implicit, the same dense step summed in XLA's order, ends "
            f"{(floor['eval_loss'] / dense['eval_loss'] - 1) * 100:+.2f}% from dense; on one seed a gap of "
            "that size does not tell a method from dense",
        ]
    if args.scaling:
        lines += [
            "",
            "top-k reduction bytes against N and ratio (dense / top-k; model 2/(N*ratio))",
            "| N | ratio | dense bytes | top-k bytes | compression | 2/(N*ratio) |",
            "|---|---|---|---|---|---|",
        ]
        for s in topk_scaling(base):
            lines.append(
                f"| {s['N']} | {s['ratio']} | {s['dense_bytes']:,.0f} | {s['topk_bytes']:,.0f} | "
                f"{s['compression']:.2f}x | {s['2/(N*ratio)']:.2f} |"
            )
    table = "\n".join(lines)
    print(table)
    (out / "table.md").write_text(table + "\n")
    plot(results, out / "pareto.png", title)
    print(f"wrote {out / 'table.md'} and {out / 'pareto.png'}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.exit(main())
