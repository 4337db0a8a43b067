"""Throughput, memory and communication of the compiled train step (the work of `python -m jaxdist.bench`).

Each mesh runs warm-up steps, then timed steps (each synchronised), on synthetic tokens of the
configured shape. Memory and collectives come from the compiled program, so they are exact and
repeatable; compare speeds only as ratios measured in one run (machines are shared and noisy).
A mesh using fewer devices than exist runs on the first ones (e.g. fsdp=1 is one device).
"""

from __future__ import annotations

import math
import statistics
import time

import jax
import jax.numpy as jnp

from jaxdist.analysis import measure as measuring
from jaxdist.data import data_rules
from jaxdist.distributed import mesh as mesh_mod
from jaxdist.distributed import offload, sharding
from jaxdist.distributed.mesh import AXES
from jaxdist.models import flops
from jaxdist.observe import metrics, report
from jaxdist.parallel import pipeline
from jaxdist.planner import hardware, memory
from jaxdist.planner.layout import Layout
from jaxdist.training import step


def mesh_devices(text: str, devices: list) -> list:
    """All devices, or the first N when the mesh names fixed sizes whose product N is smaller."""

    try:
        sizes = [
            int(part.split("=")[1])
            for part in text.split(",")
            if part.strip() and "=" in part and part.split("=")[0].strip() in AXES
        ]
    except ValueError:
        return devices  # not a valid mesh: parse_mesh names the problem
    if sizes and -1 not in sizes and math.prod(sizes) < len(devices):
        return devices[: math.prod(sizes)]
    return devices


def compile_only(cfg, mesh_text: str, hardware_name: str | None = None) -> dict:
    """bench's JSON line from the compiled program alone: abstract state and tokens, no timings; with
    `hardware_name` (or on a GPU the planner knows), a verdict: does it fit that device's memory."""

    devices = mesh_devices(mesh_text, jax.devices())
    mesh = mesh_mod.mesh_from_string(mesh_text, devices)
    t0 = time.perf_counter()
    compiled = measuring.compile_train_step(cfg, mesh)
    record = {
        "mesh": mesh_mod.mesh_label(mesh_text, mesh),
        "devices": len(devices),
        "platform": devices[0].platform,
        "flops_per_token": flops.flops_per_token(cfg.model),
        "compile_s": time.perf_counter() - t0,
        **metrics.compiled_stats(compiled, mesh),
        "pipeline": pipeline.describe(pipeline.plan(cfg, mesh, sharding.make_rules(cfg.mesh.rules))),
    }
    record["dp_bytes_per_step"] = measuring.dp_bytes_per_step(compiled.as_text(), mesh, cfg.reduce.axis)
    # offload's host<->device bytes per device per step, counted from the step's memory-space moves
    record["host_transfers"] = offload.host_transfers(step.build_program(cfg, mesh, eos_id=data_rules.mask_eos(cfg)))
    record["compression_ratio"] = measuring.compression_ratio(cfg, mesh, record["dp_bytes_per_step"])
    record.update(fit(cfg, mesh, record["bytes_per_device"].get("total"), record["platform"], hardware_name))
    return record


def fit(cfg, mesh, compiled_total: int | None, platform: str, hardware_name: str | None) -> dict:
    """`verdict` ("fits" / "does not fit") against `hardware_name`'s usable memory, with the planner's and
    the compiler's per-device bytes side by side. The compiler's figure decides on the device itself;
    on another platform (a CPU compile standing in for a GPU) the planner's does, and `not_representative`
    says which parts of the CPU program a GPU's does not have."""

    if hardware_name:
        hw = hardware.get(hardware_name)
    else:
        hw = report.hardware_for(mesh.devices.flat[0])
        if hw is None or hw.backend == "cpu":
            return {}  # no budget named: the JSON line as before (memory figures, no verdict)
    planned = memory.estimate(Layout(cfg, {a: int(n) for a, n in mesh.shape.items()}, hw))
    same = platform == hw.backend
    decides = compiled_total if same and compiled_total is not None else planned.total
    out = {
        "hardware": hw.name,
        "budget_bytes": planned.capacity,
        "planner_bytes": planned.total,
        "compiled_bytes": compiled_total,
        "verdict": "fits" if decides <= planned.capacity else "does not fit",
        "verdict_from": "compiled" if same and compiled_total is not None else "planner",
    }
    if platform == "cpu" and hw.backend != "cpu":
        out["not_representative"] = cpu_differences(cfg, mesh)
    return out


