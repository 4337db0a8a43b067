"""The compiled program: sharded state, the train step and the eval step.

One train step: tokens (global, sharded `batch -> (dp, fsdp)`) -> gradient stage (micro-batch loop,
loss/grad, data-parallel reduction) -> non-finite guard -> clip + AdamW -> new state (donated).

The gradient stage and any optimizer that replaces clip + AdamW come from `reduce.method`'s entry in
`jaxdist.reduce.registry` (implicit: XLA inserts the data-parallel all-reduce; the others reduce
explicitly, once per step, dense or compressed).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.adapters import tree as adapters
from jaxdist.config import Config
from jaxdist.distributed import offload, sharding
from jaxdist.distributed.mesh import axis_size
from jaxdist.errors import JaxdistError
from jaxdist.models import registry as models_registry
from jaxdist.models.attention import document_segments
from jaxdist.models.resolve import ResolvedModel, compute_dtype, make_model, resolve  # noqa: F401 (re-exported)
from jaxdist.objectives import registry as objectives
from jaxdist.objectives.refusals import check  # the trainer's start-up refusals, shared with the planner
from jaxdist.optim import registry as optimizers
from jaxdist.optim.adamw import decay_mask
from jaxdist.parallel import context, pipeline
from jaxdist.parallel.loss import ApplyFn
from jaxdist.reduce import registry
from jaxdist.reduce.gradients import GradientStage, token_loss_sums


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
    state_from_params: Callable  # float params (LoRA: may lack adapters, e.g. an imported base) -> step-0 TrainState
    train_step: Callable  # (state, tokens) -> (state, metrics)
    eval_step: Callable  # (params, tokens) -> (loss_sum, count); pair objectives: (params, reducer_state, tokens) -> (loss_sum, pairs, stats)
    abstract_state: TrainState
    apply_fn: ApplyFn  # (params, tokens_BT) -> (loss.Head, aux dict); pipelined when pp > 1 (then trace it under jax.set_mesh)
    model: ResolvedModel  # names, specs, shapes and pipeline plan of the parameters

    @property
    def pipeline(self):  # jaxdist.parallel.pipeline.Plan when pp > 1 (params then store the stack by stage)
        return self.model.pipeline

    def activate(self):
        """Context to trace or call the model's functions (apply_fn, gradients) outside the jitted steps."""
        return sharding.activate(self.mesh, self.rules)

    def batch_shards(self) -> int:
        return axis_size(self.mesh, self.batch_sharding.spec[0])


def build_program(
    cfg: Config, mesh: Mesh, gradient_stage: Callable | None = None, eos_id: int | None = None
) -> Program:
    """Resolve the model on `mesh`, pick the gradient stage, build the optimizer and jit the steps.

    `eos_id`: where `data.document_mask` cuts attention (the caller reads it: `data.data_rules.mask_eos(cfg)`);
    needed when the mask is on.

    `gradient_stage(apply_fn, cfg, mesh, model: ResolvedModel) -> GradientStage` overrides the stage
    of the method `cfg.reduce.method` resolves to (`reduce.registry`).
    """
    rules = sharding.make_rules(cfg.mesh.rules)
    check(cfg, mesh, rules)
    model = resolve(cfg, mesh, rules)
    order_T = context.sequence_order(cfg, mesh)  # cp > 1: positions in the load-balanced order
    apply_fn = model_apply(cfg, model, order_T, eos_id)
    method = registry.resolve(cfg, mesh, model)  # the one place reduce.method is decided
    if objectives.is_default(cfg):
        stage = (gradient_stage or method.stage)(apply_fn, cfg, mesh, model)
    else:  # a preference objective: its own stage (pairs in one forward, the frozen reference)
        stage = objectives.stage(apply_fn, cfg)
    tx, lr_schedule = optimizer(cfg, mesh, model, method)

    def state_from_params(params):
        """Float32 parameters -> the step-0 state. LoRA: entries `params` lacks (adapters, scales: an
        imported base) are initialised, the base is stored in lora.base_dtype, and the optimizer and
        gradient stage see the adapters only."""
        if cfg.lora.rank:
            params = adapters.combine(params, model.init_params(cfg, cfg.train.seed))
            params = adapters.store_base(params, cfg.lora)
        trained = trained_part(cfg, params)
        zero = jnp.zeros((), jnp.int32)
        return TrainState(zero, params, tx.init(trained), stage.init(trained), zero)

    def init_state(seed):
        return state_from_params(model.init_params(cfg, seed))

    # From the resolved shapes: tracing init_state would build the model once more (LoRA: its
    # adapters are made inside state_from_params, so it is traced whole).
    abstract_state = (
        jax.eval_shape(lambda: init_state(0)) if cfg.lora.rank else jax.eval_shape(state_from_params, model.abstract)
    )
    shardings, on_device = state_shardings(cfg, mesh, tx, stage, model, abstract_state)
    # The abstract state carries its shardings: lowered from it, the step sees host-resident (offloaded)
    # arrays as host values (their avals' memory space), as it does when called with the arrays.
    abstract_state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, shardings
    )
    batch_sharding, scalar = NamedSharding(mesh, sharding.batch_spec(rules)), NamedSharding(mesh, P())
    train_step = make_train_step(cfg, tx, lr_schedule, stage, on_device, model.pipeline)

    def eval_step(params, tokens):
        return token_loss_sums(apply_fn, params, tokens, order_T)  # eval: cross-entropy only

    if cfg.lora.rank:  # the adapters are made inside state_from_params: one program
        jit_init = jax.jit(init_state, static_argnums=0, out_shardings=shardings)
    else:  # two: the random parameters (model_init), then the step-0 state around them
        # The parameters' buffers become the state's (donated), unless the state keeps them in host memory.
        donate = () if cfg.offload.params == "host" else 0
        params_of = model_init(cfg, model, on_device["params"])
        wrap = jax.jit(state_from_params, out_shardings=shardings, donate_argnums=donate)

        def jit_init(seed):
            return wrap(params_of(seed))

    jit_from_params = jax.jit(state_from_params, out_shardings=shardings)
    jit_train = jax.jit(
        train_step, in_shardings=(shardings, batch_sharding), out_shardings=(shardings, scalar), donate_argnums=0
    )
    if objectives.is_default(cfg) or objectives.rollouts(cfg):  # GRPO evaluates by sampling (the driver's)
        jit_eval = jax.jit(eval_step, in_shardings=(shardings.params, batch_sharding), out_shardings=(scalar, scalar))
    else:
        pair_eval = objectives.eval_step(apply_fn, cfg)
        if pair_eval is None:  # only GRPO has none, handled above
            raise RuntimeError(f"objective.method={cfg.objective.method} has no held-out pair step")
        jit_eval = jax.jit(
            pair_eval,
            in_shardings=(shardings.params, shardings.reducer_state, batch_sharding),
            out_shardings=scalar,
        )
    return Program(
        cfg=cfg,
        mesh=mesh,
        rules=rules,
        graphdef=model.graphdef,
        param_names=model.names,
        param_specs=model.specs,
        state_shardings=shardings,
        batch_sharding=batch_sharding,
        tx=tx,
        lr_schedule=lr_schedule,
        gradients=stage,
        init_state=_in_mesh(mesh, rules, jit_init),
        state_from_params=_in_mesh(mesh, rules, jit_from_params),
        train_step=_in_mesh(mesh, rules, jit_train),
        eval_step=_in_mesh(mesh, rules, jit_eval),
        abstract_state=abstract_state,
        apply_fn=apply_fn,
        model=model,
    )


