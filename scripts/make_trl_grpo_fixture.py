"""Make the TRL fixtures GRPO's loss is checked against (TRL, torch, transformers: not suite deps).

    /work/venvs/ref/bin/python scripts/make_trl_grpo_fixture.py    # writes tests/fixtures/trl/grpo_*.npz

The policy is the tiny random Llama of tests/fixtures/hf_llama, the reference the perturbed copy that
scripts/make_trl_fixture.py saved (tests/fixtures/trl/reference). Fixed rollouts: 2 prompts of 4 tokens,
G = 4 completions each of 1..6 tokens, right-padded to 6 (TRL's completion_mask); fixed rewards (one
unscorable, NaN) turned into group-normalised advantages the way `GRPOTrainer._generate_and_score_completions`
does (`trl.trainer.utils.nanstd`, scale_rewards="group", NaN -> 0); old log-probs = the policy's (TRL's
`_get_per_token_logps_and_entropies`) + fixed noise, so some ratios leave [1 - eps, 1 + eps] and are clipped.

A real `trl.GRPOTrainer` (TRL 1.16, beta=0.04, epsilon=0.2, temperature=0.7, max_completion_length=6) is built
around the policy for each `loss_type` (grpo, bnpo, dr_grpo, dapo: TRL's default) and its own `_compute_loss`
runs on the batch, then `loss.backward()`: `grpo_<loss_type>.npz` keeps the loss, TRL's logged `kl` and
`clip_ratio/*`, the gradients of the final norm, the head and the embedding, and the batch in jaxdist's row
layout (prompt then completion from position 0, loss mask on the completion), its advantages, old and
reference log-probs, which `tests/test_grpo.py` runs through jaxdist's loss.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch
import trl
from datasets import Dataset
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast
from trl.trainer.utils import add_fused_lm_head, nanstd

REPO = Path(__file__).resolve().parent.parent
POLICY = REPO / "tests" / "fixtures" / "hf_llama"
OUT = REPO / "tests" / "fixtures" / "trl"
REFERENCE = OUT / "reference"
TOKENIZER = REPO / "tests" / "fixtures" / "chat" / "llama3" / "tokenizer.json"  # only to build the trainer
PROMPTS, G, PROMPT_LEN, MAX_NEW = 2, 4, 4, 6
CONFIG = dict(beta=0.04, epsilon=0.2, temperature=0.7)
REWARDS = [1.0, 0.0, 0.5, 1.0, 0.0, float("nan"), 2.0, 0.0]  # per completion, group-major; one unscorable
GRADS = {"norm": "model.norm.weight", "head": "lm_head.weight", "embed": "model.embed_tokens.weight"}


def batch(seed: int = 0):
    rng = np.random.default_rng(seed)
    n = PROMPTS * G
    prompt = np.repeat(rng.integers(3, 128, (PROMPTS, PROMPT_LEN)), G, axis=0)
    completion = np.zeros((n, MAX_NEW), np.int64)
    mask = np.zeros_like(completion)
    for i in range(n):
        k = int(rng.integers(1, MAX_NEW + 1))
        completion[i, :k], mask[i, :k] = rng.integers(3, 128, k), 1
    return prompt.astype(np.int64), completion, mask


def advantages(rewards: torch.Tensor) -> torch.Tensor:
    """GRPOTrainer's sum_then_normalize, scale_rewards='group' (grpo_trainer.py, TRL 1.16), one reward function."""
    mean = torch.nanmean(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
    std = nanstd(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
    return torch.nan_to_num((rewards - mean) / (std + 1e-4), nan=0.0)


def trainer(tmp: str, loss_type: str) -> trl.GRPOTrainer:
    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(TOKENIZER), eos_token="<|end_of_text|>", pad_token="<|end_of_text|>"
    )
    args = trl.GRPOConfig(
        output_dir=tmp,
        report_to="none",
        use_cpu=True,
        bf16=False,
        loss_type=loss_type,
        num_generations=G,
        per_device_train_batch_size=PROMPTS * G,
        max_completion_length=MAX_NEW,
        disable_dropout=True,
        **CONFIG,
    )
    policy = LlamaForCausalLM.from_pretrained(POLICY, dtype=torch.float32)
    data = Dataset.from_dict({"prompt": ["a"] * 8})
    return trl.GRPOTrainer(
        model=policy,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=args,
        train_dataset=data,
        processing_class=tok,
    )


def run(loss_type: str) -> dict:
    prompt, completion, mask = batch()
    ids = torch.tensor(np.concatenate([prompt, completion], 1))
    att = torch.tensor(np.concatenate([np.ones_like(prompt), mask], 1))
    with tempfile.TemporaryDirectory() as tmp:
        t = trainer(tmp, loss_type)
        ref = LlamaForCausalLM.from_pretrained(REFERENCE, dtype=torch.float32)
        add_fused_lm_head(ref, temperature=t.temperature, cast_lm_head_to_fp32=False)  # as GRPOTrainer does its own
        t.model.eval()
        with torch.no_grad():
            policy_logps = t._get_per_token_logps_and_entropies(t.model, ids, att, MAX_NEW)[0]
            ref_logps = t._get_per_token_logps_and_entropies(ref, ids, att, MAX_NEW)[0]
        noise = torch.tensor(np.random.default_rng(1).normal(0, 0.5, policy_logps.shape), dtype=torch.float32)
        old = (policy_logps + noise) * torch.tensor(mask, dtype=torch.float32)
        adv = advantages(torch.tensor(REWARDS))
        t.model.train()
        t.current_gradient_accumulation_steps = 1
        inputs = {
            "prompt_ids": torch.tensor(prompt),
            "prompt_mask": torch.ones_like(torch.tensor(prompt)),
            "completion_ids": torch.tensor(completion),
            "completion_mask": torch.tensor(mask),
            "advantages": adv,
            "old_per_token_logps": old,
            "ref_per_token_logps": ref_logps,
            "num_items_in_batch": torch.tensor(float(mask.sum())),
        }
        loss = t._compute_loss(t.model, inputs)
        loss.backward()
        metrics = {k: float(v[-1]) for k, v in t._metrics["train"].items() if k == "kl" or k.startswith("clip_ratio/")}
        named = dict(t.model.named_parameters())
        grads = {f"grad/{k}": named[n].grad.detach().numpy().astype(np.float64) for k, n in GRADS.items()}
    rows = np.concatenate([prompt, completion], 1)
    masks = np.concatenate([np.zeros_like(prompt), mask], 1)
    out = {
        "loss": float(loss),
        **metrics,
        **grads,
        "rows": rows,
        "masks": masks,
        "rewards": np.array(REWARDS),
        "advantages": adv.numpy().astype(np.float64),
        "old_logps": old.numpy().astype(np.float64),
        "ref_logps": ref_logps.numpy().astype(np.float64),
        "policy_logps": policy_logps.numpy().astype(np.float64),
    }
    print(loss_type, {k: v for k, v in out.items() if not isinstance(v, np.ndarray)})
    return out


def main() -> None:
    config = {**CONFIG, "group_size": G, "max_completion_length": MAX_NEW}
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
        result = run(loss_type)
        np.savez(OUT / f"grpo_{loss_type}.npz", **result, **{f"config/{k}": str(v) for k, v in config.items()})
    (OUT / "versions.txt").write_text(f"trl {trl.__version__}\ntorch {torch.__version__}\n")


if __name__ == "__main__":
    main()
