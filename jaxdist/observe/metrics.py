"""Peak FLOP/s; device memory; memory and collectives of a compiled step; metric writer.

The model FLOPs per token that MFU divides are jaxdist/models/flops.py's.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import TextIO

import jax

from jaxdist.distributed import hlo, hlo_memory
from jaxdist.errors import JaxdistError
from jaxdist.planner import hardware

# device_kind substring -> the planner's hardware entry (its datasheet peak FLOP/s per device).
DEVICE_KINDS = {
    "h200": "h200-141gb",
    "h100": "h100-80gb",
    "a100": "a100-80gb",
    "tpu v5 lite": "tpu-v5e",
    "tpu v5e": "tpu-v5e",
    "tpu v5p": "tpu-v5p",
    "tpu v5": "tpu-v5p",
}


def peak_flops(devices, dtype: str, override_per_device: float = 0.0) -> tuple[float, str]:
    """(peak FLOP/s of all `devices` together, where the figure comes from).
    CPU has no datasheet peak: 0 there (achieved FLOP/s only) unless `train.peak_flops` gives one. A probed
    matmul rate used to stand in, and moved with the machine's load (~17% vs ~31% MFU for one config)."""
    n = len(devices)
    if override_per_device > 0:
        return override_per_device * n, f"train.peak_flops={override_per_device:.4g} per device"
    kind = devices[0].device_kind.lower()
    if devices[0].platform == "cpu":
        return 0.0, "CPU: no datasheet peak"
    for name, hardware_name in DEVICE_KINDS.items():
        if name in kind:
            return hardware.get(hardware_name).flops(dtype) * n, f"{hardware_name} datasheet ({dtype})"
    return 0.0, f"unknown device {devices[0].device_kind!r}: set train.peak_flops for MFU"


def device_memory(devices) -> dict | None:
    """The allocator's bytes in use / peak / limit of the most loaded local device (GPU, TPU); None on
    CPU, whose devices report no memory_stats()."""
    stats = [st for d in devices if d.process_index == jax.process_index() and (st := d.memory_stats())]
    if not stats:
        return None
    out = {}
    for key, name in (
        ("bytes_in_use", "memory_in_use"),
        ("peak_bytes_in_use", "memory_peak"),
        ("bytes_limit", "memory_limit"),
    ):
        values = [int(st[key]) for st in stats if key in st]
        if values:
            out[name] = max(values)
    return out or None


def compiled_memory(compiled) -> dict | None:
    """Per-device bytes of a compiled step, device and host memory apart: `arguments`, `outputs`,
    `temp`, `aliased` (donated buffers the outputs reuse) in device memory, `host_arguments`,
    `host_outputs`, `host_temp` in host memory (pinned_host: offloaded state), and the device `total`
    (aliased counted once). The one reader of memory_analysis(). XLA:CPU's counts a pinned_host
    parameter as a device one (its host_* stay 0), so there the entry layout's memory spaces
    (hlo_memory.entry_bytes) move those bytes to the host figures; GPUs' memory_analysis() splits them itself."""
    mem = compiled.memory_analysis()
    if mem is None:
        return None
    out = {
        "arguments": int(mem.argument_size_in_bytes),
        "outputs": int(mem.output_size_in_bytes),
        "temp": int(mem.temp_size_in_bytes),
        "aliased": int(mem.alias_size_in_bytes),
        "host_arguments": int(mem.host_argument_size_in_bytes),
        "host_outputs": int(mem.host_output_size_in_bytes),
        "host_temp": int(mem.host_temp_size_in_bytes),
    }
    if not (out["host_arguments"] or out["host_outputs"]):
        entry = hlo_memory.entry_bytes(compiled.as_text())
        for key in ("arguments", "outputs"):
            out[key] -= entry[key]["host"]
            out["host_" + key] = entry[key]["host"]
        out["aliased"] -= entry["aliased"]["host"]
    out["total"] = out["arguments"] + out["outputs"] + out["temp"] - out["aliased"]
    return out


def compiled_stats(compiled, mesh=None) -> dict:
    """Per-device memory (bytes, `compiled_memory`) and collectives (launches per step, bytes sent per
    device) by kind; given the `mesh`, also by the mesh axes each spans (`collectives_by_axis`)."""
    colls = hlo.collectives(compiled.as_text())
    out = {"bytes_per_device": compiled_memory(compiled) or {}, "collectives": hlo.summarize(colls)}
    if mesh is not None:
        shape = {a: int(n) for a, n in mesh.shape.items()}
        out["collectives_by_axis"] = hlo.by_axes(colls, shape, tuple(mesh.axis_names))
    return out


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


class OutputFailed(JaxdistError):
    """metrics.jsonl or a tracker could not be written: the run stops (with a checkpoint if there is room)."""


def reason(e: BaseException) -> str:
    """One line for an exception: the OS error's text (no space left on device, ...) when there is one."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror.lower()
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


class MetricWriter:
    """metrics.jsonl (every logged step), and the same records to the experiment trackers
    (jaxdist.observe.trackers); process 0 only."""

    def __init__(self, run_dir: Path | None, enabled: bool = True, resume_step: int | None = None, trackers=None):
        """`resume_step`: a run resumed from that step drops the records logged after it by the attempt
        that was interrupted (they are about to be logged again), and that attempt's summary line.
        `trackers`: a jaxdist.observe.trackers.Trackers (or None)."""
        self.enabled = enabled and run_dir is not None
        self.run_dir = run_dir
        self.file: TextIO | None = None
        self.trackers = trackers if self.enabled else None
        if self.enabled and run_dir is not None:
            path = Path(run_dir) / "metrics.jsonl"
            if resume_step is not None and path.exists():
                kept = [line for line, record in _records(path) if _kept_on_resume(record, resume_step)]
                path.write_text("".join(line + "\n" for line in kept))
            elif path.exists():
                _drop_partial_line(path)
            self.file = open(path, "a")  # noqa: SIM115 (kept open for the run; closed by close())

    def write(self, record: dict) -> None:
        """A failure to write (a full disk, a tracker that fails) raises OutputFailed, after which the
        writer is off: the loop stops the run in one line."""
        if not self.enabled or self.file is None:  # enabled: the file is open
            return
        what = "metrics.jsonl"
        try:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
            if self.trackers is not None:
                what = "tracker " + "/".join(self.trackers.names)
                if record.get("summary"):
                    self.trackers.finish(record)
                else:
                    self.trackers.log(record)
        except Exception as e:  # any tracker library's failure is reported as one line
            self.enabled, file, self.file, self.trackers = False, self.file, None, None
            with contextlib.suppress(OSError):
                if file is not None:
                    file.close()
            raise OutputFailed(f"{what} could not be written in {self.run_dir} ({reason(e)})") from None

    def close(self) -> None:  # idempotent: also called when a run fails
        file, trackers, self.file, self.trackers = self.file, self.trackers, None, None
        try:
            if file:
                file.close()
        finally:
            if trackers is not None:
                trackers.finish({})  # no-op once the summary has closed them
