"""Make the Hugging Face fixtures the tests compare against, with the real reference (transformers).

    pip install torch==2.13.0+cpu transformers     # not needed by the test suite
    python scripts/make_hf_fixture.py              # writes tests/fixtures/hf_{llama,llama_tied,qwen2,...}/
    python scripts/make_hf_fixture.py --check-export   # also: jaxdist's own export read by transformers
    python scripts/make_hf_fixture.py --only qwen3 --check-export   # one family
    JAXDIST_PYTHON=python3 /work/venvs/ref/bin/python scripts/make_hf_fixture.py --only gemma3 --check-export

The other families (Qwen2, Qwen3, Mistral, Mixtral, Qwen3-MoE, Gemma 3; docs/model-families.md) are tiny random
models of the same kind: biases and every norm weight random, so a wrong mapping shows; Mistral's
window (5) and Gemma 3's (4, on alternate layers) shorter than the sequences; the MoE fixtures also keep each MoE layer's router logits for
the sequences (`router_logits`, (layers, B*T, E)), from which the test takes transformers' expert choices.

Fixture: a tiny random LlamaForCausalLM (GQA, untied head, rope_theta 50000, rope_scaling llama3 whose
three frequency bands all occur at head_dim 16, init std 0.15 so next-token logits are well
separated), saved with `save_pretrained` (fp32), plus `reference.npz`: logits for fixed token
sequences and the greedy continuation `generate` gives for two prompts (tokens and the log-probability
of each under the model). A small tied-embedding variant beside it.

--check-export runs `jaxdist.convert from-hf` then `to-hf` on the fixture, and on a freshly trained
jaxdist tiny run, loads each export with `LlamaForCausalLM.from_pretrained` (missing / unexpected keys
must be none) and prints the largest logit difference.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import LlamaForCausalLM

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"
SEQUENCES_SEED = 1234
PROMPTS = [[5, 17, 42, 8, 99], [3, 1, 4, 1, 5, 9, 2, 6, 53]]
NEW_TOKENS = 12

MAIN = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 128,
    "rope_theta": 50000.0,
    "tie_word_embeddings": False,
    "initializer_range": 0.15,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}
TIED = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 64,
    "tie_word_embeddings": True,
    "initializer_range": 0.15,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


SMALL = {k: v for k, v in MAIN.items() if k != "rope_scaling"}
MOE_SMALL = {**SMALL, "hidden_size": 32, "intermediate_size": 64, "head_dim": 8}
FAMILIES = {  # fixture name -> (architecture, config fields)
    "hf_qwen2": ("Qwen2", {**SMALL, "rope_theta": 1e6}),
    "hf_qwen3": ("Qwen3", {**SMALL, "rope_theta": 1e6, "tie_word_embeddings": True}),
    "hf_mistral": ("Mistral", {**SMALL, "sliding_window": 5}),
    "hf_mixtral": ("Mixtral", {**MOE_SMALL, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "hf_qwen3_moe": (
        "Qwen3Moe",
        {**MOE_SMALL, "num_hidden_layers": 4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
         "decoder_sparse_step": 2, "norm_topk_prob": False},
    ),
    # Gemma 3 (text): window 4 < the 16-token sequences, layers sliding/full/sliding/full, separate rotary
    # bases (the full layers' linearly scaled by 2), query_pre_attn_scalar 24 != head_dim, tied embeddings.
    "hf_gemma3": (
        "Gemma3",
        {**SMALL, "num_hidden_layers": 4, "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "sliding_window": 4,
         "sliding_window_pattern": 2, "query_pre_attn_scalar": 24, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
         "rope_scaling": {"rope_type": "linear", "factor": 2.0}, "pad_token_id": 0},
    ),
    # DeepSeek-V3: 3 layers, the first dense; MLA with q and kv low rank (q 24, kv 16), rotary key 4
    # shared over heads, nope 8 and v 6 (all different), interleaved rotary; 8 experts in 4 groups, 2 groups
    # kept, top-3 (so the group limit changes choices), one shared expert, routed_scaling 2.5, random e_score_correction_bias (selection only);
    # YaRN x4 from 8 positions (the 16-token sequences pass it), mscale 1 and mscale_all_dim 0.8 (both factors act).
    "hf_deepseek_v3": (
        "DeepseekV3",
        {**{k: v for k, v in SMALL.items() if k != "head_dim"}, "hidden_size": 32, "num_hidden_layers": 3, "num_key_value_heads": 4, "intermediate_size": 64,
         "moe_intermediate_size": 16, "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
         "qk_rope_head_dim": 4, "v_head_dim": 6, "n_routed_experts": 8, "n_group": 4, "topk_group": 2,
         "num_experts_per_tok": 3, "n_shared_experts": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
         "first_k_dense_replace": 1, "rope_interleave": True, "num_mtp_layers": 0,
         "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "mscale": 1.0,
                          "mscale_all_dim": 0.8}},
    ),
    # gpt-oss: layers sliding/full with window 4 < the 16-token sequences, learned sinks, q/k/v/o biases,
    # 4 experts top-2 with router bias and random expert biases, swiglu_limit 1.0 (so the clamp acts), YaRN
    # rotary (factor 4 over 16 original positions: all three bands at head_dim 8, truncate false).
    "hf_gpt_oss": (
        "GptOss",
        {**{k: v for k, v in SMALL.items() if k != "rope_theta"}, "hidden_size": 32, "intermediate_size": 16,
         "head_dim": 8, "num_hidden_layers": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
         "sliding_window": 4, "swiglu_limit": 1.0, "pad_token_id": 0,
         "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16}},
    ),
}  # fmt: skip
CONFIG_CLASS = {"Gemma3": "Gemma3TextConfig"}  # Gemma3Config is the multimodal one


def build(fields: dict, seed: int, arch: str = "Llama"):
    torch.manual_seed(seed)
    cfg = getattr(transformers, CONFIG_CLASS.get(arch, f"{arch}Config"))(**fields)
    model = getattr(transformers, f"{arch}ForCausalLM")(cfg).eval()
    with torch.no_grad():  # norms at ones and zero biases are special cases: make them random too
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias") or (arch == "GptOss" and name.endswith("_bias")):  # experts' biases
                p.copy_(0.5 * torch.randn_like(p))
        for name, b in model.named_buffers():  # DeepSeek-V3's router bias: a buffer, used in the top-k only
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))
    return model


def reference(model: LlamaForCausalLM) -> dict:
    vocab = model.config.vocab_size
    rng = np.random.default_rng(SEQUENCES_SEED)
    seqs = rng.integers(0, vocab, size=(4 if getattr(model.config, "num_experts_per_tok", None) else 3, 16))
    with torch.no_grad():
        logits = model(torch.tensor(seqs)).logits.numpy()
    out = {"sequences": seqs.astype(np.int32), "logits": logits.astype(np.float32)}
    if getattr(model.config, "num_experts_per_tok", None):
        with torch.no_grad():
            router = model(torch.tensor(seqs), output_router_logits=True).router_logits
        out["router_logits"] = torch.stack([r.float() for r in router]).numpy()
    margins = []
    for k, prompt in enumerate(PROMPTS):
        prompt = [t % vocab for t in prompt]
        with torch.no_grad():
            gen = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                return_dict_in_generate=True,
                output_logits=True,
            )
        new = gen.sequences[0, len(prompt) :].numpy()
        step_logits = torch.stack(gen.logits)[:, 0].float()
        logp = torch.log_softmax(step_logits, -1)
        out[f"prompt{k}"] = np.array(prompt, np.int32)
        out[f"greedy{k}"] = new.astype(np.int32)
        out[f"logprobs{k}"] = logp[torch.arange(len(new)), torch.tensor(new)].numpy().astype(np.float32)
        top2 = torch.topk(step_logits, 2, -1).values
        margins.append(float((top2[:, 0] - top2[:, 1]).min()))
    print(f"  smallest top-1/top-2 logit margin along the greedy paths: {min(margins):.4f}")
    return out


def make(name: str, fields: dict, seed: int, arch: str = "Llama") -> Path:
    model = build(fields, seed, arch)
    path = FIXTURES / name
    model.save_pretrained(path, safe_serialization=True)
    np.savez(path / "reference.npz", **reference(model))
    size = sum(f.stat().st_size for f in path.iterdir())
    print(f"wrote {path} ({size / 1024:.0f} KiB)")
    return path


def python(*args: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    # JAXDIST_PYTHON: an interpreter with jax (when the one running this script has torch only)
    subprocess.run([os.environ.get("JAXDIST_PYTHON", sys.executable), *args], cwd=REPO, env=env, check=True)


def jaxdist(*args: str) -> None:
    python("-m", *args)


def compare(exported: Path, reference_logits: np.ndarray, seqs: np.ndarray, what: str, arch: str = "Llama") -> float:
    model, info = getattr(transformers, f"{arch}ForCausalLM").from_pretrained(
        exported, output_loading_info=True, attn_implementation="eager"
    )
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        raise SystemExit(f"{what}: transformers reports {bad}")
    with torch.no_grad():
        logits = model.eval()(torch.tensor(seqs, dtype=torch.long)).logits.float().numpy()
    diff = float(np.abs(logits - reference_logits).max())
    print(f"{what}: loaded by transformers with no missing/unexpected keys; max |logit diff| = {diff:.3g}")
    return diff


def check_export(fixture: Path) -> None:
    ref = np.load(fixture / "reference.npz")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        jaxdist("jaxdist.convert", "from-hf", str(fixture), str(tmp / "run"), "--mesh", "fsdp=4,tp=2")
        jaxdist("jaxdist.convert", "to-hf", str(tmp / "run"), str(tmp / "hf"))
        compare(tmp / "hf", ref["logits"], ref["sequences"], "fixture -> jaxdist -> HF (fp32)")
        jaxdist("jaxdist.convert", "to-hf", str(tmp / "run"), str(tmp / "hf16"), "--dtype", "bfloat16")
        compare(tmp / "hf16", ref["logits"], ref["sequences"], "fixture -> jaxdist -> HF (bf16)")
        # A model jaxdist trained itself: its own logits against transformers' on the export.
        jaxdist(
            "jaxdist.train",
            "--run-dir",
            str(tmp / "tiny"),
            "--steps",
            "20",
            "train.eval_every=0",
            "checkpoint.every=20",
        )
        jaxdist("jaxdist.convert", "to-hf", str(tmp / "tiny"), str(tmp / "tiny_hf"))
        seqs = np.random.default_rng(0).integers(0, 256, size=(2, 64))
        np.save(tmp / "seqs.npy", seqs)
        code = (
            "import sys, numpy as np; from pathlib import Path; from jaxdist.distributed.platform import setup_platform; "
            "setup_platform(1); from jaxdist.checkpoint import run_params; from jaxdist.distributed import mesh; import jax; "
            "cfg, p, m = run_params.load_run_params(Path(sys.argv[1]), mesh.mesh_from_string('fsdp=-1')); "
            "from flax import nnx; model = nnx.merge(m.graphdef, p); "
            "np.save(sys.argv[2], np.asarray(model(np.load(sys.argv[3]))))"
        )
        python("-c", code, str(tmp / "tiny"), str(tmp / "tiny_logits.npy"), str(tmp / "seqs.npy"))
        compare(tmp / "tiny_hf", np.load(tmp / "tiny_logits.npy"), seqs, "jaxdist-trained tiny -> HF (fp32)")


def check_family_export(fixture: Path, arch: str, mesh: str) -> None:
    """from-hf onto `mesh`, to-hf, transformers loads the export (no missing/unexpected keys) and gives
    the fixture's logits; the window switch is not vacuous (Mistral: transformers without it differs)."""
    ref = np.load(fixture / "reference.npz")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        jaxdist("jaxdist.convert", "from-hf", str(fixture), str(tmp / "run"), "--mesh", mesh)
        jaxdist("jaxdist.convert", "to-hf", str(tmp / "run"), str(tmp / "hf"))
        compare(tmp / "hf", ref["logits"], ref["sequences"], f"{fixture.name} -> jaxdist ({mesh}) -> HF (fp32)", arch)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check-export", action="store_true", help="also load jaxdist's exports with transformers")
    p.add_argument(
        "--only",
        default="",
        help="one fixture family (llama, qwen2, qwen3, mistral, mixtral, qwen3_moe, gemma3, deepseek_v3, gpt_oss)",
    )
    args = p.parse_args()
    torch.set_default_dtype(torch.float32)
    if args.only in ("", "llama"):
        main_dir = make("hf_llama", MAIN, seed=0)
        make("hf_llama_tied", TIED, seed=1)
        if args.check_export:
            check_export(main_dir)
    for seed, (name, (arch, fields)) in enumerate(FAMILIES.items(), start=2):
        if args.only not in ("", name[3:]):
            continue
        path = make(name, fields, seed, arch)
        if args.check_export:
            check_family_export(path, arch, "fsdp=2,ep=2,tp=2" if "experts_per_tok" in str(fields) else "fsdp=4,tp=2")


if __name__ == "__main__":
    main()
