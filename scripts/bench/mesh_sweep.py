"""The layout search against an exhaustive measured sweep (issue 48): for each config, every layout that
fits the planner's budget on 8 CPU devices is compiled and timed, and `--mesh auto`'s choice (the search
with `--mesh-search-steps`) is compared with the sweep's best: the search ranked by this machine's measured
figures, as `--mesh auto --mesh-search-steps N` ranks on CPU (the entry `plan --calibrate` writes, run in a
process of its own first and counted in the search's seconds; `--hardware here.json` ranks the same), and,
for comparison, by the table's `cpu` entry, as it ranked before.

    python scripts/bench/mesh_sweep.py                                  # the four configs, see CONFIGS
    python scripts/bench/mesh_sweep.py --configs tiny --rounds 3 --steps 2 --json out.jsonl

Per config: the planner's fitting layouts, one per mesh in the planner's order (the remat, accumulation
and, on pp meshes, schedule settings of one mesh are the search's own business: the one the planner ranks
first stands for its mesh; `--max-layouts N` keeps the first N where the machine's time is short, and the
output says so). Each is compiled once (compiled.memory_analysis() over the budget: dropped, as the
search does), then timed in interleaved rounds (every layout once per round: a fresh state, one untimed
step, `--steps` timed steps; its median counts, the best round's is kept), so load from other processes
hits all layouts alike. Each config runs in a process of its own, and `--group N` compiles and times N
layouts at a time (the choice timed in every group; its best round counts), freeing each group's
executables before the next: one process holding every layout's died in LLVM (`Unable to allocate
section memory`). `--mesh auto`'s two choices are timed in the same rounds (added if the sweep has them
under another remat/accumulation). Printed: the table of layouts (planner's predicted ms with the `cpu`
entry and with the entry `plan --calibrate` measures here, measured ms, tokens/s), then one line per
config: best, chosen (ranked by the measured entry; and by the cpu entry), chosen/best tokens/s, Spearman
rank correlation of each model with the measured times, the search's seconds, and the load average before
and after; `--summarize` adds each model's median prediction error.

CONFIGS: tiny (2 layers); tiny-moe (2 layers); deep-narrow (8 layers of d_model 64, seq_len 1024: cp or
pp should pay); too-big (tiny at d_model 512, under a memory budget half the replicated (dp=8) layout's
planned bytes, so no layout that replicates the weights fits). Takes about (layouts x (compile + rounds x
(steps + 2) steps)); tiny-sized layouts compile in 5-60 s each on a loaded 2-core machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA:CPU aborts the process when a collective's rendezvous waits over 40 s, which a loaded machine
# reaches (the first uncapped run died so at too-big's first timed round); bench.py raises it likewise.
if "collective_call_terminate_timeout" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_cpu_collective_call_terminate_timeout_seconds=1800"
    ).strip()

TINY_SMALL = ["model.num_layers=2"]
DEEP_NARROW = [  # on tiny.yaml (scripts/checks/cpu_cache_deadlock.py runs it too)
    "model.num_layers=8",
    "model.d_model=64",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "model.head_dim=32",
    "model.mlp_dim=256",
    "model.seq_len=1024",
]
CONFIGS = {
    "tiny": ("tiny", TINY_SMALL, None),
    "tiny-moe": ("tiny-moe", TINY_SMALL, None),
    "deep-narrow": ("tiny", DEEP_NARROW, None),
    "too-big": ("tiny", ["model.num_layers=2", "model.d_model=512", "model.mlp_dim=2048"], 0.5),
}


def one_per_mesh(ranked: list) -> list:
    """The planner's best-ranked layout of each mesh (on pp meshes, the schedule it ranks first)."""
    seen, out = set(), []
    for e in ranked:
        key = tuple(e.layout.mesh.values())
        if key not in seen:
            seen.add(key)
            out.append(e)
    return out


DENSE = ("tiny", "deep-narrow", "too-big")  # ep is one more batch axis there (config/axes.py: batch rule)


def twins(layouts: list[dict]) -> list[tuple[str, str, float]]:
    """Pairs of swept layouts of a dense model that are the same program up to the name of a batch axis
    (dp=4,fsdp=2 and fsdp=2,ep=4: ep holds no weights there), with the ratio of their measured times:
    what the machine's noise alone does to a measured step time, beside the 10% the issue asks for."""
    groups: dict[tuple, list[dict]] = {}
    for row in layouts:
        mesh, _, rest = row["layout"].partition(" ")
        sizes = dict(part.split("=") for part in mesh.split(","))
        batch = int(sizes.pop("dp", 1)) * int(sizes.pop("ep", 1))
        groups.setdefault((batch, tuple(sorted(sizes.items())), rest), []).append(row)
    out = []
    for rows in groups.values():
        if len(rows) > 1:
            fast, slow = min(rows, key=lambda r: r["measured_ms"]), max(rows, key=lambda r: r["measured_ms"])
            out.append((fast["layout"], slow["layout"], slow["measured_ms"] / fast["measured_ms"]))
    return sorted(out, key=lambda t: t[2])


