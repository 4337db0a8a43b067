"""The compiled program: sharded state, the train step and the eval step.

One train step: tokens (global, sharded `batch -> (dp, fsdp)`) -> gradient stage (micro-batch loop,
loss/grad, data-parallel reduction) -> non-finite guard -> clip + AdamW -> new state (donated).

The gradient stage is swappable: `implicit_gradients` lets XLA insert the data-parallel all-reduce;
`jaxdist.parallel.reduce` replaces it with an explicit, once-per-step (optionally compressed) one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist import sharding
from jaxdist.config import Config
from jaxdist.errors import JaxdistError
from jaxdist.gradients import GradientStage, implicit_gradients, token_loss_sums, without_aux
from jaxdist.mesh import axis_size
from jaxdist.models.llama import document_segments
from jaxdist.optim import decay_mask, make_optimizer
from jaxdist.parallel import context, diloco, pipeline, reduce
from jaxdist.parallel import moe as moe_parallel
from jaxdist.resolve import ResolvedModel, compute_dtype, make_model, resolve  # noqa: F401 (re-exported)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer steps taken
    params: Any  # nested dict of float32 arrays (the model's nnx.Param values)
    opt_state: Any
    reducer_state: Any  # state of the gradient stage (error-feedback residuals, ...); () if none
    skipped: jax.Array  # int32: consecutive steps skipped for non-finite loss or gradients


def tree_where(pred, on_true, on_false):
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


@dataclasses.dataclass(frozen=True)
class Program:
    """Everything compiled for one (config, mesh): build with `build_program`."""

    cfg: Config
    mesh: Mesh
    rules: dict
    graphdef: Any
    param_names: Any  # pytree of logical-name tuples
    param_specs: Any  # pytree of PartitionSpecs
    state_shardings: TrainState
    batch_sharding: NamedSharding
    tx: optax.GradientTransformation
    lr_schedule: optax.Schedule
    gradients: GradientStage
    init_state: Callable  # (seed) -> TrainState, created directly in its shards
    train_step: Callable  # (state, tokens) -> (state, metrics)
    eval_step: Callable  # (params, tokens) -> (loss_sum, count)
    abstract_state: TrainState
    apply_fn: Callable  # (params, tokens_BT) -> logits_BTV; features=True: loss.Head; pipelined when pp > 1 (then trace it under jax.set_mesh)
    model: ResolvedModel  # names, specs, shapes and pipeline plan of the parameters

    @property
    def pipeline(self):  # jaxdist.parallel.pipeline.Plan when pp > 1 (params then store the stack by stage)
        return self.model.pipeline

    def batch_shards(self) -> int:
        return axis_size(self.mesh, self.batch_sharding.spec[0])


def check_batch(cfg: Config, mesh: Mesh, rules) -> None:
    shards = axis_size(mesh, sharding.batch_spec(rules)[0])
    per_step = cfg.train.grad_accum_steps * shards
    if cfg.train.global_batch % per_step:
        raise JaxdistError(
            f"train.global_batch={cfg.train.global_batch} must be divisible by train.grad_accum_steps="
            f"{cfg.train.grad_accum_steps} x {shards} batch shards (dp*fsdp*ep); use a multiple of {per_step}"
        )


def build_program(cfg: Config, mesh: Mesh, gradient_stage: Callable | None = None) -> Program:
    """Resolve shardings, build the optimizer and jit the steps for `cfg` on `mesh`.

    `gradient_stage(apply_fn, cfg, mesh, model: ResolvedModel) -> GradientStage` overrides the default
    choice made from `cfg.reduce.method`.
    """
    rules = sharding.make_rules(cfg.mesh.rules)
    check_batch(cfg, mesh, rules)
    moe_parallel.check(cfg, mesh)
    context.check(cfg, mesh, rules)
    order_T = context.sequence_order(cfg, mesh)  # cp > 1: positions in the load-balanced order
    model = resolve(cfg, mesh, rules)
    graphdef, param_names, param_specs, layout = model.graphdef, model.names, model.specs, model.pipeline

    tx, lr_schedule = make_optimizer(
        cfg.optim,
        cfg.optim.schedule_steps or cfg.train.steps,
        cfg.train.global_batch,
        decay_mask(param_names),
        reduce.variance_freeze_step(cfg, mesh),
        cfg.reduce.variance_floor,
    )

    eos_id = document_eos(cfg, layout)
    if layout:  # pp > 1: the layer stack runs as a pipeline schedule
        apply_fn = pipeline.pipelined_apply(graphdef, layout, order_T)
    else:

        def apply_fn(params, tokens_BT, features=False):
            segment_ids_BT = None if eos_id is None else document_segments(tokens_BT, eos_id)
            return nnx.merge(graphdef, params)(tokens_BT, segment_ids_BT, order_T, features=features)

    stage = (gradient_stage or select_gradient_stage)(apply_fn, cfg, mesh, model)
    if stage.name == "explicit-diloco":  # its replicas run the inner optimizer; the step applies the outer move
        tx = diloco.outer_optimizer()

    def init_state(seed):
        params = model.init_params(cfg, rules, seed)
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=tx.init(params),
            reducer_state=stage.init(params),
            skipped=jnp.zeros((), jnp.int32),
        )

    abstract_state = jax.eval_shape(lambda: init_state(0))
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    opt_specs = optax.tree_map_params(
        tx, lambda _, s: s, abstract_state.opt_state, param_specs, transform_non_params=lambda _: P(), is_leaf=is_spec
    )
    reducer_specs = stage.state_specs(param_specs)
    state_specs = TrainState(
        step=P(), params=param_specs, opt_state=opt_specs, reducer_state=reducer_specs, skipped=P()
    )
    state_shardings = sharding.named(mesh, state_specs)
    opt_on_device = state_shardings.opt_state
    if cfg.optim.offload == "host":  # optimizer state lives in pinned host memory between steps
        state_shardings = dataclasses.replace(
            state_shardings, opt_state=jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), opt_on_device)
        )
    batch_sharding = NamedSharding(mesh, sharding.batch_spec(rules))
    scalar = NamedSharding(mesh, P())

    def train_step(state: TrainState, tokens):
        grads, loss, reducer_state, extra = stage.apply(state.params, tokens, state.reducer_state, state.step)
        if cfg.optim.offload == "host":  # stream it in for the update only; out_shardings send it back
            state = dataclasses.replace(state, opt_state=jax.device_put(state.opt_state, opt_on_device))
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        # Non-finite guard: a poisoned step leaves params, optimizer and reducer state untouched.
        new = TrainState(
            step=state.step + 1,
            params=params,
            opt_state=opt_state,
            reducer_state=reducer_state,
            skipped=jnp.zeros((), jnp.int32),
        )
        old = dataclasses.replace(state, step=state.step + 1, skipped=state.skipped + 1)
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr_schedule(state.step),
            "skipped": (~ok).astype(jnp.int32),
            **extra,
        }
        return tree_where(ok, new, old), metrics

    def eval_step(params, tokens):
        return token_loss_sums(without_aux(apply_fn), params, tokens, order_T)  # eval: cross-entropy only

    with jax.set_mesh(mesh):
        jit_init = jax.jit(init_state, static_argnums=0, out_shardings=state_shardings)
        jit_train = jax.jit(
            train_step,
            in_shardings=(state_shardings, batch_sharding),
            out_shardings=(state_shardings, scalar),
            donate_argnums=0,
        )
        jit_eval = jax.jit(
            eval_step, in_shardings=(state_shardings.params, batch_sharding), out_shardings=(scalar, scalar)
        )

    return Program(
        cfg=cfg,
        mesh=mesh,
        rules=rules,
        graphdef=graphdef,
        param_names=param_names,
        param_specs=param_specs,
        state_shardings=state_shardings,
        batch_sharding=batch_sharding,
        tx=tx,
        lr_schedule=lr_schedule,
        gradients=stage,
        init_state=_in_mesh(mesh, jit_init),
        train_step=_in_mesh(mesh, jit_train),
        eval_step=_in_mesh(mesh, jit_eval),
        abstract_state=abstract_state,
        apply_fn=apply_fn,
        model=model,
    )


def document_eos(cfg: Config, layout) -> int | None:
    """The EOS id that `data.document_mask` cuts attention at, or None when it is off."""
    if not cfg.data.document_mask:
        return None
    if layout:
        raise JaxdistError(
            "data.document_mask=true is not supported with pipeline parallelism (pp > 1) yet; "
            "use pp=1 or turn the mask off"
        )
    from jaxdist import data  # reads the tokenizer or the prepared folder's manifest

    return data.document_eos(cfg)


def select_gradient_stage(apply_fn, cfg: Config, mesh: Mesh, model: ResolvedModel) -> GradientStage:
    """The gradient stage `cfg.reduce.method` names: implicit (XLA's own all-reduce) or explicit."""
    if cfg.reduce.method == "implicit":
        return implicit_gradients(apply_fn, cfg.train.grad_accum_steps, context.sequence_order(cfg, mesh))
    if cfg.reduce.method == "diloco":  # one replica (warned): nothing to average, train as usual
        if reduce.check_axis(cfg, mesh, model):
            return diloco.diloco_gradients(apply_fn, cfg, mesh, model)
        return implicit_gradients(apply_fn, cfg.train.grad_accum_steps, context.sequence_order(cfg, mesh))
    return reduce.explicit_gradients(apply_fn, cfg, mesh, model)


class _in_mesh:
    """Call (and lower) a jitted function under `jax.set_mesh`, so activation constraints resolve."""

    def __init__(self, mesh: Mesh, fn):
        self.mesh, self.fn = mesh, fn

    def __call__(self, *args):
        with jax.set_mesh(self.mesh):
            return self.fn(*args)

    def lower(self, *args):
        with jax.set_mesh(self.mesh):
            return self.fn.lower(*args)
