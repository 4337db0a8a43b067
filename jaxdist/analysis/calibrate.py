"""Measure the machine the planner predicts for (`plan --calibrate`): a hardware entry from the devices present.

What the planner's step time reads from a `Hardware` entry, measured here instead of taken from a table:

- **matmul FLOP/s per device** in float32 and bfloat16, at the config's most common matmul
  (tokens x d_model @ d_model x mlp_dim, the tokens of one device's share of the global batch), every
  device computing its share at once: on simulated CPU devices they share the host's cores, as in a run.
  Stored as the peak with `matmul_efficiency` 1 (the measured rate is what large matmuls reach).
- **a collective's launch latency and bandwidth**: all-gathers over all the devices at four sizes, fitted
  as t = latency + bytes sent per device / bandwidth (the planner's alpha-beta model, `planner/traffic.py`),
  stored as `latency_s` (the ring's hops folded in: `hop_fast_s` 0) and the fast link's bandwidth (the
  slow one too on a single host: there is no second network to measure).
- **memory bandwidth per device**: an elementwise pass (read and write) over MEMORY_BYTES per device, every
  device at once, stored as `hbm_bandwidth`: the rate of the replicated work (`planner/work.py`).
- **attention FLOP/s per device** where the base entry has no fused attention (CPU): the model's causal
  attention, forward and backward, at each query length a sequence can have on a device (seq_len / c for
  the context-parallel sizes c that split it: allgather's local queries against every key), the device's
  share of the global batch, every device at once; stored as `attention_rates`. Materialised scores run
  far below the matmul rate and their speed depends on the query tile: on a 2-core machine with 8
  simulated devices, at d_model 64 and seq_len 1024, 3.0-3.3 GFLOP/s at 1024, 512 and 256 query rows and
  4.2-4.4 at 128 in three calibrations (docs/planner.md's deep-narrow sweep, which cp=8 wins), against
  16.6 GFLOP/s for the matmul.

Everything else (memory size, host link, devices per node) is the base entry's. The entry is written as
JSON (`planner.hardware.save`) and read back with `--hardware FILE.json`.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.config import Config
from jaxdist.errors import JaxdistError
from jaxdist.models import resolve
from jaxdist.planner.estimate import estimate
from jaxdist.planner.hardware import Hardware

GATHER_BYTES = (1 << 12, 1 << 15, 1 << 18, 1 << 21)  # per device before the gather: 4 KiB .. 2 MiB
MEMORY_BYTES = 1 << 24  # per device, the elementwise pass's input (16 MiB; as much again written)
MIN_SECONDS = 0.2  # each figure: repeat until this long has been timed (at least 3, at most 50 times)


@dataclasses.dataclass(frozen=True)
class Calibration:
    devices: int
    matmul_shape: tuple[int, int, int]  # (rows per device, d_model, mlp_dim)
    flops: dict[str, float]  # measured matmul FLOP/s per device by dtype
    gathers: tuple[tuple[float, float], ...]  # (bytes sent per device, median seconds) per size
    latency_s: float
    bandwidth: float  # bytes/s per device, one direction
    memory_bandwidth: float = 0.0  # bytes/s per device read and written by an elementwise pass; 0 not measured
    attention: tuple[tuple[int, float], ...] = ()  # (query rows per sequence, attention FLOP/s per device)

    def lines(self) -> list[str]:
        r, d, f = self.matmul_shape
        rates = ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in self.flops.items())
        return [
            f"matmul ({r} x {d} @ {d} x {f} per device, {self.devices} devices at once): {rates} per device",
            f"all-gather over {self.devices} devices: latency {self.latency_s * 1e6:.1f} us, "
            f"bandwidth {self.bandwidth / 1e9:.2f} GB/s per device (fitted to "
            + ", ".join(f"{b / 2**10:.0f} KiB in {t * 1e3:.2f} ms" for b, t in self.gathers)
            + ")",
            f"elementwise pass over {MEMORY_BYTES / 2**20:.0f} MiB per device, {self.devices} devices at once: "
            f"{self.memory_bandwidth / 1e9:.2f} GB/s per device read and written",
        ] + (
            [
                "attention (forward and backward, materialised scores) by query rows per sequence: "
                + ", ".join(f"{rows}: {rate / 1e9:.2f} GFLOP/s" for rows, rate in self.attention)
                + " per device"
            ]
            if self.attention
            else []
        )


def median_seconds(fn: Callable[[], object]) -> float:
    """Median wall seconds of `fn()` (its result waited for), after one untimed call."""
    jax.block_until_ready(fn())
    times: list[float] = []
    while len(times) < 3 or (sum(times) < MIN_SECONDS and len(times) < 50):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def fit_alpha_beta(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of the line t = latency + bytes / bandwidth through (bytes, seconds)
    points, least squares in relative error (each point weighted 1/t, so the small sizes that decide the
    latency count as much as the large ones); a negative intercept (noise) is clamped to 0."""
    if len(points) < 2 or len({b for b, _ in points}) < 2:
        raise JaxdistError("calibration needs timings at two or more sizes to fit latency and bandwidth")
    sent, secs = np.array(points, dtype=np.float64).T
    slope, intercept = np.polyfit(sent, secs, 1, w=1 / secs)
    if slope <= 0:
        raise JaxdistError(
            "calibration: the all-gather times do not grow with their size (a machine too loaded to measure); "
            "run plan --calibrate again on a quieter machine"
        )
    return max(float(intercept), 0.0), float(1.0 / slope)


