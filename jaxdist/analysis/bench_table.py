"""`python -m jaxdist.bench --table`: the JSON records as a table a person can read, with the note that
explains the collectives a CPU run shows."""

from __future__ import annotations

MiB = 2**20
SHORT = {
    "all-reduce": "AR",
    "all-gather": "AG",
    "reduce-scatter": "RS",
    "collective-permute": "CP",
    "all-to-all": "A2A",
}

CPU_NOTE = (
    "note: on CPU, XLA's partitioner reduces FSDP gradients with an all-reduce followed by a local "
    "slice where GPU and TPU emit a reduce-scatter, so a CPU run shows all-reduce (and twice the bytes "
    "of a reduce-scatter: a ring all-reduce is a reduce-scatter plus an all-gather) where an FSDP user "
    "expects reduce-scatter; the planner models both (tests/test_plan.py checks the 2x). Compare CPU "
    "speeds only as ratios: the simulated devices share the host's cores."
)


def collectives_text(colls: dict) -> str:
    """'AG 12x 3.1 MiB, AR 14x 2.0 MiB' (count per step, bytes sent per device per step)."""
    return (
        ", ".join(f"{SHORT.get(k, k)} {v['count']}x {v['bytes'] / MiB:.1f} MiB" for k, v in sorted(colls.items()))
        or "none"
    )


def table(records: list[dict]) -> str:
    head = (
        f"{'mesh':<24} {'dev':>3} {'tok/s':>9} {'step ms':>8} {'GFLOP/s':>8} {'MFU':>6} {'args MiB':>8} {'temp MiB':>8} "
        f"{'dp MiB':>7}  collectives per step (count, MiB sent per device)"
    )
    rows = [head, "-" * len(head)]
    for r in records:
        mem = r.get("bytes_per_device", {})
        timed = "tokens_per_sec" in r  # bench --compile-only records have no timings
        mfu = f"{r['mfu']:.1%}" if timed and r.get("mfu") is not None else "-"
        flops = f"{r['flops_per_sec'] / 1e9:>8,.1f}" if timed else f"{'-':>8}"
        tps = f"{r['tokens_per_sec']:>9,.0f}" if timed else f"{'-':>9}"
        ms = f"{r['step_time_s'] * 1e3:>8.1f}" if timed else f"{'-':>8}"
        rows.append(
            f"{r['mesh']:<24} {r['devices']:>3} {tps} {ms} {flops} "
            f"{mfu:>6} {mem.get('arguments', 0) / MiB:>8.2f} {mem.get('temp', 0) / MiB:>8.2f} "
            f"{r.get('dp_bytes_per_step', 0) / MiB:>7.2f}  {collectives_text(r.get('collectives', {}))}"
        )
    rows.append(
        "(args = parameters + optimizer state + batch per device; temp = scratch; dp MiB = bytes each "
        "device sends across dp per step; AR all-reduce, AG all-gather, RS reduce-scatter, "
        "CP collective-permute; GFLOP/s = achieved model FLOP/s, all devices; MFU only against a datasheet "
        "peak or train.peak_flops, '-' on CPU)"
    )
    if any(r.get("platform") == "cpu" for r in records):
        rows.append(CPU_NOTE)
    return "\n".join(rows)
