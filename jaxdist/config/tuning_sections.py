"""The sections of what is trained and toward what: `lora.*` (adapters on a frozen base) and `objective.*`
(the loss: next-token, preference pairs, GRPO). Each field's `# comment` is its documentation."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Literal

from jaxdist.config.checks import LORA_DEFAULT
from jaxdist.config.types import NonNegative, NonNegativeFloat, Positive, PositiveFloat, Range


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    rank: NonNegative = (
        0  # LoRA adapter rank; 0 = off (every parameter trained). On: only adapters train (jaxdist/adapters)
    )
    alpha: PositiveFloat = 16.0  # the adapted weight is W + (alpha / rank) A B
    rslora: bool = False  # rsLoRA: scale by alpha / sqrt(rank) instead of alpha / rank (peft's use_rslora)
    dropout: Annotated[float, Range(0, 1, hi_open=True)] = (
        0.0  # dropout on the adapters' input (only 0 is supported yet)
    )
    targets: list[str] = dataclasses.field(
        default_factory=lambda: list(LORA_DEFAULT)
    )  # projections that get adapters, among q, k, v, o, gate, up, down; DeepSeek-V3: q_a, q_b (q without a q rank), kv_a, kv_b, o, and gate, up, down = its routed experts (peft's target_parameters)
    base_dtype: Literal["float32", "bfloat16", "int8", "nf4"] = (
        "float32"  # how the frozen base is stored: int8 / nf4 (QLoRA) layer matrices with per-block scales
    )
    block_size: Positive = 64  # int8 / nf4: entries per scale, along each matrix's last input dimension


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
    method: Literal["lm", "dpo", "simpo", "orpo", "grpo"] = (
        "lm"  # lm: next-token cross-entropy; dpo, simpo, orpo: preference pairs from prepare --preference; grpo: rollouts on prompts from prepare --prompts (docs/post-training.md)
    )
    beta: PositiveFloat = 0.1  # dpo: strength of the implicit KL to the reference; simpo: reward scale (TRL's beta; the SimPO paper uses 2-2.5); grpo: weight of the k3 KL to the reference
    dpo_loss: Literal["sigmoid", "ipo", "robust"] = (
        "sigmoid"  # dpo: TRL's loss_type: sigmoid (DPO), ipo (length-normalised squared loss), robust (label_smoothing = flip probability)
    )
    label_smoothing: Annotated[float, Range(0, 0.5, hi_open=True)] = (
        0.0  # dpo_loss=robust: probability a label is flipped; simpo: conservative (cDPO-style) smoothing
    )
    gamma: NonNegativeFloat = 0.5  # simpo: target reward margin (TRL's simpo_gamma)
    orpo_lambda: PositiveFloat = (
        0.1  # orpo: weight of the odds-ratio term beside the chosen NLL (TRL ORPOConfig's beta)
    )
    reward: list[str] = dataclasses.field(
        default_factory=list
    )  # grpo: reward functions, each a built-in (answer_match, digits) or FILE.py:NAME called as TRL calls one
    reward_weights: list[float] = dataclasses.field(
        default_factory=list
    )  # grpo: one weight per objective.reward entry, summed as TRL's reward_weights; empty: 1.0 each
    group_size: Positive = 4  # grpo: completions sampled per prompt, at least 2 (TRL's num_generations)
    max_new_tokens: Positive = 16  # grpo: completion tokens sampled (TRL's max_completion_length)
    temperature: PositiveFloat = 1.0  # grpo: sampling temperature; log-probs are of the logits / temperature
    top_p: Annotated[float, Range(0, 1, lo_open=True)] = 1.0  # grpo: nucleus sampling, in (0, 1]
    epsilon: PositiveFloat = 0.2  # grpo: the ratio is clipped below at 1 - epsilon (TRL's epsilon)
    epsilon_high: NonNegativeFloat = 0.0  # grpo: clipped above at 1 + epsilon_high; 0: epsilon (TRL's epsilon_high)
    iterations: Positive = 1  # grpo: optimizer steps on each batch of rollouts (TRL's num_iterations)
    grpo_loss: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = (
        "dapo"  # grpo: token aggregation, TRL's loss_type: grpo (row means), bnpo, dr_grpo (/ rows x max_new_tokens), dapo
    )
    scale_rewards: Literal["group", "batch", "none"] = (
        "group"  # grpo: advantages divided by the group's (or batch's) reward std, or not (TRL's scale_rewards)
    )