def measure(cfg: Config, devices: list, attention: bool = True) -> Calibration:
    """The module docstring's figures for `cfg` on `devices`; `attention`: measure the attention rates too
    (for a base entry without a fused attention)."""
    n = len(devices)
    mesh = jax.sharding.Mesh(np.array(devices), ("x",))
    rows = max(64, cfg.train.global_batch * cfg.model.seq_len // n)
    d, f = cfg.model.d_model, cfg.model.mlp_dim
    split, whole = NamedSharding(mesh, P("x", None)), NamedSharding(mesh, P())
    flops = {}
    for dtype in ("float32", "bfloat16"):
        x = jax.device_put(jnp.ones((n * rows, d), dtype), split)
        w = jax.device_put(jnp.ones((d, f), dtype), whole)
        mm = jax.jit(lambda a, b: a @ b, out_shardings=split)
        flops[dtype] = 2 * rows * d * f / median_seconds(lambda: mm(x, w))  # noqa: B023 (timed here)
    gathers = []
    for size in GATHER_BYTES:
        a = jax.device_put(jnp.ones((n, size // 4), jnp.float32), split)
        gather = jax.jit(lambda v: v, out_shardings=whole)
        gathers.append(((n - 1) * size, median_seconds(lambda: gather(a))))  # noqa: B023 (timed here)
    latency, bandwidth = fit_alpha_beta(gathers) if n > 1 else (0.0, float("inf"))
    big = jax.device_put(jnp.ones((n, MEMORY_BYTES // 4), jnp.float32), split)
    scale = jax.jit(lambda v: v * 1.5 + 1.0, out_shardings=split)
    memory_bw = 2 * MEMORY_BYTES / median_seconds(lambda: scale(big))
    rates = attention_rates(cfg, mesh) if attention else ()
    return Calibration(n, (rows, d, f), flops, tuple(gathers), latency, bandwidth, memory_bw, rates)


def query_rows(cfg: Config, devices: int) -> list[int]:
    """The query rows a sequence can have on a device: seq_len / c for every power of two c <= devices that
    the context-parallel layout takes (seq_len a multiple of 2 c; jaxdist.parallel.context)."""
    t, out, c = cfg.model.seq_len, [], 1
    while c <= devices and (c == 1 or t % (2 * c) == 0):
        out.append(t // c)
        c *= 2
    return out


def attention_rates(cfg: Config, mesh: jax.sharding.Mesh) -> tuple[tuple[int, float], ...]:
    """Attention FLOP/s per device (PaLM's 12·queries·keys·heads·head_dim, forward and backward, the causal
    mask not halved: the convention of jaxdist.models.flops) at each of query_rows, every device computing
    its share of the global batch's tokens at once, as allgather context parallelism runs it."""
    n, m = mesh.devices.size, cfg.model
    _, heads, kv_heads, head_dim, _, _, _ = m.decoder_dims
    t, dtype = m.seq_len, resolve.compute_dtype(m, mesh.devices.flat[0].platform)
    tokens = max(1, cfg.train.global_batch * t // n)  # per device
    split = NamedSharding(mesh, P("x"))

    def loss(q, k, v):
        pos_q = jnp.arange(q.shape[1]) + (t - q.shape[1])  # the last rows: every key before them unmasked
        mask = pos_q[:, None] >= jnp.arange(t)[None, :]
        return jax.nn.dot_product_attention(q, k, v, mask=mask[None, None]).astype(jnp.float32).sum()

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), out_shardings=split)
    out = []
    for rows in query_rows(cfg, n):
        b = max(1, tokens // rows)  # sequences per device
        q = jax.device_put(jnp.ones((n * b, rows, heads, head_dim), dtype), split)
        kv = jax.device_put(jnp.ones((n * b, t, kv_heads, head_dim), dtype), split)
        seconds = median_seconds(lambda: grad(q, kv, kv))  # noqa: B023 (timed here)
        out.append((rows, 12 * b * rows * t * heads * head_dim / seconds))
    return tuple(out)


def entry(base: Hardware, cal: Calibration, name: str) -> Hardware:
    """`base` with the measured figures in place of its table values."""
    link: dict[str, object] = (
        {} if cal.devices == 1 else dict(fast_bandwidth=cal.bandwidth, slow_bandwidth=cal.bandwidth)
    )
    if cal.memory_bandwidth:
        link["hbm_bandwidth"] = cal.memory_bandwidth
    if cal.attention and not base.flash_attention:
        link["attention_rates"] = cal.attention
    return dataclasses.replace(
        base,
        name=name,
        peak_flops=dict(cal.flops),
        matmul_efficiency=1.0,
        latency_s=cal.latency_s,
        hop_fast_s=0.0,
        hop_slow_s=0.0,
        note=f"measured by plan --calibrate on {cal.devices} {base.backend} devices (base entry {base.name})",
        **link,
    )


def rank_correlation(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation of two equally long lists (ties take their mean rank); nan under 2."""
    if len(xs) < 2:
        return float("nan")

    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = np.array(ranks(xs)), np.array(ranks(ys))
    if rx.std() == 0 or ry.std() == 0:
        return float("nan")
    return float(np.corrcoef(rx, ry)[0, 1])


@dataclasses.dataclass(frozen=True)
class Comparison:
    """The planner's step time for the measured layouts under the table's entry and the calibrated one."""

    names: list[str]
    measured: list[float]  # seconds per step
    before: list[float]  # predicted under the base entry
    after: list[float]  # predicted under the calibrated entry

    def error(self, predicted: list[float]) -> float:
        """Median |predicted / measured - 1|."""
        return statistics.median(abs(p / m - 1) for p, m in zip(predicted, self.measured))

    def correlation(self, predicted: list[float]) -> float:
        return rank_correlation(predicted, self.measured)

    def lines(self, before: str, after: str) -> list[str]:
        head = f"{'layout':<44} {'measured ms':>11} {before + ' ms':>16} {after + ' ms':>16}"
        out = [head, "-" * len(head)]
        for row in zip(self.names, self.measured, self.before, self.after):
            out.append(f"{row[0]:<44} " + " ".join(f"{v * 1e3:>{w}.2f}" for v, w in zip(row[1:], (11, 16, 16))))
        out.append(
            f"prediction error (median |predicted/measured - 1|): {before} {self.error(self.before):.0%}, {after} "
            f"{self.error(self.after):.0%}; rank correlation with the measured times: {before} "
            f"{self.correlation(self.before):.2f}, {after} {self.correlation(self.after):.2f}"
        )
        return out


def compare(rows: list, base: Hardware) -> Comparison:
    """`rows` (planner/search.Row, estimated under the calibrated entry) that were timed, each also
    estimated under `base`."""
    timed = [r for r in rows if r.measured_s is not None]
    if not timed:
        raise JaxdistError("no layout was timed, so there is nothing to compare; give --mesh-search-steps N > 0")
    before = [
        estimate(dataclasses.replace(r.est.layout, hw=dataclasses.replace(base, hbm_bytes=r.est.layout.hw.hbm_bytes)))
        for r in timed
    ]
    return Comparison(
        [r.name for r in timed],
        [r.measured_s for r in timed],
        [e.step_s for e in before],
        [r.est.step_s for r in timed],
    )