def summarize(path: str) -> None:
    """The docs table's rows from a --json file, each config's prediction error, and each dense config's
    twin spread (see twins)."""
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    for r in records:
        cpu_choice = r.get("chosen_cpu_entry")
        also = f" (cpu entry: {cpu_choice.split(' ')[0]}, {r['ratio_cpu_entry']:.2f})" if cpu_choice else ""
        print(
            f"| {r['config']} | {r['swept']} | {r['best'].split(' ')[0]} ({r['best_tokens_s']:.0f}) | "
            f"{r['chosen'].split(' ')[0]} ({r['chosen_tokens_s']:.0f}) | {r['ratio']:.2f}{also} | "
            f"{r['spearman_cpu_entry']:.2f} / {r['spearman_calibrated']:.2f} "
            f"(without replicated work {r.get('spearman_without_work', float('nan')):.2f}) | {r['search_s']:.0f} "
            f"({r['search_compiled']} compiled, {r['search_timed']} timed) | {r['load_before']:.1f} -> {r['load_after']:.1f} |"
        )
    for r in records:
        rows = [x for x in r["layouts"] if x["measured_ms"]]

        def error(key, rows=rows):
            return statistics.median(abs(x[key] / x["measured_ms"] - 1) for x in rows)

        print(
            f"{r['config']}: median |predicted / measured - 1| over {len(rows)} layouts: cpu entry "
            f"{error('planned_ms'):.0%}, calibrated {error('calibrated_ms'):.0%}"
        )
    for r in records:
        if r["config"] in DENSE:
            pairs = twins(r["layouts"])
            ratios = sorted(t[2] for t in pairs)
            if not pairs:
                print(f"{r['config']}: no twin pairs among the swept layouts")
                continue
            print(
                f"{r['config']}: {len(pairs)} twin pairs, measured-time ratio median "
                f"{statistics.median(ratios):.2f}, max {ratios[-1]:.2f} ({pairs[-1][0]} vs {pairs[-1][1]})"
            )


def step_without_work(lay) -> float:
    """The planner's step seconds for `lay` as before jaxdist/planner/work.py's terms (replicated work and
    the dropless experts' padding set to 0): the rank correlation before and after them."""
    from unittest import mock

    from jaxdist.planner import work
    from jaxdist.planner.estimate import estimate

    with (
        mock.patch.object(work, "work_seconds", lambda _: 0.0),
        mock.patch.object(work, "padded_expert_flops", lambda _: 0.0),
    ):
        return estimate(lay, "search").step_s


def time_groups(rows: list, picks: tuple, args, devices, budget: float) -> dict[str, float]:
    """The best round's median step seconds of each row that fits, `args.group` rows at a time (all at
    once with 0): a group is compiled, timed in `args.rounds` interleaved rounds, then its executables
    are freed before the next group compiles; the chosen layouts (`picks`) are timed in every group."""
    import jax

    from jaxdist.analysis import bench, mesh_search

    size = args.group or len(rows)
    groups = [rows[i : i + size] for i in range(0, len(rows), size)]
    picks = [p for i, p in enumerate(picks) if all(p is not q for q in picks[:i])]
    groups = [[*g, *(p for p in picks if all(p is not r for r in g))] for g in groups]
    best: dict[str, float] = {}
    for group in groups:
        progs = {r.name: mesh_search.compile_row(r, devices, budget) for r in group}
        alive = [(r, progs[r.name]) for r in group if progs[r.name] is not None and not r.dropped]
        for _ in range(args.rounds):
            for row, (prog, compiled) in alive:
                lay_cfg = row.est.layout.cfg
                tokens = bench.random_batch(prog, lay_cfg)
                state, m = compiled(prog.init_state(lay_cfg.train.seed), tokens)
                jax.block_until_ready(m)
                t = statistics.median(bench.step_times(compiled, state, tokens, args.steps)[2])
                best[row.name] = min(best.get(row.name, float("inf")), t)
                del state, m, tokens
        # free the group's executables before the next is compiled: a process holding every mesh's
        # (tiny's 39, after three configs) died in LLVM (`Unable to allocate section memory`)
        del progs, alive
        gc.collect()
        jax.clear_caches()
    return best


