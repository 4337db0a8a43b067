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


def mesh_devices(text: str, devices: list) -> list:
    """All devices, or the first N when the mesh names fixed sizes whose product N is smaller."""
    # deferred: jax loads on first use, not when python -m jaxdist.bench starts
    from jaxdist.distributed.mesh import AXES

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


def compile_only(cfg, mesh_text: str) -> dict:
    """bench's JSON line from the compiled program alone: abstract state and tokens, no timings."""
    # deferred: flax, grain, jax, optax load on first use, not when python -m jaxdist.bench starts
    import jax

    from jaxdist.analysis import measure
    from jaxdist.data import loader
    from jaxdist.distributed import mesh as mesh_mod
    from jaxdist.distributed import offload, sharding
    from jaxdist.models import flops
    from jaxdist.observe import metrics
    from jaxdist.parallel import pipeline
    from jaxdist.training import step

    devices = mesh_devices(mesh_text, jax.devices())
    mesh = mesh_mod.mesh_from_string(mesh_text, devices)
    t0 = time.perf_counter()
    compiled = measure.compile_train_step(cfg, mesh)
    record = {
        "mesh": mesh_mod.mesh_label(mesh_text, mesh),
        "devices": len(devices),
        "platform": devices[0].platform,
        "flops_per_token": flops.flops_per_token(cfg.model),
        "compile_s": time.perf_counter() - t0,
        **metrics.compiled_stats(compiled),
        "pipeline": pipeline.describe(pipeline.plan(cfg, mesh, sharding.make_rules(cfg.mesh.rules))),
    }
    record["dp_bytes_per_step"] = measure.dp_bytes_per_step(compiled.as_text(), mesh, cfg.reduce.axis)
    # offload's host<->device bytes per device per step, counted from the step's memory-space moves
    record["host_transfers"] = offload.host_transfers(step.build_program(cfg, mesh, eos_id=loader.mask_eos(cfg)))
    record["compression_ratio"] = measure.compression_ratio(cfg, mesh, record["dp_bytes_per_step"])
    return record


def measure(cfg, mesh_text: str, warmup: int, steps: int, probe=None) -> dict:
    """Compile and time `cfg`'s train step on one fixed random batch. `probe(prog, tokens, state) -> dict`,
    if given, looks at the state before the first step and after the last (record["probe"])."""
    # deferred: flax, grain, jax, optax load on first use, not when python -m jaxdist.bench starts
    import jax
    import jax.numpy as jnp

    from jaxdist.data import loader
    from jaxdist.distributed import mesh as mesh_mod
    from jaxdist.models import flops
    from jaxdist.observe import metrics
    from jaxdist.training import step

    devices = mesh_devices(mesh_text, jax.devices())
    mesh = mesh_mod.mesh_from_string(mesh_text, devices)
    prog = step.build_program(cfg, mesh, eos_id=loader.mask_eos(cfg))
    shape = (cfg.train.global_batch, cfg.model.seq_len + 1)
    tokens = jax.device_put(
        jax.random.randint(jax.random.key(0), shape, 0, cfg.model.vocab_size, jnp.int32), prog.batch_sharding
    )

    t0 = time.perf_counter()
    state = prog.init_state(cfg.train.seed)
    compiled = prog.train_step.lower(state, tokens).compile()
    compile_s = time.perf_counter() - t0

    first = probe(prog, tokens, state) if probe else None
    for _ in range(warmup):
        state, m = compiled(state, tokens)
    jax.block_until_ready(state)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        state, m = compiled(state, tokens)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t)

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
        **metrics.compiled_stats(compiled),
    }
    stats = devices[0].memory_stats()  # None on CPU; on GPU the allocator's high-water mark
    if stats and "peak_bytes_in_use" in stats:
        record["peak_bytes_in_use"] = int(stats["peak_bytes_in_use"])
    # Bytes each device sends across dp per optimizer step, and dense float32's over that.
    # deferred: flax, grain, jax, optax load on first use, not when python -m jaxdist.bench starts
    from jaxdist.analysis import measure
    from jaxdist.distributed import sharding
    from jaxdist.parallel import pipeline

    record["pipeline"] = pipeline.describe(
        pipeline.plan(cfg, mesh, sharding.make_rules(cfg.mesh.rules))
    )  # schedule, iterations, bubble_fraction
    # Steady state (after a dense warm-up; DiLoCo: averaged over its sync period), and the average over
    # train.steps with the warm-up included (`_run`): what a whole run saves.
    steady, run = measure.run_bytes_per_step(cfg, mesh, compiled.as_text())
    record["dp_bytes_per_step"], record["dp_bytes_per_step_run"] = steady, run
    record["compression_ratio"] = measure.compression_ratio(cfg, mesh, steady)
    record["compression_ratio_run"] = record["compression_ratio"] * steady / run if run else record["compression_ratio"]
    if probe:
        record["probe"] = {"first": first, "last": probe(prog, tokens, state)}
    return record
