"""Every `reduce.method`, in one table: what the method brings to the train step, and what it refuses.

Each entry (`Method`) bundles the callables and facts that used to be decided by comparing method names
in several modules (torchtitan's `ModelSpec` does the same for models): the gradient stage, the
optimizer that replaces clip + AdamW, the codec of the explicit reduction, the dense warm-up and Adam's
variance freeze, DiLoCo's sync period, the features it refuses. `method(cfg)` picks the entry `cfg`
names; `resolve(cfg, mesh, model)` picks the one a run on `mesh` uses (a per-replica method on one
replica trains as `implicit`, warned). Nothing else compares method names: consumers ask here.

Adding a reducer: its module (the stage, its optimizer if any) and one `Method` entry in `METHODS` and
config/reduce_section.py's `reduce.method` values (CONTRIBUTING.md, "How to add a reducer").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax.numpy as jnp
from jax.sharding import Mesh

from jaxdist.adapters import tree as adapters
from jaxdist.config import Config
from jaxdist.errors import JaxdistError
from jaxdist.models.resolve import ResolvedModel, compute_dtype
from jaxdist.parallel import context
from jaxdist.parallel.loss import ApplyFn
from jaxdist.reduce import compress, demo, dgc, diloco, explicit
from jaxdist.reduce.gradients import GradientStage, implicit_gradients, partial_gradients

StageBuilder = Callable[..., GradientStage]  # (apply_fn, cfg, mesh, model: ResolvedModel) -> GradientStage


def _no_checks(cfg: Config, mesh: Mesh) -> None:
    return None


@dataclasses.dataclass(frozen=True)
class Method:
    """What one `reduce.method` brings. Only `name` and `stage` are required; the rest default to
    "like the dense explicit reduction"."""

    name: str
    stage: StageBuilder  # the gradient stage (micro-batch loop, loss/grad, the reduction over reduce.axis)
    # Runs per replica in a shard_map manual over reduce.axis, its state under a leading replica axis:
    # parameters must be replicated over the axis; LoRA and offload.params=host refuse it.
    per_replica: bool = True
    compresses: bool = True  # sends fewer bytes than a dense float32 all-reduce (its ratio is worth measuring)
    codec: Callable[[Config, int], compress.Codec] | None = None  # (cfg, replicas): the explicit reduction's lossy sum
    # (cfg, lr_schedule, decay_mask_tree) -> what the step applies to the stage's output instead of clip + AdamW
    optimizer: Callable | None = None
    # (cfg, replicas) -> the stage's own per-replica reducer, compiled alone by measure.compile_reduction
    replica_reducer: Callable | None = None
    warms_up: bool = False  # dense (DGC: denser) for the first warmup_steps(cfg) steps
    freezes_variance: bool = False  # reduce.freeze_variance applies: Adam's second moment frozen after the warm-up
    sync_every: Callable[[Config], int] = lambda cfg: 1  # optimizer steps per exchange over reduce.axis
    # (cfg) -> [(first step, end step, phase)] of the warm-up: measure reads each phase's bytes from its name scope
    phases: Callable[[Config], list] | None = None
    checks: Callable[[Config, Mesh], None] = _no_checks  # one-line errors for what it cannot do on (cfg, mesh)
    variant: Callable[[Config], Method] | None = None  # another entry that a knob of this method switches to
    # optim.name's optimizer applies (DiLoCo: as the inner optimizer); False: `optimizer` is the method's
    # own update rule (DGC, DeMo), which replaces AdamW and refuses any other optim.name
    takes_optim: bool = True


# ---------------------------------------------------------------------------------------------------
# The gradient stages (the reducer modules hold the algorithms; these wire them to a config).


def _implicit_stage(apply_fn: ApplyFn, cfg: Config, mesh: Mesh, model: ResolvedModel) -> GradientStage:
    order_T = context.sequence_order(cfg, mesh)  # cp > 1: positions in the load-balanced order
    if cfg.lora.rank:  # gradients of the adapters only
        split = lambda p: (adapters.trainable(p), adapters.frozen(p))
        return partial_gradients(apply_fn, cfg.train.grad_accum_steps, split, adapters.combine, order_T)
    return implicit_gradients(apply_fn, cfg.train.grad_accum_steps, order_T, cfg.reduce.dtype)


def _explicit_stage(apply_fn: ApplyFn, cfg: Config, mesh: Mesh, model: ResolvedModel) -> GradientStage:
    return explicit.explicit_gradients(
        apply_fn, cfg, mesh, model, reducer(cfg, mesh, model.abstract, model.stacked_dims)
    )


def _diloco_stage(apply_fn: ApplyFn, cfg: Config, mesh: Mesh, model: ResolvedModel) -> GradientStage:
    # The pseudo-gradient crosses the axis dense or through a codec, with error feedback and no warm-up
    # (Δ is not Adam's input).
    outer = cfg.replace(reduce=dict(method=cfg.reduce.diloco.outer_codec, start_step=0, warmup_fraction=0.0))
    exchange = reducer(outer, mesh, model.abstract, model.stacked_dims)
    return diloco.diloco_gradients(apply_fn, cfg, mesh, model, exchange)


def _diloco_checks(cfg: Config, mesh: Mesh) -> None:
    cp = context.size(mesh)
    if cp > 1:
        raise JaxdistError(f"reduce.method=diloco with cp={cp} is not supported; use cp=1 or another reduce.method")


def _dense_warmup(cfg: Config) -> list:
    return [(0, min(warmup_steps(cfg), cfg.train.steps), "warmup")]


def _dgc_phases(cfg: Config) -> list:  # each density stage of the sparsity warm-up under its own scope
    return [(a, b, i) for i, (a, b, _) in enumerate(dgc.stages(cfg))]


def _topk_variant(cfg: Config) -> Method:
    return METHODS["topk"] if cfg.reduce.topk.dgc == "off" else DGC


IMPLICIT = Method("implicit", _implicit_stage, per_replica=False, compresses=False)
DGC = Method(  # reduce.method=topk with reduce.topk.dgc on (its default): momentum correction, its own optimizer
    "topk",
    lambda apply_fn, cfg, mesh, model: dgc.dgc_gradients(apply_fn, cfg, mesh, model),
    optimizer=dgc.optimizer,  # the stage returns DGC's summed sparse update, clipped per replica
    takes_optim=False,
    replica_reducer=dgc.reducer,
    warms_up=True,
    phases=_dgc_phases,
)

# reduce.method -> Method: exactly the values config/reduce_section.py accepts (tests/test_registry.py).
METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        IMPLICIT,
        Method("dense", _explicit_stage, compresses=False),
        Method(
            "topk",
            _explicit_stage,
            codec=lambda cfg, n: compress.topk(cfg.reduce.ratio),
            warms_up=True,
            freezes_variance=True,
            phases=_dense_warmup,
            variant=_topk_variant,
        ),
        Method(
            "powersgd",
            _explicit_stage,
            codec=lambda cfg, n: compress.powersgd(cfg.reduce.powersgd.rank, cfg.train.seed),
            warms_up=True,
            freezes_variance=True,
            phases=_dense_warmup,
        ),
        Method(
            "int8",
            _explicit_stage,
            codec=lambda cfg, n: compress.int8(cfg.reduce.int8.block_size, n if cfg.reduce.error_feedback else None),
        ),
        Method(
            "diloco",
            _diloco_stage,
            optimizer=lambda cfg, lr_schedule, mask: diloco.outer_optimizer(),  # the stage returns the outer move
            sync_every=lambda cfg: cfg.reduce.diloco.sync_every,
            checks=_diloco_checks,
        ),
        Method(
            "demo",
            lambda apply_fn, cfg, mesh, model: demo.demo_gradients(apply_fn, cfg, mesh, model),
            optimizer=demo.optimizer,  # the stage returns DeMo's sign update: the step applies LR and decay
            takes_optim=False,
        ),
    )
}

# The baseline compression ratios are measured against: the dense float32 explicit reduction.
BASELINE = {"method": "dense", "dtype": "float32"}


# ---------------------------------------------------------------------------------------------------
# What the rest of jaxdist asks.


def method(cfg: Config) -> Method:
    """The entry `cfg.reduce.method` names (topk: DGC unless reduce.topk.dgc=off)."""
    name = cfg.reduce.method
    if name not in METHODS:
        raise JaxdistError(f"reduce.method={name!r} is not one of {', '.join(METHODS)}; pick one of them")
    m = METHODS[name]
    return m.variant(cfg) if m.variant else m


def resolve(cfg: Config, mesh: Mesh, model: ResolvedModel) -> Method:
    """The entry a run of `cfg` on `mesh` uses: `method(cfg)`, or `IMPLICIT` when the reduce axis has one
    replica (nothing crosses it; warned for a method that would compress). Errors for a reduce axis that
    is not in the mesh, or parameters sharded over it."""
    m = method(cfg)
    if not m.per_replica:
        return m
    explicit.check_replicated(cfg, mesh, model)
    if mesh.shape[cfg.reduce.axis] == 1:  # and XLA rejects a psum over a size-1 manual axis
        if m.compresses:
            explicit.warn_one_replica(cfg)
        return IMPLICIT
    return m


def check(cfg: Config, mesh: Mesh) -> None:
    """Every up-front refusal of `cfg.reduce.method` on `mesh`, as one-line errors."""
    m = method(cfg)
    if m.per_replica and cfg.lora.rank:
        raise JaxdistError(
            f"lora.rank > 0 with reduce.method={cfg.reduce.method}: adapters train with the implicit "
            "gradient reduction only (their gradients are small); use reduce.method=implicit"
        )
    if m.per_replica and cfg.offload.params == "host":
        raise JaxdistError(
            f"offload.params=host is not supported with reduce.method={cfg.reduce.method} (its per-replica "
            "gradient stage keeps parameters on the device); use reduce.method=implicit or offload.params=none"
        )
    if m is IMPLICIT and cfg.reduce.dtype == "bfloat16" and compute_dtype(cfg.model) == jnp.float32:
        raise JaxdistError(
            "reduce.dtype=bfloat16 with reduce.method=implicit reduces the bf16 weight gradients of "
            "model.compute_dtype=bfloat16; with float32 compute nothing would change: set "
            "model.compute_dtype=bfloat16, or reduce.dtype=float32"
        )
    if not m.takes_optim and cfg.optim.name != "adamw":
        raise JaxdistError(
            f"optim.name={cfg.optim.name} with reduce.method={cfg.reduce.method}: that method applies its own "
            f"update rule ({'DGC' if m is DGC else 'DeMo'}), not the optimizer; use optim.name=adamw, or "
            "reduce.method=dense, int8, powersgd, diloco or topk with reduce.topk.dgc=off"
        )
    m.checks(cfg, mesh)


def reducer(cfg: Config, mesh: Mesh, abstract_params, batch_dims) -> explicit.Reducer:
    """The explicit reduction `cfg.reduce` asks for: dense, or its codec with error feedback after the
    dense warm-up. A compressed method on a size-1 axis warns and goes dense. (The codec of the name
    itself: DiLoCo's outer_codec=topk is plain top-k.)"""
    r, axis = cfg.reduce, cfg.reduce.axis
    replicas, m = mesh.shape[axis], METHODS[r.method]
    if m.codec is None or replicas == 1:
        if m.compresses:
            explicit.warn_one_replica(cfg)
        return explicit.dense(axis, jnp.dtype(r.dtype))
    lossy = explicit.compressed(m.codec(cfg, replicas), axis, replicas, abstract_params, batch_dims, r.error_feedback)
    return explicit.with_warmup(explicit.dense(axis), lossy, warmup_steps(cfg))


def reduction(cfg: Config, mesh: Mesh, abstract_params, batch_dims) -> explicit.Reducer:
    """The reducer a stage of `cfg` runs per replica, alone (measure.compile_reduction)."""
    m, replicas = method(cfg), mesh.shape[cfg.reduce.axis]
    if m.replica_reducer and replicas > 1:
        return m.replica_reducer(cfg, replicas)
    return reducer(cfg, mesh, abstract_params, batch_dims)


def warmup_steps(cfg: Config) -> int:
    """Dense steps before a warmed-up method compresses: max(start_step, warmup_fraction·steps); else 0."""
    r = cfg.reduce
    if not method(cfg).warms_up:
        return 0
    return max(r.start_step, math.ceil(r.warmup_fraction * cfg.train.steps))


def warmup_phases(cfg: Config) -> list:
    """[(first step, end step, phase)] of the warm-up, each phase's bytes under its own name scope."""
    m = method(cfg)
    return m.phases(cfg) if m.phases else []


def variance_freeze_step(cfg: Config, mesh: Mesh) -> int | None:
    """The step after which Adam's second moment stays frozen (None: never), so that compression
    error feedback telescopes through Adam (1-bit Adam). Only where a method compresses over replicas."""
    r = cfg.reduce
    if not (method(cfg).freezes_variance and r.freeze_variance) or mesh.shape.get(r.axis, 1) == 1:
        return None
    return max(warmup_steps(cfg), 1)


def sync_every(cfg: Config) -> int:
    """Optimizer steps per exchange over the reduce axis: DiLoCo's sync period, else 1."""
    return method(cfg).sync_every(cfg)


def is_baseline(cfg: Config) -> bool:
    """Whether `cfg` reduces as the baseline that compression ratios are measured against."""
    return all(getattr(cfg.reduce, k) == v for k, v in BASELINE.items())
