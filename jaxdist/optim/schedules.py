"""Warmup-stable-decay (WSD): the LR stays at its peak after the warm-up and decays over the last steps.

Hägele et al. 2024 ("Scaling Laws and Compute-Optimal Training Beyond Fixed Training Durations"),
MiniCPM (Hu et al. 2024): the LR does not depend on the run's length until its decay starts, so a run
can be extended (a larger `--steps` continues the stable phase) or cooled down from any checkpoint (a
resume with `optim.decay_steps`). `adamw.schedule` joins this to the linear warm-up; the decay's length
is `config.relative.decay_steps`.
"""

from __future__ import annotations

import jax.numpy as jnp

SHAPES = ("linear", "cosine", "sqrt")


def wsd(peak: float, end: float, stable: int, decay: int, shape: str):
    """The schedule after the warm-up, counted from its end: `peak` for `stable` steps, then `decay`
    steps from `peak` towards `end` (reached at the step after the last); then `end`.

    Progress p = (count - stable) / decay in [0, 1]; the LR is end + (peak - end) * f(p) with f = 1 - p
    (linear), (1 + cos(pi p)) / 2 (cosine) or 1 - sqrt(p) (sqrt)."""
    if shape not in SHAPES:
        raise ValueError(f"decay shape {shape!r} is not one of {SHAPES}")

    def lr(count):
        p = jnp.clip((jnp.asarray(count, jnp.float32) - stable) / decay, 0.0, 1.0)
        f = {
            "linear": lambda: 1 - p,
            "cosine": lambda: 0.5 * (1 + jnp.cos(jnp.pi * p)),
            "sqrt": lambda: 1 - jnp.sqrt(p),
        }
        return end + (peak - end) * f[shape]()

    return lr
