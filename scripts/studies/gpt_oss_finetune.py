"""Fine-tune the gpt-oss fixture imported with --restore hf: on fsdp=4,ep=2 (8 CPU devices): six AdamW
steps at lr 1e-2 on a repeating token stream, as tests/test_families.py does for the other families
(kept out of the suite: the dense experts make its compile the slowest of them). Prints the losses and
the expert-load coefficient of variation per step.

    JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/studies/gpt_oss_finetune.py
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import numpy as np

import jaxdist
from jaxdist import config
from jaxdist.hf import mapping

FIXTURE = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "hf_gpt_oss"


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tokens = tmp / "tokens.bin"
        np.tile(np.random.default_rng(0).integers(0, 128, 64), 400).astype(np.uint16).tofile(tokens)
        overrides = ["model.seq_len=16", "train.steps=6", "train.eval_every=0", "train.global_batch=8",
                     "train.log_every=1", "checkpoint.every=0", "optim.lr=1e-2", "optim.warmup_steps=0",
                     "data.source=tokens", f"data.path={tokens}", "mesh.shape=fsdp=-1,ep=2"]  # fmt: skip
        cfg = mapping.apply(config.load(None, overrides), FIXTURE)
        start = time.time()
        jaxdist.run(cfg, tmp / "run", log=lambda *a: None, restore=f"hf:{FIXTURE}")
        records = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in records if "loss" in r]
        print(f"gpt_oss fine-tuning losses {[round(r['loss'], 3) for r in steps]}")
        print(f"expert load CV {[round(r['moe_load_cv'], 3) for r in steps]}; {time.time() - start:.0f} s with compile")


if __name__ == "__main__":
    main()
