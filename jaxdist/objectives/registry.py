"""Every `objective.method`, in one table: the loss it trains, whether it reads preference pairs, whether
it needs the frozen reference, and what it refuses. `lm` (next-token cross-entropy) brings nothing: the
step is the one it always was, bit for bit. Nothing else compares objective names: consumers ask here.

Adding an objective: its loss in losses.py (checked against TRL by a committed fixture), one `Objective`
entry in `OBJECTIVES`, and its name in config/schema.py's `objective.method` values (and, when it reads
pairs, in `jaxdist.data.prefprep.PAIRED`); `tests/test_objectives.py` checks the three agree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jax.sharding import Mesh

from jaxdist.config import Config
from jaxdist.errors import JaxdistError
from jaxdist.objectives import losses, pairs
from jaxdist.reduce import registry as reduce_registry
from jaxdist.reduce.gradients import GradientStage


@dataclasses.dataclass(frozen=True)
class Objective:
    name: str
    loss: Callable | None = None  # (logps_B2, counts_B2, ref_B2 | None, objective cfg) -> losses.Terms
    needs_reference: bool = False  # the frozen reference's log-probs enter the loss
    paired: bool = False  # reads preference pair records (prepare --preference)


OBJECTIVES = {
    "lm": Objective("lm"),
    "dpo": Objective("dpo", losses.dpo, needs_reference=True, paired=True),
    "simpo": Objective("simpo", losses.simpo, paired=True),
    "orpo": Objective("orpo", losses.orpo, paired=True),
}


def objective(cfg: Config) -> Objective:
    return OBJECTIVES[cfg.objective.method]


def is_default(cfg: Config) -> bool:
    """`lm`: the program is built exactly as before the objective section existed."""
    return objective(cfg).loss is None


def stage(apply_fn, cfg: Config) -> GradientStage:
    o = objective(cfg)
    return pairs.pair_stage(apply_fn, cfg, o.loss, o.needs_reference)


def eval_step(apply_fn, cfg: Config) -> Callable:
    o = objective(cfg)
    return pairs.pair_eval(apply_fn, cfg, o.loss, o.needs_reference)


def keeps_reference_copy(cfg: Config) -> bool:
    """The stage's state holds a frozen copy of the parameters (a reference without LoRA)."""
    return objective(cfg).needs_reference and not cfg.lora.rank


def check(cfg: Config, mesh: Mesh) -> None:
    """One-line errors for what a non-default objective cannot do (yet), before anything is traced."""
    if is_default(cfg):
        return
    unsupported(cfg, mesh, f"objective.method={cfg.objective.method}")


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
