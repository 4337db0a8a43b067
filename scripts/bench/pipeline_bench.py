"""Pipeline study: tokens/s of pp x fsdp meshes against fsdp=8 at the same global batch.

    python scripts/bench/pipeline_bench.py                      # tiny, 8 layers, global batch 32
    python scripts/bench/pipeline_bench.py --rounds 5 model.seq_len=64

For each mesh and M in {P, 2P, 4P} it compiles the train step once, then times steps in interleaved
rounds (every configuration once per round; the best step time counts), so load from other processes
on a shared machine hits all configurations alike. Printed per configuration: tokens/s, slowdown
against fsdp=8, the bubble the schedule predicts ((M+P-1)/M), collective-permute bytes per step, and
activation memory per device (compiled temp bytes, beside the prediction for the stage inputs the
pipeline keeps for backward: (V M + P - 1) micro-batches of (b, T, D) float32 per pass).

On CPU the "devices" share the host's cores, so a bubble iteration — which in this SPMD pipeline
still computes (on padding) — costs real time, and the slowdown shows the bubble's compute directly.

    python scripts/bench/pipeline_bench.py --schedules          # gpipe, circular, 1f1b, 1f1b_paired, interleaved_1f1b, zb_h1, zb_v
    python scripts/bench/pipeline_bench.py --schedules --names gpipe,1f1b,zb_h1 --micro 8   # a subset

--schedules: each schedule on pp=4,fsdp=2 at M in {4, 8, 16, 32} micro-batches of one sequence per
batch shard (the global batch grows with M, so activation memory that grows with M is the schedule's),
8 layers (V=2 for circular, interleaved_1f1b and zb_v). Per configuration: compiled temp bytes per device
of the train step, the bubble the schedule predicts (GPipe/circular: (P-1)/(V M+P-1) of their loop
iterations; the table schedules: 1 - 2 V M / the table's lock-step time with F = B = 1, i.e. idle
slots / slots on one lane; zb_h1, zb_v: 1 - the busiest stage's F + B + W / its slots) and, for the table
schedules, the same with the busiest stage's actions read off the compiled program (the lax.switch branches it
ran, counted inside them), tokens/s as a ratio to GPipe at the same M (timed in interleaved rounds in
one process; GPipe is always run), and the seconds to lower and compile the train step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (each times every configuration)")
    p.add_argument("--steps", type=int, default=2, help="timed steps per configuration per round")
    p.add_argument("--json", default="", help="also write the records here, one JSON object a line")
    p.add_argument("--schedules", action="store_true", help="compare the pipeline schedules (see above)")
    p.add_argument("--names", default="", help="--schedules: only these (comma-separated; gpipe always runs)")
    p.add_argument("--micro", default="4,8,16,32", help="--schedules: the micro-batch counts M")
    p.add_argument("overrides", nargs="*", help="section.key=value config overrides")
    args = p.parse_args(argv)
    if args.schedules:
        return schedules_study(args)

    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np

    from jaxdist import config
    from jaxdist.distributed import hlo
    from jaxdist.distributed import mesh as mesh_mod
    from jaxdist.parallel import pipeline
    from jaxdist.training import step

    cfg = config.load(None, ["model.num_layers=8", "train.global_batch=32", "train.eval_every=0", *args.overrides])
    runs = [("fsdp=8", 0, "none"), ("fsdp=8", 0, "full")]
    runs += [
        (mesh, m, "none")
        for mesh, stages in (("pp=2,fsdp=4", 2), ("pp=4,fsdp=2", 4))
        for m in (stages, 2 * stages, 4 * stages)
    ]
    B, T, D = cfg.train.global_batch, cfg.model.seq_len, cfg.model.d_model
    tokens_np = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (B, T + 1)).astype(np.int32)

    configs = []
    for mesh_text, m, remat in runs:
        c = cfg.replace(pipeline=dict(microbatches=m), model=dict(remat=remat))
        prog = step.build_program(c, mesh_mod.mesh_from_string(mesh_text))
        tokens = jax.device_put(tokens_np, prog.batch_sharding)
        t0 = time.perf_counter()
        state = prog.init_state(0)
        compiled = prog.train_step.lower(state, tokens).compile()
        info = pipeline.describe(prog.pipeline)
        colls = hlo.summarize(hlo.collectives(compiled.as_text()))
        stage_inputs = 0
        if prog.pipeline:
            pl = prog.pipeline
            micro_bytes = B // c.train.grad_accum_steps // pl.microbatches // prog.batch_shards() * T * D * 4
            stage_inputs = pl.iterations * micro_bytes * c.train.grad_accum_steps
        state, _ = compiled(state, tokens)  # warm-up
        jax.block_until_ready(state)
        configs.append(
            dict(
                name=f"{mesh_text} M={info['microbatches']}" + (" remat=full" if remat != "none" else ""),
                mesh=mesh_text,
                compiled=compiled,
                state=state,
                tokens=tokens,
                times=[],
                compile_s=time.perf_counter() - t0,
                describe=info,
                permute_bytes=colls.get("collective-permute", {}).get("bytes", 0.0),
                temp_bytes=compiled.memory_analysis().temp_size_in_bytes,
                arg_bytes=compiled.memory_analysis().argument_size_in_bytes,
                stage_input_bytes=stage_inputs,
            )
        )
        print(f"compiled {configs[-1]['name']} in {configs[-1]['compile_s']:.1f}s", file=sys.stderr, flush=True)

    for r in range(args.rounds):
        for c in configs:
            for _ in range(args.steps):
                t = time.perf_counter()
                c["state"], metrics = c["compiled"](c["state"], c["tokens"])
                jax.block_until_ready(metrics)
                c["times"].append(time.perf_counter() - t)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)

    base = min(configs[0]["times"])
    print(
        f"tiny, {cfg.model.num_layers} layers, d_model {D}, seq {T}, global batch {B} "
        f"({B * T} tokens/step), 8 CPU devices; best of {args.rounds * args.steps} steps"
    )
    print(
        f"{'config':28s} {'tok/s':>8s} {'slowdown':>8s} {'bubble':>7s} {'pred':>6s} "
        f"{'permute MB/step':>15s} {'temp MB':>8s} {'stage-in MB':>11s} {'args MB':>8s}"
    )
    records = []
    for c in configs:
        best, d = min(c["times"]), c["describe"]
        predicted = d["iterations"] / (d["microbatches"] * d["repeats"]) if d["stages"] > 1 else 1.0
        rec = {
            "config": c["name"],
            "tokens_per_sec": B * T / best,
            "step_time_s": best,
            "slowdown_vs_fsdp8": best / base,
            "predicted_slowdown": predicted,
            **d,
            "collective_permute_bytes_per_step": c["permute_bytes"],
            "temp_bytes": c["temp_bytes"],
            "stage_input_bytes": c["stage_input_bytes"],
            "argument_bytes": c["arg_bytes"],
            "compile_s": c["compile_s"],
        }
        records.append(rec)
        print(
            f"{c['name']:28s} {rec['tokens_per_sec']:8.0f} {rec['slowdown_vs_fsdp8']:8.2f} "
            f"{d['bubble_fraction']:7.3f} {predicted:6.2f} {c['permute_bytes'] / 1e6:15.2f} "
            f"{c['temp_bytes'] / 1e6:8.2f} {c['stage_input_bytes'] / 1e6:11.2f} {c['arg_bytes'] / 1e6:8.2f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            for rec in records:
                f.write(json.dumps(rec) + "\n")
    return 0


SCHEDULE_RUNS = [
    ("gpipe", 1),
    ("circular", 2),
    ("1f1b", 1),
    ("1f1b_paired", 1),
    ("interleaved_1f1b", 2),
    ("zb_h1", 1),
    ("zb_v", 2),
]
SMALL = ["model.num_layers=8", "model.d_model=128", "model.mlp_dim=512", "model.head_dim=32", "model.seq_len=64"]


def time_rounds(configs, rounds: int, steps: int) -> None:
    """Best-of timing, every configuration once per round (load on a shared machine hits all alike)."""
    import jax

    for r in range(rounds):
        for c in configs:
            for _ in range(steps):
                t = time.perf_counter()
                c["state"], metrics = c["compiled"](c["state"], c["tokens"])
                jax.block_until_ready(metrics)
                c["times"].append(time.perf_counter() - t)
        print(f"round {r + 1}/{rounds} done", file=sys.stderr, flush=True)


def schedules_study(args) -> int:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np

    from jaxdist import config
    from jaxdist.distributed import mesh as mesh_mod
    from jaxdist.parallel import schedule_registry, schedules
    from jaxdist.training import step

    base = config.load(None, [*SMALL, "train.eval_every=0", *args.overrides])
    mesh_text, shards = "pp=4,fsdp=2", 2
    T, D = base.model.seq_len, base.model.d_model
    configs = []
    names = set(args.names.split(",")) | {"gpipe"} if args.names else {n for n, _ in SCHEDULE_RUNS}
    for M in [int(m) for m in args.micro.split(",")]:
        for name, V in [(n, V) for n, V in SCHEDULE_RUNS if n in names]:
            cfg = base.replace(
                train=dict(global_batch=M * shards), pipeline=dict(schedule=name, microbatches=M, repeats=V)
            )
            prog = step.build_program(cfg, mesh_mod.mesh_from_string(mesh_text))
            B = cfg.train.global_batch
            tokens_np = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (B, T + 1)).astype(np.int32)
            tokens = jax.device_put(tokens_np, prog.batch_sharding)
            t0 = time.perf_counter()
            state = prog.init_state(0)
            compiled = prog.train_step.lower(state, tokens).compile()
            pl = prog.pipeline
            measured = None
            if schedule_registry.get(name).tabled:  # the branches each stage's lax.switch ran, from the program
                with prog.activate():
                    counts = np.asarray(jax.jit(prog.apply_fn.objective.executed)(state.params, tokens))
                # the busiest stage's executed forwards + backwards (+ weight gradients) over the table's
                # lock-step time (every action 1; one lane: its slots): stage 0 for 1F1B and zb_h1 (the last
                # stage's F slots compute nothing there), stages 1..P-1 for zb_v (stage 0's chunk 1 has no F)
                busy = counts[:, 1:].sum(axis=1).max()
                measured = float(1 - busy / schedules.lockstep_time(pl.table(), 1.0, 1.0))
            state, _ = compiled(state, tokens)  # warm-up
            jax.block_until_ready(state)
            configs.append(
                dict(
                    schedule=name,
                    M=M,
                    V=pl.repeats,
                    compiled=compiled,
                    state=state,
                    tokens=tokens,
                    times=[],
                    tokens_per_step=B * T,
                    temp_bytes=compiled.memory_analysis().temp_size_in_bytes,
                    bubble=pl.bubble_fraction,
                    bubble_measured=measured,
                    slots=pl.iterations,
                    compile_s=time.perf_counter() - t0,
                )
            )
            print(f"compiled {name} M={M} in {configs[-1]['compile_s']:.1f}s", file=sys.stderr, flush=True)
    time_rounds(configs, args.rounds, args.steps)

    micro_bytes = T * D * 4  # one sequence of (T, D) float32 activations per device
    print(
        f"{base.model.num_layers} layers, d_model {D}, seq {T}, {mesh_text}, one sequence per micro-batch per "
        f"batch shard; best of {args.rounds * args.steps} steps; activation of one micro-batch {micro_bytes / 1e3:.1f} kB"
    )
    print(
        f"{'schedule':20s} {'M':>3s} {'temp MB':>8s} {'slots':>5s} {'bubble':>7s} {'measured':>8s} {'tok/s':>8s} "
        f"{'vs gpipe':>8s} {'compile s':>9s}"
    )
    gpipe = {c["M"]: min(c["times"]) for c in configs if c["schedule"] == "gpipe"}
    records = []
    for c in configs:
        best = min(c["times"])
        rec = {k: c[k] for k in ("schedule", "M", "V", "temp_bytes", "slots", "bubble", "bubble_measured", "compile_s")}
        rec.update(tokens_per_sec=c["tokens_per_step"] / best, step_time_s=best, speed_vs_gpipe=gpipe[c["M"]] / best)
        records.append(rec)
        meas = "-" if rec["bubble_measured"] is None else f"{rec['bubble_measured']:.3f}"
        label = c["schedule"] + (f" V={c['V']}" if c["V"] > 1 else "")
        print(
            f"{label:20s} {c['M']:3d} {c['temp_bytes'] / 1e6:8.2f} "
            f"{c['slots']:5d} {c['bubble']:7.3f} {meas:>8s} {rec['tokens_per_sec']:8.0f} {rec['speed_vs_gpipe']:8.2f} "
            f"{c['compile_s']:9.1f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            for rec in records:
                f.write(json.dumps(rec) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