def cpu_differences(cfg, mesh) -> str:
    """What a CPU-compiled step holds that the same step compiled for a GPU does not (why its temp bytes
    overstate a GPU's): attention scores materialised, bf16 arithmetic normalised to float32."""
    m, sizes = cfg.model, dict(mesh.shape)
    rows = cfg.train.global_batch // max(1, sizes["dp"] * sizes["fsdp"] * sizes["ep"] * cfg.train.grad_accum_steps)
    t = m.seq_len // max(1, sizes["cp"])
    scores = max(rows, 1) * max(m.num_heads // sizes["tp"], 1) * t * m.seq_len * 4
    parts = [
        f"attention scores materialised ({rows} x {max(m.num_heads // sizes['tp'], 1)} heads x {t} x {m.seq_len} "
        f"float32 = {size(scores)} per layer; a GPU's fused attention keeps none)"
    ]
    if m.compute_dtype == "bfloat16":
        parts.append("bfloat16 arithmetic normalised to float32 (XLA:CPU upcasts it; a GPU computes in bf16)")
    return "the CPU program is not a GPU's: " + "; ".join(parts) + "; the verdict uses the planner's figure"


def size(b: float) -> str:
    """Bytes in the unit that shows them: 292.8 GB, 41.0 MB, 12.0 kB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= scale:
            return f"{b / scale:,.1f} {unit}"
    return f"{b:.0f} B"


def verdict_line(record: dict) -> str | None:
    """One line for a person: the verdict, the planner's figure beside the compiler's, the CPU caveat."""
    if "verdict" not in record:
        return None
    gb = lambda b: "n/a" if b is None else size(b)
    line = (
        f"{record['mesh']} on {record['hardware']}: {record['verdict'].upper()} ({record['verdict_from']}'s figure "
        f"vs {gb(record['budget_bytes'])} usable); per device: planner {gb(record['planner_bytes'])}, "
        f"compiled on {record['platform']} {gb(record['compiled_bytes'])}"
    )
    return line + (f"\n  {record['not_representative']}" if "not_representative" in record else "")


def random_batch(prog, cfg):
    """One fixed random batch of token ids, placed as the train step reads it."""
    shape = (cfg.train.global_batch, cfg.model.seq_len + 1)
    return jax.device_put(
        jax.random.randint(jax.random.key(0), shape, 0, cfg.model.vocab_size, jnp.int32), prog.batch_sharding
    )


def step_times(compiled, state, tokens, steps: int):
    """(the state after, the last step's metrics, each step's seconds) of `steps` steps of `compiled`, each waited for."""
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        state, m = compiled(state, tokens)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t)
    return state, m, times


def measure(cfg, mesh_text: str, warmup: int, steps: int, probe=None) -> dict:
    """Compile and time `cfg`'s train step on one fixed random batch. `probe(prog, tokens, state) -> dict`,
    if given, looks at the state before the first step and after the last (record["probe"])."""

    devices = mesh_devices(mesh_text, jax.devices())
    mesh = mesh_mod.mesh_from_string(mesh_text, devices)
    prog = step.build_program(cfg, mesh, eos_id=data_rules.mask_eos(cfg))
    tokens = random_batch(prog, cfg)

    t0 = time.perf_counter()
    state = prog.init_state(cfg.train.seed)
    compiled = prog.train_step.lower(state, tokens).compile()
    compile_s = time.perf_counter() - t0

    first = probe(prog, tokens, state) if probe else None
    for _ in range(warmup):
        state, m = compiled(state, tokens)
    jax.block_until_ready(state)
    state, m, times = step_times(compiled, state, tokens, steps)

    step_time = statistics.median(times)
    tokens_per_step = cfg.train.global_batch * cfg.model.seq_len
    flops_tok = flops.flops_per_token(cfg.model, cfg.lora)
    # as the trainer reports it: MFU only against a datasheet peak (or train.peak_flops); on CPU, whose
    # probed matmul rate moved with the machine's load, achieved FLOP/s alone
    peak = metrics.peak_flops(devices, str(step.compute_dtype(cfg.model)), cfg.train.peak_flops)[0]
    tps = tokens_per_step / step_time
    record = {
        "mesh": mesh_mod.mesh_label(mesh_text, mesh),
        "devices": len(devices),
        "platform": devices[0].platform,
        "tokens_per_sec": tps,
        "step_time_s": step_time,
        "flops_per_sec": tps * flops_tok,
        "mfu": tps * flops_tok / peak if peak else None,
        "peak_flops": peak,
        "flops_per_token": flops_tok,
        "compile_s": compile_s,
        "loss": float(m["loss"]),
        **metrics.compiled_stats(compiled, mesh),
    }
    stats = devices[0].memory_stats()  # None on CPU; on GPU the allocator's high-water mark
    if stats and "peak_bytes_in_use" in stats:
        record["peak_bytes_in_use"] = int(stats["peak_bytes_in_use"])
    # Bytes each device sends across dp per optimizer step, and dense float32's over that.

    record["pipeline"] = pipeline.describe(
        pipeline.plan(cfg, mesh, sharding.make_rules(cfg.mesh.rules))
    )  # schedule, iterations, bubble_fraction
    # Steady state (after a dense warm-up; DiLoCo: averaged over its sync period), and the average over
    # train.steps with the warm-up included (`_run`): what a whole run saves.
    steady, run = measuring.run_bytes_per_step(cfg, mesh, compiled.as_text())
    record["dp_bytes_per_step"], record["dp_bytes_per_step_run"] = steady, run
    record["compression_ratio"] = measuring.compression_ratio(cfg, mesh, steady)
    record["compression_ratio_run"] = record["compression_ratio"] * steady / run if run else record["compression_ratio"]
    if probe:
        record["probe"] = {"first": first, "last": probe(prog, tokens, state)}
    return record
