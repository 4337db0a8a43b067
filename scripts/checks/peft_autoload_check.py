"""A `convert to-hf --peft` export loads with peft's `AutoPeftModelForCausalLM.from_pretrained(DIR)` (the
base found through adapter_config.json's `base_model_name_or_path`), and what a QLoRA adapter means on
the float base.

    python scripts/checks/peft_autoload_check.py [--python /work/venvs/ref/bin/python] [--steps 20]

1. Two LoRA runs on the HF fixture model (tests/fixtures/hf_llama, random tokens): a float32 base and an
   NF4 base (`lora.base_dtype=nf4`), each `--restore hf:` + `train.steps`.
2. Each exported merged (`convert to-hf`) and as a PEFT adapter (`--peft`; the NF4 run needs
   `--allow-base-mismatch`, whose warning is printed).
3. In a Python with torch, transformers and peft (not suite dependencies): `AutoPeftModelForCausalLM`
   loads each adapter with nothing but its folder, and its next-token log-probs are compared with
   transformers running the merged export (which reproduces the trained model: docs/lora.md), with the
   greedy continuation of one prompt.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "tests" / "fixtures" / "hf_llama"

TORCH_SIDE = """
import sys, torch
from peft import AutoPeftModelForCausalLM
from transformers import AutoModelForCausalLM
peft_dir, merged_dir = sys.argv[1], sys.argv[2]
tokens = torch.tensor([[5, 17, 42, 8, 99, 3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]])
with torch.no_grad():
    a = AutoPeftModelForCausalLM.from_pretrained(peft_dir, dtype=torch.float32).eval()
    b = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    la, lb = (torch.log_softmax(m(tokens).logits.float(), -1) for m in (a, b))
    ga = a.generate(tokens[:, :3], max_new_tokens=8, do_sample=False)[0, 3:].tolist()
    gb = b.generate(tokens[:, :3], max_new_tokens=8, do_sample=False)[0, 3:].tolist()
print(f"base {a.peft_config['default'].base_model_name_or_path}")
print(f"max |log-prob difference| {float((la - lb).abs().max()):.3g}")
print(f"greedy peft {ga} merged {gb}")
"""


def sh(*argv, **kw):
    print("$", " ".join(map(str, argv)), flush=True)
    got = subprocess.run([str(a) for a in argv], capture_output=True, text=True, cwd=REPO, **kw)
    if got.returncode:
        sys.exit(f"failed ({got.returncode}):\n{got.stdout}\n{got.stderr}")
    return got.stdout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--python", default="/work/venvs/ref/bin/python", help="a Python with torch, transformers, peft")
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tokens = tmp / "tokens.bin"
        np.random.default_rng(0).integers(0, 128, 100_000).astype(np.uint16).tofile(tokens)
        for base_dtype in ("float32", "nf4"):
            run = tmp / f"run-{base_dtype}"
            sh(
                sys.executable, "-m", "jaxdist.train", "--restore", f"hf:{BASE}", "--run-dir", run,
                "lora.rank=8", f"lora.base_dtype={base_dtype}", "lora.block_size=8", "lora.alpha=32",
                "optim.lr=1e-2", "data.source=tokens", f"data.path={tokens}", "model.seq_len=32",
                f"train.steps={args.steps}", "train.eval_every=0", "train.trackers=[]", env=env,
            )  # fmt: skip
            sh(sys.executable, "-m", "jaxdist.convert", "to-hf", run, tmp / f"merged-{base_dtype}", env=env)
            extra = ["--allow-base-mismatch"] if base_dtype == "nf4" else []
            said = sh(sys.executable, "-m", "jaxdist.convert", "to-hf", run, tmp / f"peft-{base_dtype}", "--peft",
                      *extra, env=env)  # fmt: skip
            print("".join(line + "\n" for line in said.splitlines() if "warning" in line), end="")
            out = sh(args.python, "-c", TORCH_SIDE, tmp / f"peft-{base_dtype}", tmp / f"merged-{base_dtype}")
            print(f"[{base_dtype} base] AutoPeftModelForCausalLM(--peft export) vs transformers(merged export):")
            print("  " + out.strip().replace("\n", "\n  "))


if __name__ == "__main__":
    main()
