"""The uninterrupted run tests/test_elastic.py compares its elastic runs with, saved as a fixture.

    python scripts/cluster/elastic_reference.py      # writes tests/fixtures/elastic/reference.npz

One process x 8 simulated CPU devices (fsdp=8) trains the micro test model for the test's steps with the
test's overrides (ARGS below, which the test checks against its own: a change to either makes the test say
to run this script again). Saved: the arguments, every step's loss and the final checkpoint's parameters.
The test used to compile and run this reference itself (19-28 s of suite time under load); the saved copy
is the same program's output, compared with the mesh-change tolerance, never with `==`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fixtures" / "elastic" / "reference.npz"
STEPS = 24  # tests/test_elastic.py: room for the rejoined process to train after it joins
MODEL = dict(num_layers=1, d_model=32, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64, seq_len=16)
ARGS = ["--steps", str(STEPS), *(f"model.{k}={v}" for k, v in MODEL.items()), "train.plot=false"]
ARGS += ["train.log_every=1", "train.eval_every=0", "optim.schedule=constant", "optim.warmup_steps=2"]
ARGS += ["checkpoint.every=4", "checkpoint.async_save=false"]


def main() -> None:
    from jaxdist import checkpoint

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "8"}
    with tempfile.TemporaryDirectory() as d:
        run = Path(d) / "ref"
        cmd = [sys.executable, "-m", "jaxdist.train", "--mesh", "fsdp=8", "--run-dir", str(run), *ARGS]
        subprocess.run(cmd, env=env, cwd=ROOT, check=True, capture_output=True)
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        loss = {r["step"]: r["loss"] for r in rows if "loss" in r and not r.get("summary")}
        assert sorted(loss) == list(range(1, STEPS + 1)), sorted(loss)
        params = checkpoint.load_params(run / "checkpoints" / str(STEPS))
    leaves = {f"param{jax.tree_util.keystr(k)}": np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(params)}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    arrays = {"args": np.array(json.dumps(ARGS)), "loss": np.array([loss[s] for s in range(1, STEPS + 1)]), **leaves}
    np.savez(OUT, **arrays)
    print(f"wrote {OUT.relative_to(ROOT)}: {STEPS} losses, {len(leaves)} parameter arrays")


if __name__ == "__main__":
    main()
