"""Make the TRL fixtures the preference objectives are checked against (TRL, torch, transformers: not suite deps).

    /work/venvs/ref/bin/python scripts/make_trl_fixture.py    # writes tests/fixtures/trl/

The policy is the tiny random Llama of tests/fixtures/hf_llama (made by scripts/make_hf_fixture.py); the
reference is the same model with every weight perturbed (seed 7, +N(0, 0.02^2)), saved beside the fixture
(`reference/`), so the reference's log-probs differ from the policy's. Fixed pairs: 4 prompts of 2..5
tokens, completions of 1..6 tokens, rows right-padded to 12 tokens with id 0 (attention off, as TRL pads).

A real `trl.DPOTrainer` (TRL 1.16) is built around the two models and its own `_compute_loss` runs on the
batch (`[chosen rows; rejected rows]`, `completion_mask`), then `loss.backward()`: `dpo.npz` keeps the
loss, TRL's logged metrics (`rewards/*`, `logps/*`) and the gradients of the final norm, the head and the
embedding, plus the batch in jaxdist's pair-record layout (chosen row then rejected row, loss mask = TRL's
completion mask), which `tests/test_objectives.py` runs through jaxdist's stage.
"""

from __future__ import annotations

import tempfile
import types
from pathlib import Path

import numpy as np
import torch
import trl
from datasets import Dataset
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast
from trl.experimental.cpo import CPOTrainer
from trl.experimental.orpo import ORPOTrainer

REPO = Path(__file__).resolve().parent.parent
POLICY = REPO / "tests" / "fixtures" / "hf_llama"
OUT = REPO / "tests" / "fixtures" / "trl"
TOKENIZER = REPO / "tests" / "fixtures" / "chat" / "llama3" / "tokenizer.json"  # only to build the trainer
WIDTH, PAIRS = 12, 4
GRADS = {"norm": "model.norm.weight", "head": "lm_head.weight", "embed": "model.embed_tokens.weight"}


