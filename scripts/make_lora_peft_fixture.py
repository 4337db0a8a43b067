"""LoRA adapters against the real reference (peft + transformers): make `tests/fixtures/lora_peft*/` and
print how closely jaxdist agrees.

    python scripts/make_lora_peft_fixture.py                # every family (needs torch, transformers, peft;
    python scripts/make_lora_peft_fixture.py qwen2 mistral  # not suite dependencies)

1. Per family, peft puts a random LoRA (r=4, alpha=8, `init_lora_weights=False` so B != 0) on that
   family's HF fixture model (tests/fixtures/hf_<family>) and saves it with `save_pretrained`: the
   fixture's adapter_config.json + adapter_model.safetensors, in PEFT's own format and key names. Its
   logits on the base fixture's sequences are saved as reference.npz. For the non-Llama families it
   also holds the mean next-token cross-entropy (`loss`), each adapter tensor's gradient norm and
   gradient . tensor (`grad_keys`, `grad_norm`, `grad_dot`), and the logits of peft's
   `merge_and_unload()` model on the first sequence (`merged_logits`). Targets: Llama and Qwen2 all
   seven projections (Qwen2's q/k/v carry biases), Qwen3 q, k, o, up, down (q/k norms after q/k),
   Mistral q, v, gate, down (window 5 < the 16-token sequences).
2. jaxdist reads that adapter onto the imported base (float32) and computes the same logits; it exports
   its adapters back to PEFT's format and the merged model (`convert to-hf` without / with --peft do
   the same); transformers loads the merged export as a plain checkpoint, and peft loads jaxdist's
   adapter export onto the original model. Every logit difference against peft's is printed.
tests/test_lora.py checks jaxdist's side against the committed fixture without torch.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]
FIXTURES = REPO / "tests" / "fixtures"
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# family -> (base fixture, adapter fixture, peft target_modules); test_lora.py's PEFT_FAMILIES mirrors it
FAMILIES = {
    "llama": ("hf_llama", "lora_peft", ALL),
    "qwen2": ("hf_qwen2", "lora_peft_qwen2", ALL),
    "qwen3": ("hf_qwen3", "lora_peft_qwen3", ["q_proj", "k_proj", "o_proj", "up_proj", "down_proj"]),
    "mistral": ("hf_mistral", "lora_peft_mistral", ["q_proj", "v_proj", "gate_proj", "down_proj"]),
    # rsLoRA (peft's use_rslora: alpha / sqrt(r)) on Llama's q and v; logits only, as Llama's
    "llama_rslora": ("hf_llama", "lora_peft_rslora", ["q_proj", "v_proj"]),
}
RSLORA = {"llama_rslora"}


def peft_reference(base_dir: Path, out: Path, modules: list[str], tokens, merged: bool, rslora: bool = False):
    """peft's adapter files in `out`, its logits on `tokens`, and (`merged`) merge_and_unload()'s."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    conf = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=modules, init_lora_weights=False, use_rslora=rslora
    )
    model = get_peft_model(base, conf).eval()
    model.save_pretrained(out)
    (out / "README.md").unlink(missing_ok=True)
    # No machine's absolute path in the committed fixture; target_modules sorted (peft writes a set,
    # whose order changes with the hash seed).
    conf_file = out / "adapter_config.json"
    conf = json.loads(conf_file.read_text().replace(str(base_dir), f"tests/fixtures/{base_dir.name}"))
    conf["target_modules"] = sorted(conf["target_modules"])
    conf_file.write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n")
    import numpy as np

    tokens = torch.as_tensor(tokens, dtype=torch.long)
    with torch.no_grad():
        logits = model(tokens).logits.numpy()
    if not merged:  # Llama's fixture: logits only, as first committed
        return logits, {}
    # The adapters' gradients of the mean next-token cross-entropy, as a few numbers per tensor (KBs, not
    # a second adapter): its norm and its dot product with the tensor itself (sign and layout matter).
    logits_t = model(tokens).logits
    loss = torch.nn.functional.cross_entropy(logits_t[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    grads = {n.replace(".default", ""): p for n, p in model.named_parameters() if p.requires_grad}
    keys = sorted(grads)
    extra = {
        "loss": np.float32(loss.item()),
        "grad_keys": np.array(keys),
        "grad_norm": np.array([grads[k].grad.norm().item() for k in keys], np.float32),
        "grad_dot": np.array([(grads[k].grad * grads[k]).sum().item() for k in keys], np.float32),
    }
    with torch.no_grad():
        extra["merged_logits"] = model.merge_and_unload()(tokens).logits.numpy()[:1]  # one sequence: fewer KB
    return logits, extra


def hf_logits(base_dir: Path, tokens, model_dir=None, adapter_dir=None):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir or base_dir, dtype=torch.float32)
    if adapter_dir:
        model = PeftModel.from_pretrained(model, adapter_dir)
    with torch.no_grad():
        return model.eval()(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()


def main() -> None:
    for family in sys.argv[1:] or list(FAMILIES):
        make(family)


def make(family: str) -> None:
    import numpy as np

    base_name, out_name, modules = FAMILIES[family]
    base_dir, out_dir = FIXTURES / base_name, FIXTURES / out_name
    print(f"== {family}")
    sequences = np.load(base_dir / "reference.npz")["sequences"]
    logits_only = family in ("llama", *RSLORA)
    expected, extra = peft_reference(base_dir, out_dir, modules, sequences, not logits_only, family in RSLORA)
    np.savez(out_dir / "reference.npz", sequences=sequences, logits=expected, **extra)
    print(f"wrote {out_dir}: peft's adapter files and its logits {expected.shape}")
    merged_ref = extra.get("merged_logits")
    if merged_ref is not None:
        print(f"peft merge_and_unload vs peft adapted: max |diff| {np.abs(merged_ref - expected[:1]).max():.2e}")

    import jax
    from test_lora import peft_run  # the code path tests/test_lora.py checks (its conftest: 8 CPU devices)

    from jaxdist.adapters import peft
    from jaxdist.adapters import tree as adapters
    from jaxdist.hf import export

    lora_logits, params, base_logits, merged, cfg, _ = peft_run(out_dir, "fsdp=8", base_dir)
    ours = lora_logits(params, sequences)
    print(
        f"merged params run by the plain model vs the adapted model: {np.abs(base_logits(merged, sequences) - ours).max():.2e}"
    )
    print(f"jaxdist (PEFT adapter read onto the float32 base) vs peft: max |diff| {np.abs(ours - expected).max():.2e}")
    with tempfile.TemporaryDirectory() as tmp:
        peft.write(Path(tmp) / "peft", jax.device_get(adapters.trainable(params))["blocks"], cfg.lora)
        export.export(merged, cfg.model, Path(tmp) / "merged", "float32", base_dir, log=lambda *a: None)
        via_peft = hf_logits(base_dir, sequences, adapter_dir=Path(tmp) / "peft")
        via_merged = hf_logits(base_dir, sequences, model_dir=Path(tmp) / "merged")
    print(f"peft loading jaxdist's adapter export vs jaxdist: max |diff| {np.abs(via_peft - ours).max():.2e}")
    print(f"transformers loading jaxdist's merged export vs jaxdist: max |diff| {np.abs(via_merged - ours).max():.2e}")
    if merged_ref is not None:
        print(
            f"jaxdist's merged params (plain model) vs peft's merged model: max |diff| "
            f"{np.abs(base_logits(merged, sequences)[:1] - merged_ref).max():.2e}"
        )
    print(f"logit scale: max |logit| {np.abs(expected).max():.2f}")


if __name__ == "__main__":
    main()
