"""Settings relative to the run's length, resolved to steps at start-up, so one config fits a 30-step
fine-tune and a 3,000-step one: `optim.warmup_fraction`, `train.evals`, `checkpoint.saves`.

Each, when > 0, decides: the step-count key it replaces is set from it (warmup_steps to 0, as the
schedule computes the fraction of its own length; eval_every and checkpoint.every to
ceil(train.steps / count)). config.yaml then records the values the run used, and a key that had no
effect never differs between two runs' records.
"""

from __future__ import annotations

import math


def warmup(optim, schedule_steps: int) -> int:
    """Warm-up steps of a schedule `schedule_steps` long (before clamping to the schedule)."""
    return int(optim.warmup_fraction * schedule_steps) if optim.warmup_fraction > 0 else optim.warmup_steps


def resolve(cfg):
    """`cfg` with the relative settings turned into the step counts the run uses."""
    steps, sections = cfg.train.steps, {}
    if cfg.optim.warmup_fraction > 0 and cfg.optim.warmup_steps:
        sections["optim"] = dict(warmup_steps=0)
    if cfg.train.evals:
        sections["train"] = dict(eval_every=math.ceil(steps / cfg.train.evals))
    if cfg.checkpoint.saves:
        sections["checkpoint"] = dict(every=math.ceil(steps / cfg.checkpoint.saves))
    return cfg.replace(**sections) if sections else cfg


def decay_steps(optim, total: int, warmup: int) -> int:
    """Steps of WSD's final decay in a `total`-step schedule: optim.decay_steps, else decay_fraction of
    `total` (rounded down), at most what the warm-up leaves, at least 1."""
    wanted = optim.decay_steps or math.floor(optim.decay_fraction * total)
    return max(min(wanted, total - warmup), 1)


def _wsd_part(o, total: int, warm: int) -> str:
    """Where WSD's decay starts."""
    decay = decay_steps(o, total, warm)
    source = f"optim.decay_steps={o.decay_steps}" if o.decay_steps else f"optim.decay_fraction={o.decay_fraction:g}"
    return f" over the last {decay} steps from step {total - decay} ({source}, {o.decay_shape})"


def cadence_line(cfg) -> str:
    """The schedule and cadence as resolved, saying which relative setting each comes from."""
    o, t, c = cfg.optim, cfg.train, cfg.checkpoint
    total = o.schedule_steps or t.steps
    warm = min(warmup(o, total), max(total - 1, 0))
    parts = [
        f"schedule: {t.steps} steps, warm-up {warm}"
        + (f" (optim.warmup_fraction={o.warmup_fraction:g} of {total})" if o.warmup_fraction > 0 else "")
        + (f", {o.schedule} decay to {o.min_lr_ratio:g} x lr" if o.schedule != "constant" else ", constant lr")
        + (_wsd_part(o, total, warm) if o.schedule == "wsd" else ""),
        (f"eval every {t.eval_every} steps" if t.eval_every else "no eval")
        + (f" (train.evals={t.evals})" if t.evals else ""),
        (f"checkpoint every {c.every} steps" if c.every else "no checkpoints")
        + (f" (checkpoint.saves={c.saves})" if c.saves else ""),
    ]
    return "; ".join(parts)