def model_init(cfg: Config, model: ResolvedModel, params_sharding):
    """`(seed) -> float32 parameters`, jitted, made directly in their shards. A program of its own because it
    depends on the model, the mesh and the seed only: another optimizer, reducer or schedule on the same
    model finds it in the compilation cache. It is most of what initialising costs to compile (a
    threefry per tensor), and the state around it little."""
    return jax.jit(lambda seed: model.init_params(cfg, seed), static_argnums=0, out_shardings=params_sharding)


def trained_part(cfg: Config, tree):
    """The part of a params-shaped tree that trains: the LoRA adapters, or everything."""
    return adapters.trainable(tree) if cfg.lora.rank else tree


def model_apply(cfg: Config, model: ResolvedModel, order_T, eos_id: int | None = None) -> ApplyFn:
    """`apply_fn(params, tokens_BT) -> (loss.Head, aux)`: the model's training forward (`loss_head`; pipelined
    when pp > 1); with
    `data.document_mask`, attention stays inside the documents that `eos_id` ends."""
    eos_id = check_document_mask(cfg, model.pipeline, eos_id)
    if model.pipeline:  # pp > 1: the layer stack runs as a pipeline schedule
        return pipeline.pipelined_apply(model.graphdef, model.pipeline, order_T)

    def apply_fn(params, tokens_BT):
        if cfg.offload.params == "host":  # the layer stack is fetched layer by layer inside the scan
            params = jax.tree_util.tree_map_with_path(
                lambda p, x: x if getattr(p[0], "key", None) == "blocks" else offload.fetch(x),
                params,
                is_leaf=offload.is_offloaded,
            )
        segment_ids_BT = None if eos_id is None else document_segments(tokens_BT, eos_id)
        return nnx.merge(model.graphdef, params).loss_head(tokens_BT, segment_ids_BT, order_T)

    return apply_fn


def optimizer(cfg: Config, mesh: Mesh, model: ResolvedModel, method: registry.Method):
    """(tx, lr schedule): clip + `optim.name`'s optimizer (jaxdist.optim.registry), or what `method` applies instead (DiLoCo's outer move, DGC's and
    DeMo's LR and decay on the update their stage returns)."""
    tx, lr_schedule = optimizers.make(
        cfg.optim,
        cfg.optim.schedule_steps or cfg.train.steps,
        cfg.train.global_batch,
        trained_part(cfg, model.names),
        registry.variance_freeze_step(cfg, mesh),
        cfg.reduce.variance_floor,
    )
    if method.optimizer is not None:
        tx = method.optimizer(cfg, lr_schedule, decay_mask(model.names))
    return tx, lr_schedule


