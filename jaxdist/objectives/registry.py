"""Every `objective.method`, in one table: the loss it trains, whether it reads preference pairs, whether
it needs the frozen reference, and what it refuses. `lm` (next-token cross-entropy) brings nothing: the
step is the one it always was, bit for bit. Nothing else compares objective names: consumers ask here.

Adding an objective: its loss in losses.py (checked against TRL by a committed fixture), one `Objective`
entry in `OBJECTIVES`, and its name in config/tuning_sections.py's `objective.method` values (and, when it reads
pairs, in `jaxdist.data.prefprep.PAIRED`); `tests/test_objectives.py` checks the three agree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jax.sharding import Mesh

from jaxdist.config import Config
from jaxdist.errors import JaxdistError
from jaxdist.objectives import grpo, grpo_stage, losses, pairs
from jaxdist.parallel.loss import ApplyFn
from jaxdist.reduce import registry as reduce_registry
from jaxdist.reduce.gradients import GradientStage


@dataclasses.dataclass(frozen=True)
class Objective:
    name: str
    loss: Callable | None = None  # (logps_B2, counts_B2, ref_B2 | None, objective cfg) -> losses.Terms
    needs_reference: bool = False  # the frozen reference's log-probs enter the loss
    paired: bool = False  # reads preference pair records (prepare --preference)
    rollouts: bool = False  # samples completions of prompt records (prepare --prompts) each step: GRPO


OBJECTIVES = {
    "lm": Objective("lm"),
    "dpo": Objective("dpo", losses.dpo, needs_reference=True, paired=True),
    "simpo": Objective("simpo", losses.simpo, paired=True),
    "orpo": Objective("orpo", losses.orpo, paired=True),
    "grpo": Objective("grpo", rollouts=True),  # needs the reference when objective.beta > 0
}


def objective(cfg: Config) -> Objective:
    return OBJECTIVES[cfg.objective.method]


def is_default(cfg: Config) -> bool:
    """`lm`: the program is built exactly as before the objective section existed."""
    return cfg.objective.method == "lm"


def rollouts(cfg: Config) -> bool:
    """GRPO: each step samples, scores and trains on rollouts of prompt records."""
    return objective(cfg).rollouts


def grpo_settings(cfg: Config) -> grpo.GRPO:
    """The GRPO knobs of the `objective` section (validated by `grpo.GRPO`)."""
    o = cfg.objective
    return grpo.GRPO(
        group_size=o.group_size,
        beta=o.beta,
        epsilon=o.epsilon,
        epsilon_high=o.epsilon_high or None,
        loss_type=o.grpo_loss,
        scale_rewards=o.scale_rewards,
        max_new_tokens=o.max_new_tokens,
        temperature=o.temperature,
        top_p=o.top_p,
        iterations=o.iterations,
    )


def _pair_loss(o: Objective) -> Callable:
    if o.loss is None:
        raise RuntimeError(f"objective {o.name!r} has no pair loss: the plain language-model program trains it")
    return o.loss


def stage(apply_fn: ApplyFn, cfg: Config) -> GradientStage:
    o = objective(cfg)
    if o.rollouts:
        return grpo_stage.grpo_stage(apply_fn, cfg, grpo_settings(cfg))
    return pairs.pair_stage(apply_fn, cfg, _pair_loss(o), o.needs_reference)


def eval_step(apply_fn: ApplyFn, cfg: Config) -> Callable | None:
    """The held-out pairs' sums; None for GRPO (its evaluation samples held-out prompts: the reward)."""
    o = objective(cfg)
    return None if o.rollouts else pairs.pair_eval(apply_fn, cfg, _pair_loss(o), o.needs_reference)


def needs_reference(cfg: Config) -> bool:
    """The frozen reference's log-probs enter the loss (GRPO: when its KL weight objective.beta > 0)."""
    return objective(cfg).needs_reference or (objective(cfg).rollouts and cfg.objective.beta > 0)


def plan_note(cfg: Config) -> str | None:
    """What the planner's figures leave out for this objective (None for lm): `python -m jaxdist.plan` says it."""
    m = cfg.objective.method
    if is_default(cfg):
        return None
    copy = "the reference copy counted" if keeps_reference_copy(cfg) else "no reference copy"
    if rollouts(cfg):
        return (
            f"objective.method={m}: sized is the train step on the rollouts ({copy}, rows two wide); the rollout "
            "decoding (its KV cache and its time, often most of a GRPO step) and the reference forward are not modeled"
        )
    return (
        f"objective.method={m}: memory with {copy} and the pair batch; step time and activations are an LM step's "
        "on one row per pair, without the rejected row's forward and backward nor the reference forward"
    )


def keeps_reference_copy(cfg: Config) -> bool:
    """The stage's state holds a frozen copy of the parameters (a reference without LoRA)."""
    return needs_reference(cfg) and not cfg.lora.rank


def check(cfg: Config, mesh: Mesh) -> None:
    """One-line errors for what a non-default objective cannot do (yet), before anything is traced."""
    if is_default(cfg):
        return
    unsupported(cfg, mesh, f"objective.method={cfg.objective.method}")
    if rollouts(cfg):
        g, o = grpo_settings(cfg), cfg.objective
        if cfg.train.global_batch % g.group_size:
            raise JaxdistError(
                f"train.global_batch={cfg.train.global_batch} must be a multiple of objective.group_size="
                f"{g.group_size} (each prompt's completions make one group)"
            )
        if not o.reward:
            raise JaxdistError(
                "objective.method=grpo needs objective.reward: a built-in (answer_match, digits) or FILE.py:NAME"
            )
        if o.reward_weights and len(o.reward_weights) != len(o.reward):
            raise JaxdistError(
                f"objective.reward_weights has {len(o.reward_weights)} weights for {len(o.reward)} objective.reward "
                "functions; give one per function (or none: 1.0 each)"
            )
        if g.max_new_tokens >= cfg.model.seq_len:
            raise JaxdistError(
                f"objective.max_new_tokens={g.max_new_tokens} leaves no room for a prompt in model.seq_len="
                f"{cfg.model.seq_len}; lower it or raise model.seq_len"
            )


def unsupported(cfg: Config, mesh: Mesh, m: str) -> None:
    """The refusals every objective beyond `lm` shares (DPO's and GRPO's), naming it as `m`."""
    refusals = [
        (
            reduce_registry.method(cfg) is not reduce_registry.IMPLICIT,
            f"reduce.method={cfg.reduce.method}",
            "use reduce.method=implicit",
        ),
        (mesh.shape.get("pp", 1) > 1, "pipeline parallelism (pp > 1)", "use fsdp/tp/dp (pp=1)"),
        (mesh.shape.get("cp", 1) > 1, "context parallelism (cp > 1)", "use cp=1"),
        (cfg.offload.params == "host", "offload.params=host", "use offload.params=none"),
        (cfg.data.document_mask, "data.document_mask=true", "turn it off (each row holds one sequence)"),
    ]
    for bad, what, fix in refusals:
        if bad:
            raise JaxdistError(f"{m} does not support {what} yet; {fix}")
