"""The optimizer: one optax chain — clip by global norm, AdamW, warmup + decay schedule."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from jaxdist.config import OptimConfig
from jaxdist.config.relative import decay_steps as wsd_decay_steps
from jaxdist.config.relative import warmup as warmup_of
from jaxdist.optim import schedules


def scaled_lr(cfg: OptimConfig, global_batch: int) -> float:
    """Large-batch LR scaling from `reference_batch` to the actual global batch (Goyal et al. 2017:
    linear; Hoffer et al. 2017 / Malladi et al. 2022: square root for adaptive optimizers)."""
    ratio = global_batch / cfg.reference_batch
    return cfg.lr * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[cfg.lr_scaling]


def schedule(cfg: OptimConfig, total_steps: int, global_batch: int) -> optax.Schedule:
    """Linear warmup from 0 to the peak, then cosine / linear decay to min_lr_ratio * peak, constant, or
    WSD (stable at the peak, then the last decay steps down to min_lr_ratio * peak)."""
    peak = scaled_lr(cfg, global_batch)
    warmup = min(warmup_of(cfg, total_steps), max(total_steps - 1, 0))
    decay_steps = max(total_steps - warmup, 1)
    end = peak * cfg.min_lr_ratio
    if cfg.schedule == "cosine":
        after = optax.cosine_decay_schedule(peak, decay_steps, alpha=cfg.min_lr_ratio)
    elif cfg.schedule == "linear":
        after = optax.linear_schedule(peak, end, decay_steps)
    elif cfg.schedule == "wsd":  # the peak, then the last decay_steps(...) decay (optim/schedules.py)
        decay = wsd_decay_steps(cfg, total_steps, warmup)
        after = schedules.wsd(peak, end, total_steps - warmup - decay, decay, cfg.decay_shape)
    else:
        after = optax.constant_schedule(peak)
    if warmup == 0:
        return after
    # Step 0 already learns (peak / warmup); the peak is reached at step warmup - 1.
    ramp = optax.linear_schedule(peak / warmup, peak, max(warmup - 1, 1))
    return optax.join_schedules([ramp, after], [warmup])


NO_DECAY = frozenset({"bq_NH", "bk_KH", "bv_KH"})  # Qwen2's q/k/v biases: vectors per head, no decay


def decay_mask(names_tree):
    """Weight decay on matrices only, judged from logical names so a stacked norm scale
    (`layers`, `embed`) counts as the vector it is per layer; biases (split per head) are not matrices."""
    return jax.tree_util.tree_map_with_path(
        lambda path, names: (
            len([n for n in names if n not in ("layers", "stage")]) >= 2
            and str(getattr(path[-1], "key", "")) not in NO_DECAY
        ),
        names_tree,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def scale_by_adam_frozen_variance(b1: float, b2: float, eps: float, freeze_step: int, floor: float = 0.01):
    """Adam's scaling whose second moment stops updating after `freeze_step` updates (1-bit Adam,
    Tang et al. 2021): Adam is then linear in the gradients, so error-feedback compression telescopes
    through it. Same state as optax.scale_by_adam (checkpoints are interchangeable); its updates match
    optax's for the first `freeze_step` updates (rtol 1e-6, tests/test_compress.py)."""

    def init(params):
        zeros = lambda: jax.tree.map(jnp.zeros_like, params)
        return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32), mu=zeros(), nu=zeros())

    def update(updates, state, params=None):
        frozen = state.count >= freeze_step
        mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, updates)
        nu = jax.tree.map(lambda v, g: jnp.where(frozen, v, b2 * v + (1 - b2) * g * g), state.nu, updates)
        count = state.count + 1
        nu_count = jnp.minimum(count, freeze_step).astype(jnp.float32)
        mu_c, nu_c = 1 - b1 ** count.astype(jnp.float32), 1 - b2**nu_count

        def scale(m, v):
            v = v / nu_c
            # A coordinate whose gradient was ~0 through the warm-up (a rare token's embedding row) would
            # divide by ~eps once frozen: floor it at `floor` times its tensor's mean second moment.
            v = jnp.where(frozen, jnp.maximum(v, floor * jnp.mean(v)), v)
            return (m / mu_c) / (jnp.sqrt(v) + eps)

        return jax.tree.map(scale, mu, nu), optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformation(init, update)


