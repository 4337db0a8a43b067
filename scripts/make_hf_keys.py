"""Make the key lists behind "transformers loads jaxdist's exports with no missing or unexpected keys".

    pip install torch==2.13.0+cpu transformers     # not needed by the test suite
    python scripts/make_hf_keys.py                 # writes tests/fixtures/hf_keys/<Architecture>.json

One JSON file per architecture (the class transformers instantiates, e.g. LlamaForCausalLM), holding
a few tiny variants (untied / tied head, ...). For each variant transformers itself builds the model
from `config` (the config.json its `save_pretrained` wrote, which is what jaxdist imports), saves it, and
the file records `tensors`: every name and shape `save_pretrained` wrote, which `from_pretrained`
loads back with no missing, unexpected or mismatched key (`loading_info`, checked here: the script
fails otherwise); and `tied`: the state-dict names transformers ties instead of loading.
tests/test_hf_keys.py exports a jaxdist model of each variant's config and asserts its safetensors
hold exactly `tensors` (names and shapes), so transformers would load it the same way.

To add an architecture: a `VARIANTS` entry (its transformers class name -> tiny HF configs); the test
picks the new file up by itself (jaxdist must import that architecture's config.json).
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path

import torch
import transformers
from safetensors import safe_open

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hf_keys"

LLAMA = {
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 64,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
VARIANTS = {
    "LlamaForCausalLM": {
        "untied": {**LLAMA, "tie_word_embeddings": False},
        "tied": {**LLAMA, "tie_word_embeddings": True},
    },
}


def variant(arch: str, fields: dict) -> dict:
    cls = getattr(transformers, arch)
    config = transformers.AutoConfig.for_model(**fields)
    torch.manual_seed(0)
    model = cls(config).eval()
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        saved_config = json.loads((Path(tmp) / "config.json").read_text())
        tensors = {}
        for file in sorted(Path(tmp).glob("*.safetensors")):
            with safe_open(str(file), "np") as f:
                tensors.update({k: list(f.get_slice(k).get_shape()) for k in f.keys()})  # noqa: SIM118 (safe_open is not iterable)
        _, info = cls.from_pretrained(tmp, output_loading_info=True)
    problems = {k: sorted(v) for k, v in info.items() if v}
    if problems:
        sys.exit(f"{arch}: transformers' own save does not load cleanly: {problems}")
    tied = sorted(set(model.state_dict()) - set(tensors))
    return {"config": saved_config, "tensors": dict(sorted(tensors.items())), "tied": tied}


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    for arch, variants in VARIANTS.items():
        record = {
            "architecture": arch,
            "made_by": f"scripts/make_hf_keys.py with transformers {transformers.__version__}",
            "loading_info": "from_pretrained of these tensors: no missing, unexpected or mismatched keys",
            "variants": {name: variant(arch, fields) for name, fields in variants.items()},
        }
        path = OUT / f"{arch}.json"
        text = re.sub(
            r"\[\s+([\d,\s]+?)\s+\]",
            lambda g: "[" + ", ".join(g[1].split()).replace(",,", ",") + "]",
            json.dumps(record, indent=1),
        )
        path.write_text(text + "\n")  # shapes on one line each
        counts = ", ".join(f"{n} {len(v['tensors'])} tensors" for n, v in record["variants"].items())
        print(f"wrote {path}: {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
