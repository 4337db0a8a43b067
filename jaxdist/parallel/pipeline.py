"""Pipeline parallelism over the `pp` mesh axis, inside one jit (GPipe and circular schedules).

The scanned layer stack (L, ...) is cut into P = pp stages. Stage weights live on their stage's
devices: the stack is stored as (stage, layers, ...) — logical names ('stage', 'layers', ...), with
`stage -> pp` — where row s holds, in the order stage s runs them, the layer groups s, P+s, ...,
(V-1)P+s of L / (P V) layers each (V = repeats: 1 for gpipe, `pipeline.repeats` for circular).
For gpipe this is a plain reshape of the stack; `to_stages` / `from_stages` convert either way.

Embedding and head stay outside the pipeline (computed on every pp rank, batch-sharded as usual).
Between them, `M` micro-batches flow through a `lax.scan` inside `shard_map` (manual over pp only;
dp/fsdp/tp stay automatic). At iteration t, stage s works on index i = t - s: micro-batch i mod M of
repeat i // M. Stage 0 reads its input from a buffer holding the micro-batches; every other stage
reads what its predecessor sent by `ppermute` at the end of the previous iteration. With circular,
stage P-1 sends back to stage 0, which parks the micro-batch in the buffer until its next repeat
(this needs M >= P). gpipe takes M + P - 1 iterations, circular V M + P - 1; bubble (P-1)/iterations.

Backward is autodiff through the scan. Each stage application is rematerialised, so the scan keeps
one stage input per iteration ((V M + P - 1) micro-batches of activations per stage) and recomputes
the stage's layers during backward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxdist.config import Config
from jaxdist.distributed import sharding
from jaxdist.distributed.mesh import axis_size
from jaxdist.errors import JaxdistError
from jaxdist.parallel import schedule_registry, schedules
from jaxdist.parallel.loss import Head
from jaxdist.parallel.microbatch import split_microbatches

AXIS = "pp"
STACK = "blocks"  # the model's stacked layers (params[STACK] leaves have a leading `layers` axis)


@dataclasses.dataclass(frozen=True)
class Plan:
    schedule: str
    stages: int  # P
    microbatches: int  # M, per pipeline pass (per gradient-accumulation micro-batch)
    repeats: int  # V: layer groups per stage (1 for gpipe)
    layers_per_group: int  # stacked units (layers, or moe_every-layer groups) per group: U / (P V)

    @property
    def entry(self) -> schedule_registry.Schedule:
        """The schedule's registry entry (engine, layout, table builder, refusals)."""
        return schedule_registry.get(self.schedule)

    @property
    def iterations(self) -> int:
        """Loop iterations per pass: GPipe / circular's forward scan; a table schedule's slots."""
        if self.entry.tabled:
            return self.table().slots
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def bubble_fraction(self) -> float:
        if self.entry.tabled:
            return self.table().bubble_fraction
        return (self.stages - 1) / self.iterations

    def table(self) -> schedules.Table:
        return self.entry.table(self.stages, self.microbatches, self.repeats)