def measured_entry(path: str, name: str):
    """The hardware entry `plan --calibrate` wrote to `path`, or (no path) the one it writes now for config
    `name`, in a process of its own as a user runs it (measured in the sweep's own process, the search
    after it twice hung in an XLA:CPU collective: docs/planner.md)."""
    from jaxdist.planner import hardware

    if not path:
        base, overrides, _ = CONFIGS[name]
        path = str(Path(tempfile.mkdtemp()) / "here.json")
        cmd = [sys.executable, "-m", "jaxdist.plan", "--calibrate", path, "--config", base, "--cpu-devices", "8"]
        subprocess.run([*cmd, *overrides], check=True, stdout=subprocess.DEVNULL)
    return hardware.get(path)


def run_each(names: list[str], argv: list[str]) -> int:
    """Each config in a process of its own (the same arguments, `--configs` one name): executables and
    XLA's caches die with it."""
    i = next((k for k, a in enumerate(argv) if a.startswith("--configs")), None)
    if i is not None:
        argv = argv[:i] + argv[i + (1 if "=" in argv[i] else 2) :]
    return max(subprocess.call([sys.executable, __file__, "--configs", n, *argv]) for n in names)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names from CONFIGS")
    p.add_argument("--rounds", type=int, default=3, help="interleaved timed rounds")
    p.add_argument("--steps", type=int, default=2, help="timed steps per layout per round")
    p.add_argument("--search-steps", type=int, default=2, help="--mesh-search-steps of the search compared")
    p.add_argument("--top-k", type=int, default=3, help="the search's --top-k")
    p.add_argument("--max-layouts", type=int, default=0, help="sweep only the planner's first N (0: all)")
    p.add_argument("--json", default="", help="also append the records here, one JSON object a line")
    p.add_argument("--summarize", default="", help="print the docs table from this --json file and stop")
    p.add_argument(
        "--calibrated",
        default="",
        help="the hardware entry `plan --calibrate FILE.json` wrote for this config (default: run it first)",
    )
    p.add_argument(
        "--group", type=int, default=0, help="compile and time this many layouts at a time, freed after (0: all)"
    )
    args = p.parse_args(argv)
    if args.summarize:
        summarize(args.summarize)
        return 0
    names = args.configs.split(",")
    if len(names) > 1:
        return run_each(names, list(sys.argv[1:] if argv is None else argv))

    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    # no persistent compilation cache: a multi-device CPU step loaded from it can deadlock
    # (jaxdist/distributed/platform.py), so every layout is compiled here, the search's candidates again
    from jaxdist import config
    from jaxdist.analysis import calibrate, mesh_search
    from jaxdist.distributed.mesh import AXES
    from jaxdist.planner import hardware, memory, search
    from jaxdist.planner.estimate import estimate
    from jaxdist.planner.layout import Layout

    devices = jax.devices()
    cpu = hardware.get("cpu")
    for name in args.configs.split(","):
        base, overrides, budget_fraction = CONFIGS[name]
        load0 = os.getloadavg()[0]
        cfg = config.load(base, overrides)
        hw = cpu
        if budget_fraction is not None:  # a --memory-budget under which the replicated layout does not fit
            replicated = estimate(Layout(cfg, {**{a: 1 for a in AXES}, "dp": 8}, cpu), "search")
            hw = search.with_budget(cpu, budget_fraction * replicated.memory.total)
        budget = hw.hbm_bytes * memory.USABLE_FRACTION
        # `--mesh auto` twice: with the table's cpu entry, and as the docs advise on CPU, with the entry
        # `plan --calibrate here.json` measured (`--hardware here.json`: --calibrated, else run first)
        t0 = time.perf_counter()
        cal = dataclasses.replace(measured_entry(args.calibrated, name), hbm_bytes=hw.hbm_bytes)
        calibrate_s = time.perf_counter() - t0
        auto = mesh_search.run(cfg, cal, top_k=args.top_k, steps=args.search_steps, devices=devices)
        search_s = time.perf_counter() - t0
        print(f"{name}: calibrated --mesh auto {auto.summary()}; {search_s:.0f} s in all\n  {auto.reason}", flush=True)
        t0 = time.perf_counter()
        auto_cpu = mesh_search.run(cfg, hw, top_k=args.top_k, steps=args.search_steps, devices=devices)
        search_cpu_s = time.perf_counter() - t0
        print(
            f"{name}: cpu-entry --mesh auto {auto_cpu.summary()}; {search_cpu_s:.0f} s\n  {auto_cpu.reason}", flush=True
        )

        found = one_per_mesh(search.per_mesh(auto.enumeration.fitting))
        capped = bool(args.max_layouts) and len(found) > args.max_layouts
        found = found[: args.max_layouts] if capped else found
        for picked in (auto.chosen, auto_cpu.chosen):
            if all(search.describe(e.layout) != picked.name for e in found):
                found.append(picked.est)
        # the rows carry the cpu entry's estimates (the "plan ms" column); the calibrated ones are `after`
        found = [estimate(dataclasses.replace(e.layout, hw=hw), "search") for e in found]
        rows = [search.Row(e) for e in found]
        pick_row = next(r for r in rows if r.name == auto.chosen.name)
        pick_cpu = next(r for r in rows if r.name == auto_cpu.chosen.name)
        print(f"  sweeping {len(rows)} layouts{' (capped)' if capped else ''}", flush=True)
        best = time_groups(rows, (pick_row, pick_cpu), args, devices, budget)
        for row in rows:
            row.measured_s = best.get(row.name)
        measured = [r for r in rows if r.measured_s is not None and not r.dropped]
        after = [estimate(dataclasses.replace(r.est.layout, hw=cal), "search").step_s for r in measured]
        before = [r.est.step_s for r in measured]
        without = [step_without_work(r.est.layout) for r in measured]
        times = [r.measured_s for r in measured]
        tok = cfg.train.global_batch * cfg.model.seq_len
        top = min(measured, key=lambda r: r.measured_s or 0.0)
        pick = pick_row
        head = f"  {'layout':<46} {'plan ms':>9} {'calibrated ms':>13} {'measured ms':>11} {'tokens/s':>9}"
        print(head)
        for r, a in sorted(zip(measured, after), key=lambda x: x[0].measured_s or 0.0):
            mark = (" <- auto" if r is pick else "") + (" <- auto, cpu entry" if r is pick_cpu else "")
            print(
                f"  {r.name:<46} {r.est.step_s * 1e3:>9.2f} {a * 1e3:>13.2f} {(r.measured_s or 0) * 1e3:>11.2f} "
                f"{tok / (r.measured_s or 1):>9.0f}{mark}"
            )
        for r in rows:
            if r.dropped:
                print(f"  {r.name:<46} {r.dropped}")
        record = dict(
            config=name,
            overrides=overrides,
            budget_mb=budget / 1e6,
            swept=len(measured),
            capped=capped,
            best=top.name,
            best_tokens_s=tok / (top.measured_s or 1),
            chosen=pick.name,
            chosen_tokens_s=tok / (pick.measured_s or 1),
            ratio=(top.measured_s or 0) / (pick.measured_s or 1),
            chosen_cpu_entry=pick_cpu.name,
            ratio_cpu_entry=(top.measured_s or 0) / (pick_cpu.measured_s or 1),
            spearman_cpu_entry=calibrate.rank_correlation(before, times),
            spearman_without_work=calibrate.rank_correlation(without, times),
            spearman_calibrated=calibrate.rank_correlation(after, times),
            search_s=search_s,
            calibrate_s=calibrate_s,
            search_cpu_entry_s=search_cpu_s,
            search_compiled=sum(r.compiled_bytes is not None for r in auto.rows),
            search_timed=sum(r.measured_s is not None for r in auto.rows),
            top_k=args.top_k,
            layouts=[
                dict(
                    layout=r.name,
                    planned_ms=r.est.step_s * 1e3,
                    calibrated_ms=a * 1e3,
                    measured_ms=(r.measured_s or 0) * 1e3,
                )
                for r, a in zip(measured, after)
            ],
            dropped=[dict(layout=r.name, why=r.dropped) for r in rows if r.dropped],
            load_before=load0,
            load_after=os.getloadavg()[0],
            rounds=args.rounds,
            steps=args.steps,
            search_steps=args.search_steps,
        )
        print(
            f"  {name}: best {record['best']} {record['best_tokens_s']:.0f} tok/s; chosen {record['chosen']} "
            f"{record['chosen_tokens_s']:.0f} tok/s; chosen/best {record['ratio']:.2f} (cpu entry: "
            f"{record['chosen_cpu_entry']}, {record['ratio_cpu_entry']:.2f}); Spearman cpu entry "
            f"{record['spearman_cpu_entry']:.2f} (without the replicated-work terms "
            f"{record['spearman_without_work']:.2f}), calibrated {record['spearman_calibrated']:.2f}; load "
            f"{load0:.1f} -> {record['load_after']:.1f}",
            flush=True,
        )
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
