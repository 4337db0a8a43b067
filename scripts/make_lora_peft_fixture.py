"""LoRA adapters against the real reference (peft + transformers): make `tests/fixtures/lora_peft/` and
print how closely jaxdist agrees.

    python scripts/make_lora_peft_fixture.py     # needs torch, transformers, peft (not suite dependencies)

1. peft puts a random LoRA (r=4, alpha=8, all seven projections, `init_lora_weights=False` so B != 0)
   on the HF fixture model (tests/fixtures/hf_llama) and saves it with `save_pretrained`: the fixture's
   adapter_config.json + adapter_model.safetensors, in PEFT's own format and key names. Its logits on
   the fixture's sequences are saved as reference.npz.
2. jaxdist reads that adapter onto the imported base (float32) and computes the same logits; it exports
   its adapters back to PEFT's format and the merged model (`convert to-hf` without / with --peft do
   the same); transformers loads the merged export as a plain checkpoint, and peft loads jaxdist's
   adapter export onto the original model. Every logit difference against peft's is printed.
tests/test_lora.py checks jaxdist's side against the committed fixture without torch.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]
BASE = REPO / "tests" / "fixtures" / "hf_llama"
OUT = REPO / "tests" / "fixtures" / "lora_peft"
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_reference(tokens):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM.from_pretrained(BASE, dtype=torch.float32)
    conf = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=MODULES, init_lora_weights=False)
    model = get_peft_model(base, conf).eval()
    model.save_pretrained(OUT)
    (OUT / "README.md").unlink(missing_ok=True)
    conf_file = OUT / "adapter_config.json"  # no machine's absolute path in the committed fixture
    conf_file.write_text(conf_file.read_text().replace(str(BASE), "tests/fixtures/hf_llama"))
    with torch.no_grad():
        return model(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()


def hf_logits(tokens, model_dir=None, adapter_dir=None):
    import torch
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir or BASE, dtype=torch.float32)
    if adapter_dir:
        model = PeftModel.from_pretrained(model, adapter_dir)
    with torch.no_grad():
        return model.eval()(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()


def main() -> None:
    import numpy as np

    sequences = np.load(BASE / "reference.npz")["sequences"]
    expected = peft_reference(sequences)
    np.savez(OUT / "reference.npz", sequences=sequences, logits=expected)
    print(f"wrote {OUT}: peft's adapter files and its logits {expected.shape}")

    import jax
    from test_lora import peft_run  # the code path tests/test_lora.py checks (its conftest: 8 CPU devices)

    from jaxdist.adapters import peft
    from jaxdist.adapters import tree as adapters
    from jaxdist.hf import export

    lora_logits, params, base_logits, merged, cfg = peft_run(OUT, "fsdp=8")
    ours = lora_logits(params, sequences)
    print(
        f"merged params run by the plain model vs the adapted model: {np.abs(base_logits(merged, sequences) - ours).max():.2e}"
    )
    print(f"jaxdist (PEFT adapter read onto the float32 base) vs peft: max |diff| {np.abs(ours - expected).max():.2e}")
    with tempfile.TemporaryDirectory() as tmp:
        peft.write(Path(tmp) / "peft", jax.device_get(adapters.trainable(params))["blocks"], cfg.lora)
        export.export(merged, cfg.model, Path(tmp) / "merged", "float32", BASE, log=lambda *a: None)
        via_peft = hf_logits(sequences, adapter_dir=Path(tmp) / "peft")
        via_merged = hf_logits(sequences, model_dir=Path(tmp) / "merged")
    print(f"peft loading jaxdist's adapter export vs jaxdist: max |diff| {np.abs(via_peft - ours).max():.2e}")
    print(f"transformers loading jaxdist's merged export vs jaxdist: max |diff| {np.abs(via_merged - ours).max():.2e}")
    print(f"logit scale: max |logit| {np.abs(expected).max():.2f}")


if __name__ == "__main__":
    main()