def make_optimizer(
    cfg: OptimConfig,
    total_steps: int,
    global_batch: int,
    decay_mask_tree=None,
    freeze_variance_at: int | None = None,
    variance_floor: float = 0.01,
):
    """Returns (optax transformation, schedule). `decay_mask_tree` marks tensors that get weight decay;
    `freeze_variance_at`: Adam's second moment is frozen after that many steps (compressed reducers)."""
    lr = schedule(cfg, total_steps, global_batch)
    parts = []
    if cfg.clip_norm > 0:
        parts.append(optax.clip_by_global_norm(cfg.clip_norm))
    parts.append(adamw(cfg, lr, decay_mask_tree, freeze_variance_at, variance_floor))
    return optax.chain(*parts), lr


def adamw(cfg: OptimConfig, lr, decay_mask_tree=None, freeze_variance_at: int | None = None, variance_floor=0.01):
    """AdamW with decoupled decay on `decay_mask_tree`'s tensors (after the clip); with
    `freeze_variance_at`, Adam's second moment frozen after that many steps."""
    if freeze_variance_at is None:
        return optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=decay_mask_tree)
    return optax.chain(  # optax.adamw's chain with the frozen-variance scaling
        scale_by_adam_frozen_variance(cfg.b1, cfg.b2, cfg.eps, freeze_variance_at, variance_floor),
        optax.add_decayed_weights(cfg.weight_decay, decay_mask_tree),
        optax.scale_by_learning_rate(lr),
    )


def schedule_notes(cfg, start: int = 0, changes: dict | None = None) -> list[str]:
    """Start-up lines when the schedule is not what the settings suggest: warm-up clamped to the run,
    or (on resume, `changes` = config key -> (checkpoint's, now)) a new length that changes the LR from
    the resumed step on."""
    o, notes = cfg.optim, []
    total = o.schedule_steps or cfg.train.steps
    if warmup_of(o, total) > total - 1:
        warm = max(total - 1, 0)
        notes.append(
            f"note: optim.warmup_steps={o.warmup_steps} does not fit the {total}-step LR schedule: warm-up "
            f"is clamped to {warm} steps, so the LR peaks at the end with {max(total - warm, 1)} step(s) of "
            "decay; lower optim.warmup_steps or set optim.schedule_steps"
        )
    changes = changes or {}
    cooled = [k for k in ("optim.decay_steps", "optim.decay_fraction", "optim.decay_shape") if k in changes]
    if start and o.schedule == "wsd" and cooled:
        decay = wsd_decay_steps(o, total, min(warmup_of(o, total), max(total - 1, 0)))
        notes.append(
            f"note: {', '.join(cooled)} changed: the LR now decays ({o.decay_shape}) over steps "
            f"{total - decay}..{total} to {o.min_lr_ratio:g} x its peak"
        )
    if start and ("train.steps" in changes or "optim.schedule_steps" in changes):
        steps = changes.get("train.steps", (cfg.train.steps,) * 2)[0]
        pinned = changes.get("optim.schedule_steps", (o.schedule_steps,) * 2)[0]
        before = pinned or steps
        old, new = (float(jnp.asarray(schedule(o, n, cfg.train.global_batch)(start))) for n in (before, total))
        if before != total and (old != new or o.schedule != "wsd"):  # WSD's stable phase continues unchanged
            notes.append(
                f"note: the LR schedule now spans {total} steps instead of {before}: from step {start} on "
                f"the LR follows the new schedule ({old:.3g} -> {new:.3g} at step {start}); pass "
                f"optim.schedule_steps={before} to keep the schedule the run had"
            )
    return notes
