"""Seconds per GB of jaxdist's integrity checks, measured on this machine:

- checkpoint checksums: `integrity.write` (process 0, before a step is published) and `integrity.verify`
  (on restore) over GB-sized files laid out like orbax's array files;
- the start-up token check: `data.check_vocab` over a memory-mapped uint16 token file.

    python scripts/bench/integrity_cost.py --gb 1          # one JSON line

Files are read from the page cache right after being written (a cold read adds the disk's own speed).
Wall-clock and CPU seconds are both given: on a shared machine the wall clock measures the neighbours.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=1.0)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary folder, removed after)")
    args = p.parse_args()
    from jaxdist.checkpoint import integrity
    from jaxdist.data import arrays as arrays_mod

    root = Path(args.dir or tempfile.mkdtemp(prefix="integrity-cost-"))
    total = int(args.gb * 2**30)
    step_dir = root / "step" / "params" / "ocdbt.process_0" / "d"
    step_dir.mkdir(parents=True)
    chunk = 64 << 20
    rng = np.random.default_rng(0)
    for i in range(0, total, chunk):
        (step_dir / f"{i // chunk:04d}").write_bytes(rng.bytes(min(chunk, total - i)))

    def timed(fn):
        wall, cpu = time.perf_counter(), time.process_time()
        out = fn()
        return out, time.perf_counter() - wall, time.process_time() - cpu

    nbytes, write_s, write_cpu = timed(lambda: integrity.write(root / "step"))
    problem, verify_s, verify_cpu = timed(lambda: integrity.verify(root / "step"))
    assert problem is None

    tokens = root / "tokens.bin"
    with open(tokens, "wb") as f:
        for i in range(0, total, chunk):
            f.write(rng.integers(0, 50000, min(chunk, total - i) // 2, dtype=np.uint16).tobytes())
    arrays = arrays_mod.read_tokens([str(tokens)], "uint16")
    _, vocab_s, vocab_cpu = timed(lambda: arrays_mod.check_vocab([str(tokens)], arrays, 50257))
    gb, token_gb = nbytes / 1e9, os.path.getsize(tokens) / 1e9
    print(
        json.dumps(
            {
                "bytes": nbytes,
                "cpus": os.cpu_count(),
                "load_average": os.getloadavg()[0],
                "checksum_write_s_per_gb": write_s / gb,
                "checksum_write_cpu_s_per_gb": write_cpu / gb,
                "checksum_verify_s_per_gb": verify_s / gb,
                "checksum_verify_cpu_s_per_gb": verify_cpu / gb,
                "token_check_s_per_gb": vocab_s / token_gb,
                "token_check_cpu_s_per_gb": vocab_cpu / token_gb,
            }
        )
    )
    if args.dir is None:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