def plan(cfg: Config, mesh, rules) -> Plan | None:
    """The validated pipeline for (cfg, mesh), or None when pp == 1 (no pipeline)."""
    stages = mesh.shape.get(AXIS, 1)
    if stages == 1:
        return None
    p, layers, units = cfg.pipeline, cfg.model.num_layers, cfg.model.pipeline_depth
    per_unit = layers // cfg.model.stack_depth  # moe_every / full_attention_interval when the scanned unit is a group
    if p.microbatches < 0:
        raise JaxdistError(f"pipeline.microbatches={p.microbatches} must be >= 0 (0 means pp={stages})")
    entry = schedule_registry.get(p.schedule)
    if not entry.virtual and p.repeats != 1:
        raise JaxdistError(
            f"pipeline.repeats={p.repeats} needs pipeline.schedule={schedule_registry.virtual_names()}; "
            f"set pipeline.repeats=1 for {p.schedule}"
        )
    repeats = virtual_repeats(cfg)
    micro = p.microbatches or stages
    entry.refuses(cfg, stages, micro)
    if units % (stages * repeats):
        fits = [
            f"pp={d}" + (f",repeats={repeats}" if repeats > 1 else "")
            for d in range(2, units + 1)
            if units % (d * repeats) == 0
        ]
        what = "model.moe_every" if cfg.model.moe_every > 1 else "model.full_attention_interval"
        groups = f" ({units} group{'s' * (units > 1)} of {what}={per_unit} layers)" if per_unit > 1 else ""
        if units < cfg.model.stack_depth:
            groups = f" ({units} MoE layers after model.dense_layers={cfg.model.stack_depth - units})"
        raise JaxdistError(
            f"model.num_layers={layers}{groups} cannot be split into pp={stages} stages x {repeats} repeats; "
            f"use {'MoE layers' if units < cfg.model.stack_depth else 'num_layers'} divisible by "
            f"{stages * repeats * per_unit}" + (f", or {' / '.join(fits)}" if fits else "")
        )
    if repeats > 1 and micro < stages:
        raise JaxdistError(
            f"{p.schedule} pipeline.repeats={repeats} needs pipeline.microbatches >= pp={stages} (got {micro}) "
            f"so each micro-batch is back at stage 0 in time; set pipeline.microbatches={stages} or more"
        )
    shards = axis_size(mesh, sharding.batch_spec(rules)[0])
    per_pass = cfg.train.global_batch // cfg.train.grad_accum_steps
    if per_pass % (micro * shards):
        raise JaxdistError(
            f"train.global_batch={cfg.train.global_batch} / train.grad_accum_steps={cfg.train.grad_accum_steps} = "
            f"{per_pass} sequences per pipeline pass must divide into pipeline.microbatches={micro} x "
            f"{shards} batch shards; use a global batch that is a multiple of "
            f"{cfg.train.grad_accum_steps * micro * shards}"
        )
    if AXIS in sum((tuple(v) for k, v in rules.items() if k != "stage"), ()):
        raise JaxdistError(
            "mesh.rules maps a logical axis other than 'stage' to 'pp'; with pp > 1 only 'stage' may use the pp axis"
        )
    return Plan(p.schedule, stages, micro, repeats, units // (stages * repeats))


def virtual_repeats(cfg: Config) -> int:
    """Chunks per stage: pipeline.repeats for a schedule with virtual stages (zb_v: 2), else 1."""
    return schedule_registry.get(cfg.pipeline.schedule).repeats(cfg.pipeline.repeats)


def describe(pl: Plan | None) -> dict[str, Any]:
    """Schedule summary for logs and benchmarks: schedule, stages, microbatches, repeats, iterations,
    bubble_fraction (iterations and bubble per pipeline pass). `pl` None: no pipeline."""
    if pl is None:
        return {
            "schedule": "none",
            "stages": 1,
            "microbatches": 1,
            "repeats": 1,
            "iterations": 1,
            "bubble_fraction": 0.0,
        }
    return {
        "schedule": pl.schedule,
        "stages": pl.stages,
        "microbatches": pl.microbatches,
        "repeats": pl.repeats,
        "iterations": pl.iterations,
        "bubble_fraction": pl.bubble_fraction,
    }


# ---- parameter layout: layer stack (L, ...) <-> stages (P, V * L/(PV), ...) -----------------------


def _groups(pl: Plan) -> np.ndarray:
    """(P, V): the layer group (virtual stage) stage s runs as its chunk v."""
    return schedules.stage_groups(pl.stages, pl.repeats, pl.entry.placement)


def to_stages(params: dict, pl: Plan) -> dict:
    """Layer l = g G + j (G layers per group) of group g = v P + s goes to row s, position v G + j (V
    placement: group s and 2P-1-s of stage s are its chunks 0 and 1)."""
    order = _groups(pl).ravel()

    def one(a):
        if pl.entry.placement == "v":
            a = a.reshape(pl.stages * pl.repeats, pl.layers_per_group, *a.shape[1:])[order]
            return a.reshape(pl.stages, pl.repeats * pl.layers_per_group, *a.shape[2:])
        a = a.reshape(pl.repeats, pl.stages, pl.layers_per_group, *a.shape[1:]).swapaxes(0, 1)
        return a.reshape(pl.stages, pl.repeats * pl.layers_per_group, *a.shape[3:])

    return {**params, STACK: jax.tree.map(one, params[STACK])}


def from_stages(params: dict, pl: Plan) -> dict:
    """Inverse of `to_stages`: back to the model's plain layer stack."""
    inverse = np.argsort(_groups(pl).ravel())

    def one(a):
        if pl.entry.placement == "v":
            a = a.reshape(pl.stages * pl.repeats, pl.layers_per_group, *a.shape[2:])[inverse]
            return a.reshape(pl.repeats * pl.stages * pl.layers_per_group, *a.shape[2:])
        a = a.reshape(pl.stages, pl.repeats, pl.layers_per_group, *a.shape[2:]).swapaxes(0, 1)
        return a.reshape(pl.repeats * pl.stages * pl.layers_per_group, *a.shape[3:])

    return {**params, STACK: jax.tree.map(one, params[STACK])}


def stage_names(names: dict) -> dict:
    """Logical names of the staged stack: ('layers', ...) -> ('stage', 'layers', ...)."""
    return {
        **names,
        STACK: jax.tree.map(lambda n: ("stage",) + tuple(n), names[STACK], is_leaf=lambda x: isinstance(x, tuple)),
    }


def stage_specs(names: dict, abstract_params: dict, rules, mesh) -> dict:
    """PartitionSpecs for the staged parameters, checked to divide the mesh."""
    is_names = lambda x: isinstance(x, tuple)

    def spec(path, n, a):
        what = f"parameter {jax.tree_util.keystr(path)}"
        s = sharding.logical_to_spec(n, rules, what)
        sharding.check_divisible(a.shape, s, mesh, what)
        return s

    return jax.tree_util.tree_map_with_path(spec, names, abstract_params, is_leaf=is_names)


# ---- the schedule -----------------------------------------------------------------------------------


def from_microbatches(x_MbTD):
    return x_MbTD.swapaxes(0, 1).reshape(-1, *x_MbTD.shape[2:])


def run_schedule(stage_fn: Callable, stage_params, x_MbTD, pl: Plan, aux_like=None):
    """The loop on one pp rank (inside shard_map). `stage_params` leaves are (V G, ...) for this stage;
    `stage_fn(group_params, x)` applies one group of G layers. Returns the last stage's outputs
    (M, b, T, D); other ranks return zeros. With `aux_like` (MoE: the shapes of one group's per-layer
    aux sums, leading axis G), `stage_fn` returns (y, aux) and the loop also returns this stage's aux
    summed over the micro-batches it really worked on (bubble iterations masked out), (V G, ...)."""
    S, M, V, G = pl.stages, pl.microbatches, pl.repeats, pl.layers_per_group
    s = jax.lax.axis_index(AXIS)
    groups = jax.tree.map(lambda a: a.reshape(V, G, *a.shape[1:]), stage_params)
    with_aux = aux_like is not None

    @jax.checkpoint  # remat at the stage boundary: keep only the stage input per iteration
    def apply_group(groups, v, x):
        out = stage_fn(jax.tree.map(lambda a: a[v], groups), x)
        return out if with_aux else (out, None)

    def put(buf, idx, value, cond):
        """buf[idx] = value where cond (touching one slot only)."""
        idx = jnp.clip(idx, 0, M - 1)
        return jax.lax.dynamic_update_index_in_dim(buf, jnp.where(cond, value, buf[idx]), idx, 0)

    def body(carry, t):
        recv, buf, out, acc = carry
        if V > 1:  # stage 0 parks the micro-batch stage P-1 finished last iteration until its next repeat
            back = t - S
            buf = put(buf, back % M, recv, (s == 0) & (back >= 0))
        x = jnp.where(s == 0, buf[t % M], recv)
        i = t - s  # this stage's work index
        v = jnp.clip(i // M, 0, V - 1)
        y, aux = apply_group(groups, v, x)
        done = i - (V - 1) * M  # micro-batch of the final repeat finished here, if any
        out = put(out, done, y, (s == S - 1) & (done >= 0) & (done < M))
        if with_aux:  # a real micro-batch (not a bubble): add its sums to layer group v
            real = (i >= 0) & (i < V * M)
            acc = jax.tree.map(lambda a, x: a.at[v].add(jnp.where(real, x, 0)), acc, aux)
        recv = jax.lax.ppermute(y, AXIS, [(k, (k + 1) % S) for k in range(S)])
        return (recv, buf, out, acc), None

    varying = lambda a: jax.lax.pcast(a, (AXIS,), to="varying")  # differs per stage
    acc = jax.tree.map(lambda a: varying(jnp.zeros((V, *a.shape), a.dtype)), aux_like) if with_aux else None
    init = (varying(jnp.zeros_like(x_MbTD[0])), varying(x_MbTD), varying(jnp.zeros_like(x_MbTD)), acc)
    (_, _, out, acc), _ = jax.lax.scan(body, init, jnp.arange(pl.iterations))
    if not with_aux:
        return out
    return out, jax.tree.map(lambda a: a.reshape(V * G, *a.shape[2:]), acc)


def layer_order(x_SVG, pl: Plan):
    """Per-stage rows (P, V G, ...) -> the model's layer order (L, ...) (as `from_stages`)."""
    x = x_SVG.reshape(pl.stages, pl.repeats, pl.layers_per_group, *x_SVG.shape[2:]).swapaxes(0, 1)
    return x.reshape(pl.repeats * pl.stages * pl.layers_per_group, *x.shape[3:])


def pipelined_apply(graphdef, pl: Plan, positions_T=None) -> PipelinedApply:
    """apply_fn(params, tokens_BT) -> (loss.Head, aux), as the model's `loss_head`, with the layer stack run as a
    pipeline. `params` are staged (`to_stages`). Call under `jax.set_mesh(mesh)`. `positions_T`: the tokens'
    positions when not 0..T-1 (context parallelism). MoE models return (out, aux) like the plain model:
    the per-layer aux sums leave the pipeline stacked by stage and are put back in layer order."""

    def apply_fn(params, tokens_BT):
        B = tokens_BT.shape[0]
        if B % pl.microbatches:
            raise JaxdistError(
                f"batch of {B} sequences does not split into pipeline.microbatches="
                f"{pl.microbatches}; use a batch that is a multiple of {pl.microbatches}"
            )
        model = nnx.merge(graphdef, params)
        blocks_def, _ = nnx.split(model.blocks)
        sparse = bool(model.cfg.moe_experts)

        # Per-layer constants (gpt-oss's windows) travel with their layers' weights, staged the same way.
        consts = model.layer_consts()
        stack = params[STACK] if consts is None else (params[STACK], to_stages({STACK: consts}, pl)[STACK])

        def stage_fn(group, x):
            group_params, c = group if consts is not None else (group, None)
            out, aux = model.run_layers_aux(x, nnx.merge(blocks_def, group_params), positions_T=positions_T, consts=c)
            return (out, aux) if sparse else out

        x_MbTD = split_microbatches(model.pre_layers(model.embed(tokens_BT), positions_T), pl.microbatches)
        aux_like = None
        if sparse:  # shapes of one group's per-layer aux sums
            group = jax.tree.map(lambda a: a[0, : pl.layers_per_group], stack)
            aux_like = jax.eval_shape(lambda g, x: stage_fn(g, x)[1], group, x_MbTD[0])

        def per_rank(stage_params, x_MbTD):
            local = jax.tree.map(lambda a: a[0], stage_params)  # (1, V G, ...) -> (V G, ...)
            res = run_schedule(stage_fn, local, x_MbTD, pl, aux_like)
            return jax.tree.map(lambda a: a[None], res)

        params_spec = jax.tree.map(lambda _: P(AXIS), stack)
        # check_vma off: a MoE layer's expert shard_map nests inside this one, and with the varying-axes
        # check on, jax 0.10.2 gives the inner one's backward residuals a spec naming pp (outer-manual)
        # after inner-manual axes, which Shardy's verifier rejects. Nothing here relies on the check.
        res = jax.shard_map(
            per_rank, in_specs=(params_spec, P()), out_specs=P(AXIS), axis_names={AXIS}, check_vma=False
        )(stack, x_MbTD)
        out_SMbTD, aux_S = res if sparse else (res, None)
        x_BTD = from_microbatches(out_SMbTD[pl.stages - 1])
        if not sparse:
            return model.head(x_BTD), {}
        return model.head(x_BTD), model.combine_aux(jax.tree.map(lambda a: layer_order(a, pl), aux_S))

    engine = pl.entry.engine  # a table schedule: training takes its gradients from it (jaxdist.reduce.gradients)
    return PipelinedApply(apply_fn, engine(graphdef, pl, positions_T) if engine else None)


@dataclasses.dataclass(frozen=True)
class PipelinedApply:
    """The model's apply_fn with the layer stack run as a pipeline (`pipelined_apply`). `objective`: a table
    schedule's objective_sums(params, tokens_BT1, order_T) whose gradients the table computes (custom VJP;
    `jaxdist.reduce.gradients.objective_sums` uses it as it is); None: autodiff through the scan."""

    forward: Callable
    objective: Callable | None = None

    def __call__(self, params, tokens_BT, /) -> tuple[Head, dict]:
        return self.forward(params, tokens_BT)
