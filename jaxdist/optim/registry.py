"""Every `optim.name`, in one table: the optax transformation it builds, which tensors it takes, the
state it keeps, and what it refuses.

`entry(cfg)` resolves the name once; `make(...)` builds (clip + the entry's transformation, LR
schedule): `adamw` is exactly `adamw.make_optimizer` (bit for bit what jaxdist trained with before
the registry). The reducer registry composes with it: reduce methods whose own optimizer replaces
clip + AdamW (DGC, DeMo) refuse another `optim.name` (jaxdist/reduce/registry.py, `check`); DiLoCo's
inner optimizer and the dense and compressed reductions take any entry.

Adding an optimizer: its transformation (a module here if optax lacks it), one `Optimizer` entry in
`OPTIMIZERS` and its name in config/run_sections.py's `optim.name` values (CONTRIBUTING.md, "Add an
optimizer"; tests/test_optimizers.py checks both agree).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import optax
from jax.sharding import PartitionSpec as P

from jaxdist.config import OptimConfig
from jaxdist.errors import JaxdistError
from jaxdist.optim import adamw, muon


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """What one `optim.name` brings."""

    name: str
    # (optim cfg, lr schedule, names tree of the trained tensors, freeze_variance_at, variance_floor)
    # -> the transformation after the gradient clip
    build: Callable[..., optax.GradientTransformation]
    # (tensor path "a/b/c", logical names) -> float32 state values it keeps per entry of that tensor
    # (the planner's optimizer memory; the checkpoint's opt_state holds exactly these)
    state_floats: Callable[[str, tuple], int]
    counters: int  # int32 step counters in its state (its own and the LR schedule's)
    takes: str  # which tensors it updates, in words (docs, --help)


def _adamw(cfg: OptimConfig, lr, names, freeze, floor):
    return adamw.adamw(cfg, lr, adamw.decay_mask(names), freeze, floor)


def _muon(cfg: OptimConfig, lr, names, freeze, floor):
    return muon.muon(cfg, lr, names, _adamw(cfg, lr, names, freeze, floor))


def _lion(cfg: OptimConfig, lr, names, freeze, floor):
    # Lion (Chen et al. 2023): sign of b1-interpolated momentum; optim.b2 is its momentum decay.
    return optax.lion(lr, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=adamw.decay_mask(names))


OPTIMIZERS: dict[str, Optimizer] = {
    o.name: o
    for o in (
        Optimizer("adamw", _adamw, lambda key, names: 2, 2, "every tensor (mu and nu per entry)"),
        Optimizer(
            "muon",
            _muon,
            lambda key, names: 1 if muon.matrix_axes(key, names) else 2,
            3,  # Adam's, and each part's schedule
            "Muon: the layers' weight matrices (per layer, per expert; momentum per entry); AdamW: "
            "embeddings, head, norms, biases, router (mu and nu)",
        ),
        Optimizer("lion", _lion, lambda key, names: 1, 2, "every tensor (one momentum per entry)"),
    )
}


def entry(cfg: OptimConfig) -> Optimizer:
    """The entry `optim.name` names."""
    if cfg.name not in OPTIMIZERS:
        raise JaxdistError(f"optim.name={cfg.name!r} is not one of {', '.join(OPTIMIZERS)}; pick one of them")
    return OPTIMIZERS[cfg.name]


def make(
    cfg: OptimConfig,
    total_steps: int,
    global_batch: int,
    names_tree,
    freeze_variance_at: int | None = None,
    variance_floor: float = 0.01,
):
    """(clip + the entry's transformation, LR schedule) for the trained tensors named by `names_tree`
    (logical-name tuples). `freeze_variance_at`: Adam's second moment (where the entry keeps one)
    stops updating after that many steps (compressed reducers)."""
    e = entry(cfg)
    if e.name == "adamw":  # the chain jaxdist has always built
        return adamw.make_optimizer(
            cfg, total_steps, global_batch, adamw.decay_mask(names_tree), freeze_variance_at, variance_floor
        )
    lr = adamw.schedule(cfg, total_steps, global_batch)
    parts = [optax.clip_by_global_norm(cfg.clip_norm)] if cfg.clip_norm > 0 else []
    parts.append(e.build(cfg, lr, names_tree, freeze_variance_at, variance_floor))
    return optax.chain(*parts), lr


def state_specs(cfg: OptimConfig, tx, opt_state, param_specs):
    """PartitionSpecs of the optimizer state: each params-shaped tensor sharded like its parameter, the
    rest (counters) replicated. AdamW through optax.tree_map_params (as always); the others, whose
    optax.partition state holds params-shaped trees with masked-out entries, by path: a state tensor
    whose trailing dict keys are a parameter's path and whose shape is its shape takes its spec."""
    is_spec = lambda x: isinstance(x, P)
    if entry(cfg).name == "adamw":
        return optax.tree_map_params(
            tx, lambda _, s: s, opt_state, param_specs, transform_non_params=lambda _: P(), is_leaf=is_spec
        )
    by_key = {muon.path_key(p): s for p, s in jax.tree_util.tree_flatten_with_path(param_specs, is_leaf=is_spec)[0]}

    def spec(path, leaf):
        tail = []
        for k in reversed(path):
            if not isinstance(k, jax.tree_util.DictKey):
                break
            tail.insert(0, k)
        return by_key.get(muon.path_key(tail), P()) if getattr(leaf, "ndim", 0) else P()

    return jax.tree_util.tree_map_with_path(spec, opt_state)
