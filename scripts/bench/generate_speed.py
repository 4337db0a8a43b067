"""Generation throughput (docs/huggingface.md): `python -m jaxdist.generate` on `tiny`, timed by the CLI itself.

    nice -n 10 python scripts/bench/generate_speed.py [--run-dir RUN] [--new-tokens 128] [--repeats 2]

Without --run-dir it first trains `tiny` for 2 steps into a temporary run dir (throughput does not
depend on the weights). Then, for each mesh (fsdp=1 on 1 CPU device; fsdp=8 and fsdp=4,tp=2 on 8
simulated devices), it runs the CLI with 4 prompts x --new-tokens greedy tokens (--ignore-eos) and
prints one JSON line with the tokens/s the CLI reports on stderr (decoding only, compilation excluded),
--repeats times. CPU timings: noisy on a shared machine, compare as ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MESHES = [("fsdp=1", 1), ("fsdp=8", 8), ("fsdp=4,tp=2", 8)]
PROMPTS = ["def main(", "import os", "class Config:", "    return "]


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=env, capture_output=True, text=True, check=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", default=None)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = args.run_dir or str(Path(tmp) / "run")
        if args.run_dir is None:
            cli("jaxdist.train", "--run-dir", run_dir, "train.steps=2", "train.eval_every=0", "checkpoint.every=2")
        for mesh, devices in MESHES:
            for _ in range(args.repeats):
                prompts = [x for text in PROMPTS for x in ("--prompt", text)]
                out = cli(
                    "jaxdist.generate",
                    "--run-dir",
                    run_dir,
                    *prompts,
                    "--max-new-tokens",
                    str(args.new_tokens),
                    "--ignore-eos",
                    "--mesh",
                    mesh,
                    "--cpu-devices",
                    str(devices),
                )
                found = re.search(r"\(([\d,]+) tokens/s; compiled in ([\d.]+)s\)", out.stderr)
                if found is None:
                    sys.exit(f"no tokens/s line in the CLI's output:\n{out.stderr[-2000:]}")
                tps, compile_s = int(found[1].replace(",", "")), float(found[2])
                print(
                    json.dumps(
                        {
                            "mesh": mesh,
                            "devices": devices,
                            "prompts": len(PROMPTS),
                            "new_tokens": args.new_tokens,
                            "tokens_per_s": tps,
                            "compile_s": compile_s,
                        }
                    ),
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
