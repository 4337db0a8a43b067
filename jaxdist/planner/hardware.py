"""Accelerator table: peak FLOP/s, HBM size and bandwidth, fast (intra-node / ICI) and slow (inter-node /
DCN) link bandwidth per device.

Figures are vendor datasheet numbers (dense, no sparsity) and, for TPUs, the JAX scaling book's tables
(https://jax-ml.github.io/scaling-book/tpus/). Link bandwidths are *per device, one direction*, i.e.
what one device can push into a ring: NVLink 4 (H100/H200) is 900 GB/s bidirectional = 450 GB/s out;
an 8-GPU node with one 400 Gb/s NIC per GPU gives 50 GB/s per GPU across nodes. On a TPU torus a ring
along one axis uses both directions of one link pair (scaling book: W_ici bidirectional).

Collective latency (`latency_s` + steps x `hop_*_s`, per launch): GPUs take NCCL's own tuning model for
a ring in its small-message protocol (LL), the regime where launches rather than bytes decide
(NVIDIA/nccl src/graph/tuning.cc, `baseLat` / `hwLat`, Ring/LL: 3.6 us per collective, 0.47 us per
NVLink step, 2.7 us per network step); its large-message protocol (Simple: 8.4 + 3.4 / 9.6 us) is
slower to start but then bandwidth-bound, where this term no longer matters. TPUs: about 1 us per ICI
hop (the JAX scaling book's sharding chapter); launch and DCN step values are assumptions (5 us,
25 us), not measured. The CPU entry's figures are this machine's rough scale, for relative numbers.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from jaxdist.errors import JaxdistError

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: dict[str, float]  # dense FLOP/s per device by compute dtype
    hbm_bytes: float  # memory per device
    hbm_bandwidth: float  # bytes/s
    fast_bandwidth: float  # bytes/s per device inside a node (NVLink) or a TPU slice (ICI)
    slow_bandwidth: float  # bytes/s per device between nodes (InfiniBand / DCN)
    devices_per_node: int  # devices sharing the fast links (a GPU node; a TPU slice)
    latency_s: float  # per-collective launch cost, whatever its size (the alpha of the alpha-beta model)
    flash_attention: bool  # attention without a materialised T x T matrix (cuDNN on GPUs)
    backend: str  # "gpu" | "tpu" | "cpu": decides which collectives XLA emits
    matmul_efficiency: float = 0.7  # fraction of peak that large matmuls reach in practice
    note: str = ""
    host_bandwidth: float = 0.0  # bytes/s per device and direction to host memory (PCIe, NVLink-C2C); 0 unknown
    hop_fast_s: float = 0.0  # added per ring step on the fast links (a ring of n: n-1 steps, all-reduce 2(n-1))
    hop_slow_s: float = 0.0  # added per ring step that crosses nodes / slices (the slow network)
    # Measured attention FLOP/s per device, by the query rows one sequence has on a device: ((rows, FLOP/s),
    # ...), from plan --calibrate on a device without a fused attention, where the materialised scores,
    # not the matmul rate, set the pace; () = the attention at the matmul rate.
    attention_rates: tuple[tuple[int, float], ...] = ()

    def flops(self, dtype: str) -> float:
        return self.peak_flops.get(dtype, self.peak_flops["bfloat16"])

    def attention_rate(self, rows: int) -> float | None:
        """The measured attention rate at the measured query rows nearest `rows` (in ratio); None: none
        measured, or the device fuses its attention (then the matmul rate holds)."""
        if self.flash_attention or not self.attention_rates:
            return None
        return min(self.attention_rates, key=lambda r: (abs(math.log(r[0] / rows)), r[0]))[1]


def _gpu(name, bf16, fp32, hbm, hbm_bw, nvlink, ib, note, host=63e9, per_node=8):
    return Hardware(
        name,
        {"bfloat16": bf16, "float32": fp32},
        hbm,
        hbm_bw,
        nvlink,
        ib,
        per_node,
        3.6e-6,  # NCCL Ring/LL base latency
        True,
        "gpu",
        note=note,
        host_bandwidth=host,
        hop_fast_s=0.47e-6,  # NCCL Ring/LL, NVLink
        hop_slow_s=2.7e-6,  # NCCL Ring/LL, network
    )


HARDWARE: dict[str, Hardware] = {
    "a100-40gb": _gpu(
        "a100-40gb",
        312e12,
        19.5e12,
        40 * GiB,
        1.555e12,
        300e9,
        25e9,
        "A100 SXM 40GB, NVLink 3 (600 GB/s bidir), 8x HDR 200 Gb/s per node, PCIe Gen4 x16 to the host",
        host=31.5e9,
    ),
    "a100-80gb": _gpu(
        "a100-80gb",
        312e12,
        19.5e12,
        80 * GiB,
        2.039e12,
        300e9,
        25e9,
        "A100 SXM 80GB, NVLink 3 (600 GB/s bidir), 8x HDR 200 Gb/s per node, PCIe Gen4 x16 to the host",
        host=31.5e9,
    ),
    "h100-80gb": _gpu(
        "h100-80gb",
        989e12,
        67e12,
        80 * GiB,
        3.35e12,
        450e9,
        50e9,
        "H100 SXM 80GB, NVLink 4 (900 GB/s bidir), 8x NDR 400 Gb/s per node, PCIe Gen5 x16 to the host",
    ),
    "h200-141gb": _gpu(
        "h200-141gb",
        989e12,
        67e12,
        141e9,
        4.8e12,
        450e9,
        50e9,
        "H200 SXM 141GB, NVLink 4 (900 GB/s bidir), 8x NDR 400 Gb/s per node, PCIe Gen5 x16 to the host",
    ),
    # GH200: one H100-class GPU per Grace CPU, NVLink-C2C between them (GH200 datasheet: 96 GB HBM3 at
    # 4 TB/s or 144 GB HBM3e at 4.9 TB/s, the H100 SXM's dense peaks). Assumed node: four superchips
    # whose GPUs are linked by NVLink 4 (150 GB/s each way per GPU pair: a ring's share), one 200 Gb/s
    # NIC per superchip (HPE Cray EX254n, the quad-GH200 blade); other GH200 systems differ in both links.
    "gh200-96gb": _gpu(
        "gh200-96gb",
        989e12,
        67e12,
        96 * GiB,
        4.0e12,
        150e9,
        25e9,
        "GH200 96GB HBM3, NVLink-C2C (900 GB/s bidir) to the Grace host, 4 per node (assumed)",
        host=450e9,
        per_node=4,
    ),
    "gh200-144gb": _gpu(
        "gh200-144gb",
        989e12,
        67e12,
        144e9,
        4.9e12,
        150e9,
        25e9,
        "GH200 144GB HBM3e, NVLink-C2C (900 GB/s bidir) to the Grace host, 4 per node (assumed)",
        host=450e9,
        per_node=4,
    ),
    # TPUs: the MXU runs bf16; float32 matmuls go through several bf16 passes (we count them at the bf16
    # rate, optimistic). A ring over one torus axis: 2 x 4.5e10 (v5e) / 2 x 9e10 (v5p) bytes/s.
    "tpu-v5e": Hardware(
        "tpu-v5e",
        {"bfloat16": 197e12, "float32": 197e12},
        16 * GiB,
        8.1e11,
        9e10,
        6.25e9,
        256,
        5e-6,
        False,
        "tpu",
        note="TPU v5e, 2D torus ICI up to 256 chips, DCN beyond",
        hop_fast_s=1e-6,
        hop_slow_s=25e-6,
    ),
    "tpu-v5p": Hardware(
        "tpu-v5p",
        {"bfloat16": 459e12, "float32": 459e12},
        95 * GiB,
        2.76e12,
        1.8e11,
        6.25e9,
        8960,
        5e-6,
        False,
        "tpu",
        note="TPU v5p, 3D torus ICI up to 8960 chips, DCN beyond",
        hop_fast_s=1e-6,
        hop_slow_s=25e-6,
    ),
    # This machine class: 2 cores shared by the simulated devices (XLA fp32 matmul ~120 GFLOP/s in all),
    # "links" are memory copies. Good for relative numbers only.
    "cpu": Hardware(
        "cpu",
        {"bfloat16": 120e9, "float32": 120e9},
        23 * GiB,
        10e9,
        5e9,
        5e9,
        8,
        20e-6,
        False,
        "cpu",
        matmul_efficiency=1.0,
        note="2-core CPU host with simulated devices",
        host_bandwidth=10e9,  # "host" is the same memory: a copy
    ),
}


def parse_bytes(text: str) -> float:
    """'1.5GB', '300MB', '64kB', '123' (bytes) -> bytes (decimal units; GiB/MiB binary)."""
    units = {"gib": 2**30, "mib": 2**20, "kib": 2**10, "gb": 1e9, "mb": 1e6, "kb": 1e3, "b": 1}
    low = text.strip().lower()
    for unit, scale in units.items():
        if low.endswith(unit):
            number, factor = low[: -len(unit)], scale
            break
    else:
        number, factor = low, 1
    try:
        value = float(number) * factor
    except ValueError:
        raise JaxdistError(f"--memory-budget {text!r}: give bytes with a unit, e.g. 300MB or 2GiB") from None
    if value <= 0:
        raise JaxdistError(f"--memory-budget {text!r} must be positive")
    return value


def get(name: str) -> Hardware:
    """A table entry by name, or a measured one from a JSON file (`plan --calibrate FILE.json` writes it)."""
    if name.lower().endswith(".json"):
        return load(Path(name))
    key = name.lower()
    if key not in HARDWARE:
        raise JaxdistError(
            f"unknown hardware '{name}'; use one of {', '.join(HARDWARE)} or a FILE.json from plan --calibrate "
            "(--hardware)"
        )
    return HARDWARE[key]


def save(hw: Hardware, path: Path) -> None:
    """`hw` as JSON (its fields by name), written whole or not at all."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(dataclasses.asdict(hw), indent=1) + "\n")
        tmp.replace(path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise JaxdistError(
            f"cannot write the hardware entry {path} ({e.strerror or e}); choose a writable path"
        ) from None


def load(path: Path) -> Hardware:
    """A hardware entry written by `save`: every field present, none unknown, numbers where numbers go."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise JaxdistError(
            f"hardware file {path} does not exist; write it with python -m jaxdist.plan --calibrate {path}"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise JaxdistError(
            f"hardware file {path} is not readable JSON ({e}); write it again with plan --calibrate"
        ) from None
    fields = {f.name: f for f in dataclasses.fields(Hardware)}
    required = {n for n, f in fields.items() if f.default is dataclasses.MISSING}
    if not isinstance(doc, dict) or required - doc.keys() or doc.keys() - fields.keys():
        got = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
        raise JaxdistError(
            f"hardware file {path} is not a hardware entry (fields {got}; needs {sorted(required)}); write it again "
            "with plan --calibrate"
        )
    peak, rates = doc["peak_flops"], doc.get("attention_rates", [])
    skip = ("name", "note", "backend", "flash_attention", "peak_flops", "attention_rates")
    numbers = [v for k, v in doc.items() if k not in skip]
    if (
        not isinstance(peak, dict)
        or "bfloat16" not in peak
        or not all(isinstance(v, (int, float)) and v > 0 for v in peak.values())
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in numbers)
        or not isinstance(rates, list)
        or not all(_positive_pair(r) for r in rates)
    ):
        raise JaxdistError(
            f"hardware file {path} holds a value that is not a non-negative number (peak_flops needs a positive "
            "bfloat16 rate, attention_rates [rows, FLOP/s] pairs of positive numbers); write it again with "
            "plan --calibrate"
        )
    return Hardware(**{**doc, "attention_rates": tuple((int(r), float(v)) for r, v in rates)})


def _positive_pair(pair) -> bool:
    return (
        isinstance(pair, list)
        and len(pair) == 2
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in pair)
    )