def batch(seed: int = 0):
    """(input_ids (2B, W), attention_mask, completion_mask): TRL's layout, chosen rows first."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((2 * PAIRS, WIDTH), np.int64)
    att = np.zeros_like(ids)
    comp = np.zeros_like(ids)
    for b in range(PAIRS):
        prompt = rng.integers(3, 128, rng.integers(2, 6))
        for side in (0, 1):
            completion = rng.integers(3, 128, rng.integers(1, 7))
            row = np.concatenate([prompt, completion])
            r = side * PAIRS + b
            ids[r, : len(row)], att[r, : len(row)] = row, 1
            comp[r, len(prompt) : len(row)] = 1
    return ids, att, comp


def reference_model(out: Path) -> LlamaForCausalLM:
    ref = LlamaForCausalLM.from_pretrained(POLICY, dtype=torch.float32)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
    ref.save_pretrained(out)
    return ref


def trainer(policy, ref, tmp: str, **config) -> trl.DPOTrainer:
    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(TOKENIZER), eos_token="<|end_of_text|>", pad_token="<|end_of_text|>"
    )
    data = Dataset.from_dict({"prompt": ["a"], "chosen": [" b"], "rejected": [" c"]})
    args = trl.DPOConfig(output_dir=tmp, report_to="none", disable_dropout=True, use_cpu=True, bf16=False, **config)
    return trl.DPOTrainer(model=policy, ref_model=ref, args=args, train_dataset=data, processing_class=tok)


def run(name: str, ref_dir: Path, **config) -> dict:
    policy = LlamaForCausalLM.from_pretrained(POLICY, dtype=torch.float32)
    ref = LlamaForCausalLM.from_pretrained(ref_dir, dtype=torch.float32)
    ids, att, comp = batch()
    with tempfile.TemporaryDirectory() as tmp:
        t = trainer(policy, ref, tmp, **config)
        t.model.train()
        inputs = {
            k: torch.tensor(v) for k, v in (("input_ids", ids), ("attention_mask", att), ("completion_mask", comp))
        }
        loss = t._compute_loss(t.model, inputs, return_outputs=False)
        loss.backward()
        metrics = {k: float(v[-1]) for k, v in t._metrics["train"].items() if k.startswith(("rewards/", "logps/"))}
        named = dict(t.model.named_parameters())
        grads = {f"grad/{k}": named[n].grad.detach().numpy().astype(np.float64) for k, n in GRADS.items()}
    # jaxdist's record: pair b = chosen row b then rejected row b; the mask on the targets TRL counts
    records = np.concatenate([ids[:PAIRS], ids[PAIRS:]], axis=1)
    masks = np.concatenate([comp[:PAIRS], comp[PAIRS:]], axis=1)
    out = {"loss": float(loss), **metrics, **grads, "records": records, "masks": masks}
    print(name, {k: v for k, v in out.items() if not isinstance(v, np.ndarray)})
    return out


def sequence_logps(model_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """(summed completion log-probs (B, 2), completion token counts (B, 2)) of the fixed pairs, gathered by
    TRL's own `CPOTrainer.get_batch_logps` from the model's logits (column 0 chosen, 1 rejected)."""
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids, att, comp = batch()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(att)).logits
    labels = torch.tensor(np.where(comp == 1, ids, -100))
    sums = CPOTrainer.get_batch_logps(logits, labels, average_log_prob=False).numpy().astype(np.float64)
    counts = comp[:, 1:].sum(1).astype(np.float64)
    return np.stack([sums[:PAIRS], sums[PAIRS:]], 1), np.stack([counts[:PAIRS], counts[PAIRS:]], 1)


def reference_free(name: str, logps: np.ndarray, counts: np.ndarray, **config) -> dict:
    """SimPO / ORPO: TRL's own loss methods (`CPOTrainer.cpo_loss`, `ORPOTrainer.odds_ratio_loss`) on the
    length-normalised log-probs, as their trainers call them; gradients w.r.t. the summed log-probs."""
    sums = torch.tensor(logps, dtype=torch.float32, requires_grad=True)
    avg = sums / torch.tensor(counts, dtype=torch.float32)
    me = types.SimpleNamespace(accelerator=types.SimpleNamespace(device="cpu"), alpha=0.0, **config)
    out = {}
    if name == "simpo":
        losses, chosen_r, rejected_r = CPOTrainer.cpo_loss(me, avg[:, 0], avg[:, 1])
        loss = losses.mean()  # cpo_alpha = 0 for SimPO: no NLL term
    else:
        losses, chosen_r, rejected_r, ratio, log_odds = ORPOTrainer.odds_ratio_loss(me, avg[:, 0], avg[:, 1])
        nll = -sums[:, 0].sum() / float(counts[:, 0].sum())  # = the chosen tokens' mean cross-entropy (checked below)
        loss = nll - losses.mean()
        out |= {"nll_loss": float(nll), "log_odds_ratio": float(ratio), "log_odds_chosen": float(log_odds)}
    loss.backward()
    out |= {
        "loss": float(loss),
        "rewards/chosen": float(chosen_r.mean()),
        "rewards/rejected": float(rejected_r.mean()),
        "rewards/margins": float((chosen_r - rejected_r).mean()),
        "rewards/accuracies": float((chosen_r > rejected_r).float().mean()),
        "logps/chosen": float(avg[:, 0].mean()),
        "logps/rejected": float(avg[:, 1].mean()),
        "grad/logps": sums.grad.numpy().astype(np.float64),
    }
    print(name, {k: v for k, v in out.items() if not isinstance(v, np.ndarray)})
    return out


def check_orpo_nll() -> None:
    """ORPO's NLL from the summed log-probs equals the chosen rows' mean cross-entropy as ORPOTrainer takes it."""
    model = LlamaForCausalLM.from_pretrained(POLICY, dtype=torch.float32)
    ids, att, comp = batch()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(att)).logits[:PAIRS, :-1]
    labels = torch.tensor(np.where(comp == 1, ids, -100))[:PAIRS, 1:]
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
    logps, counts = sequence_logps(POLICY)
    assert abs(float(ce) + logps[:, 0].sum() / counts[:, 0].sum()) < 1e-6, (
        float(ce),
        logps[:, 0].sum() / counts[:, 0].sum(),
    )


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    ref_dir = OUT / "reference"
    reference_model(ref_dir)
    logps, counts = sequence_logps(POLICY)
    ref_logps, _ = sequence_logps(ref_dir)
    seq = {"logps": logps, "counts": counts, "ref_logps": ref_logps}
    dpo_runs = {
        "dpo": dict(beta=0.1, loss_type=["sigmoid"]),
        "dpo_ipo": dict(beta=0.1, loss_type=["ipo"]),
        "dpo_robust": dict(beta=0.1, loss_type=["robust"], label_smoothing=0.1),
    }
    for name, config in dpo_runs.items():
        result = run(name, ref_dir, **config)
        np.savez(OUT / f"{name}.npz", **result, **seq, **{f"config/{k}": str(v) for k, v in config.items()})
    check_orpo_nll()
    free = {
        "simpo": dict(beta=2.0, loss_type="simpo", simpo_gamma=0.5, label_smoothing=0.1),
        "orpo": dict(beta=0.1),
    }
    for name, config in free.items():
        result = reference_free(name, logps, counts, **config)
        np.savez(OUT / f"{name}.npz", **result, **seq, **{f"config/{k}": str(v) for k, v in config.items()})
    (OUT / "versions.txt").write_text(f"trl {trl.__version__}\ntorch {torch.__version__}\n")


if __name__ == "__main__":
    main()