def state_shardings(cfg: Config, mesh: Mesh, tx, stage: GradientStage, model: ResolvedModel, abstract_state):
    """(TrainState of NamedShardings, the optimizer state's on-device shardings). Optimizer state is
    sharded like its parameters; offload.optimizer=host / offload.params=host keep it / the parameters
    in pinned host memory between steps."""
    trained = trained_part(cfg, model.specs)  # LoRA: optimizer and reducer state cover the adapters only
    opt_specs = optimizers.state_specs(cfg.optim, tx, abstract_state.opt_state, trained)
    scalar: Any = P()  # a TrainState of specs: its scalar fields replicated
    specs = TrainState(scalar, model.specs, opt_specs, stage.state_specs(trained), scalar)
    shardings = sharding.named(mesh, specs)
    on_device = {"opt_state": shardings.opt_state, "params": shardings.params}
    host = lambda tree: jax.tree.map(lambda s: s.with_memory_kind(offload.HOST_KIND), tree)
    if cfg.offload.optimizer == "host":
        shardings = dataclasses.replace(shardings, opt_state=host(shardings.opt_state))
    if cfg.offload.params == "host":
        shardings = dataclasses.replace(shardings, params=host(shardings.params))
    return shardings, on_device


def after_step_update(cfg: Config, params, load_LE, plan: pipeline.Plan | None = None):
    """The architecture's non-gradient update after the optimizer's (DeepSeek-V3's balancing bias) from
    the step's per-layer expert loads `load_LE` (summed over every micro-batch); `params` unchanged
    where the architecture has none or the step reported no loads. `plan`: the pipeline, whose staged
    stack stores the biases by stage, so the loads are staged the same way."""
    after = models_registry.of(cfg.model).after_step
    if after is None or load_LE is None:
        return params
    if plan:
        load_LE = pipeline.to_stages({pipeline.STACK: load_LE}, plan)[pipeline.STACK]
    return after(cfg.model, params, load_LE)


def make_train_step(
    cfg: Config, tx, lr_schedule, stage: GradientStage, on_device: dict, plan: pipeline.Plan | None = None
) -> Callable:
    """`train_step(state, tokens) -> (state, metrics)`: gradients, then clip + AdamW, behind the
    non-finite guard (a poisoned step leaves params, optimizer and reducer state untouched).
    `on_device`: the device shardings of the opt_state and params that offload keeps in host memory.
    `plan`: the pipeline (pp > 1), whose staged layer stack the after-step update sees."""

    def train_step(state: TrainState, tokens):
        grads, loss, reducer_state, extra = stage.apply(state.params, tokens, state.reducer_state, state.step)
        load_LE = extra.pop("moe_load_LE", None) if isinstance(extra, dict) else None  # MoE loads: not logged
        if cfg.offload.optimizer == "host":  # stream it in for the update only; out_shardings send it back
            state = dataclasses.replace(state, opt_state=jax.device_put(state.opt_state, on_device["opt_state"]))
        if cfg.offload.params == "host":  # likewise the parameters (and their gradients, host after the scan)
            state = dataclasses.replace(state, params=jax.device_put(state.params, on_device["params"]))
            grads = jax.device_put(grads, on_device["params"])
        grad_norm = optax.tree.norm(grads)
        trained = trained_part(cfg, state.params)  # LoRA: the adapters; the frozen base passes through
        updates, opt_state = tx.update(grads, state.opt_state, trained)
        params = optax.apply_updates(trained, updates)
        params = after_step_update(cfg, params, load_LE, plan)
        if cfg.lora.rank:
            params = adapters.combine(cast(dict, params), adapters.frozen(state.params))  # the nested dict in
        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        new = TrainState(state.step + 1, params, opt_state, reducer_state, jnp.zeros((), jnp.int32))
        old = dataclasses.replace(state, step=state.step + 1, skipped=state.skipped + 1)
        skipped = (~ok).astype(jnp.int32)
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr_schedule(state.step), "skipped": skipped, **extra}
        return tree_where(ok, new, old), metrics

    return train_step


def check_document_mask(cfg: Config, plan: pipeline.Plan | None, eos_id: int | None) -> int | None:
    """The EOS id that `data.document_mask` cuts attention at, or None when it is off."""
    if not cfg.data.document_mask:
        return None
    if plan:
        raise JaxdistError(
            "data.document_mask=true is not supported with pipeline parallelism (pp > 1) yet; "
            "use pp=1 or turn the mask off"
        )
    if eos_id is None:
        raise JaxdistError(
            "data.document_mask=true needs the end-of-document id: build the program with "
            "eos_id=data_rules.mask_eos(cfg), as the trainer does"
        )
    return eos_id


class _in_mesh:
    """Call (and lower) a jitted function under its mesh and logical rules (`sharding.activate`), so
    the activation constraints it traces resolve."""

    def __init__(self, mesh: Mesh, rules, fn):
        self.mesh, self.rules, self.fn = mesh, rules, fn

    def __call__(self, *args):
        with sharding.activate(self.mesh, self.rules):
            return self.fn(*args)

    def lower(self, *args):
        with sharding.activate(self.mesh, self.rules):
            return self.fn.lower(*args)
