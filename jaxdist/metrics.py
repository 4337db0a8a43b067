"""FLOPs, MFU, throughput; memory and collectives of a compiled step; metric writers.

Model FLOPs per token (PaLM appendix B convention): 6·N for the matmul parameters (the input embedding
is a lookup and does not count; the output head does) plus 12·L·T·(heads·head_dim) for attention
scores and values, forward + backward, without halving for the causal mask.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxdist import hlo
from jaxdist.config import ModelConfig
from jaxdist.models.llama import count_params
from jaxdist.planner import hardware

# device_kind substring -> the planner's hardware entry (its datasheet peak FLOP/s per device).
DEVICE_KINDS = {"h200": "h200-141gb", "h100": "h100-80gb", "a100": "a100-80gb",
                "tpu v5 lite": "tpu-v5e", "tpu v5e": "tpu-v5e", "tpu v5p": "tpu-v5p", "tpu v5": "tpu-v5p"}


def flops_per_token(cfg: ModelConfig) -> float:
    counts = count_params(cfg)
    matmul_params = counts["total"] - counts["embed"] + (counts["embed"] if cfg.tie_embeddings else 0)
    attention = 12 * cfg.num_layers * cfg.seq_len * cfg.num_heads * cfg.head_dim
    return 6.0 * matmul_params + attention


_cpu_peak: float | None = None


def cpu_matmul_peak(n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of an fp32 n×n matmul on the first device, best of a few runs (measured once per process)."""
    global _cpu_peak
    if _cpu_peak is None:
        device = jax.local_devices()[0]  # devices()[0] belongs to process 0 in a multi-process run
        a = jax.device_put(jnp.ones((n, n), jnp.float32), device)
        f = jax.jit(lambda x: x @ x)
        f(a).block_until_ready()
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            f(a).block_until_ready()
            best = min(best, time.perf_counter() - t)
        _cpu_peak = 2 * n**3 / best
    return _cpu_peak


def peak_flops_total(devices, dtype: str, override_per_device: float = 0.0) -> float:
    """Peak FLOP/s of all `devices` together. CPU 'devices' share the host's cores, so the CPU peak is
    the measured matmul rate of the whole host, however many devices are simulated."""
    if override_per_device > 0:
        return override_per_device * len(devices)
    kind = devices[0].device_kind.lower()
    if devices[0].platform == "cpu":
        return cpu_matmul_peak() * len({d.process_index for d in devices})
    for name, hardware_name in DEVICE_KINDS.items():
        if name in kind:
            return hardware.get(hardware_name).flops(dtype) * len(devices)
    return 0.0  # unknown accelerator: MFU reported as 0 rather than guessed


def compiled_stats(compiled) -> dict:
    """Per-device memory (bytes) and collectives (count, bytes sent per device) of a compiled step."""
    mem = compiled.memory_analysis()
    memory = {}
    if mem is not None:
        memory = {"arguments": int(mem.argument_size_in_bytes), "outputs": int(mem.output_size_in_bytes),
                  "temp": int(mem.temp_size_in_bytes), "aliased": int(mem.alias_size_in_bytes)}
    return {"bytes_per_device": memory, "collectives": hlo.summarize(hlo.collectives(compiled.as_text()))}


def _kept_on_resume(record: dict, resume_step: int) -> bool:
    return not record.get("summary") and record.get("step", 0) <= resume_step


def _records(path: Path) -> list[tuple[str, dict]]:
    """(line, record) of every complete line: a line cut short by a crash or a full disk is dropped."""
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append((line, record))
    return out


def _drop_partial_line(path: Path) -> None:
    """Appending after a partial last line would glue the next record onto it."""
    text = path.read_bytes()
    if text and not text.endswith(b"\n"):
        path.write_bytes(text[: text.rfind(b"\n") + 1])


class MetricWriter:
    """metrics.jsonl (every logged step) and TensorBoard events, written by process 0 only."""

    def __init__(self, run_dir: Path | None, enabled: bool = True, resume_step: int | None = None):
        """`resume_step`: a run resumed from that step drops the records logged after it by the attempt
        that was interrupted (they are about to be logged again), and that attempt's summary line."""
        self.enabled = enabled and run_dir is not None
        self.file = None
        self.tb = None
        if self.enabled:
            path = Path(run_dir) / "metrics.jsonl"
            if resume_step is not None and path.exists():
                kept = [line for line, record in _records(path) if _kept_on_resume(record, resume_step)]
                path.write_text("".join(line + "\n" for line in kept))
            elif path.exists():
                _drop_partial_line(path)
            self.file = open(path, "a")
            try:
                from tensorboardX import SummaryWriter
                self.tb = SummaryWriter(str(Path(run_dir) / "tb"))
            except ImportError:  # TensorBoard output is optional
                self.tb = None

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None and "step" in record:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.tb.add_scalar(key, value, record["step"])

    def close(self) -> None:  # idempotent: also called when a run fails
        file, tb, self.file, self.tb = self.file, self.tb, None, None
        if file:
            file.close()
        if tb:
            tb.close()
