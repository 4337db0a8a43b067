"""Compile and measure: the train step or the reduction alone, and the bytes they send over an axis.

Bytes are the compiled program's collectives whose replica groups span the axis, costed with
`hlo.py`'s ring model, times their executions. Used by bench, the compression study and the tests.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxdist.config import Config
from jaxdist.data import data_rules
from jaxdist.distributed import hlo, sharding
from jaxdist.errors import JaxdistError
from jaxdist.models.resolve import resolve
from jaxdist.reduce import dgc, diloco, explicit, registry
from jaxdist.training import step


def dp_bytes_per_step(
    compiled_hlo_text: str, mesh: Mesh, axis: str = "dp", phase: str | int = "steady", sync_every: int = 1
) -> float:
    """Bytes each device sends across `axis` per optimizer step: every collective whose replica
    groups span the axis, times its executions, costed with the ring model.
    `phase="steady"` leaves out a reducer's dense warm-up branch (explicit.WARMUP_SCOPE); `"warmup"`
    leaves out the compressed branch it replaces (explicit.COMPRESSED_SCOPE) instead. Collectives under
    explicit.SYNC_SCOPE run once every `sync_every` steps (DiLoCo) and count 1/sync_every: the
    average over a sync period. An int phase i: DGC's sparsity warm-up stage i alone (dgc.stage_scope).
    A collective across the axis in a loop of unknown trip count raises."""
    skip = (
        explicit.COMPRESSED_SCOPE
        if isinstance(phase, int)
        else {"steady": explicit.WARMUP_SCOPE, "warmup": explicit.COMPRESSED_SCOPE}[phase]
    )
    shape, total = dict(mesh.shape), 0.0
    for c in hlo.collectives(compiled_hlo_text):
        if skip in c.line or not hlo.spans_axis(c, shape, tuple(mesh.axis_names), axis):
            continue
        if isinstance(phase, int) and explicit.WARMUP_SCOPE in c.line and f"{dgc.stage_scope(phase)}/" not in c.line:
            continue  # another warm-up stage
        if not c.trips_known:
            raise JaxdistError(
                f"a {c.kind} across {axis} sits in a loop without a known trip count "
                f"({c.computation}): its bytes per step are unknown"
            )
        total += c.count * c.sent_bytes / (sync_every if explicit.SYNC_SCOPE in c.line else 1)
    return float(total)


def compile_train_step(cfg: Config, mesh: Mesh, compiler_options: dict | None = None):
    """The compiled train step of `cfg` on `mesh` (abstract inputs: nothing is allocated)."""
    prog = step.build_program(cfg, mesh, eos_id=data_rules.mask_eos(cfg))
    tokens = jax.ShapeDtypeStruct(
        (cfg.train.global_batch, cfg.model.seq_len + 1), jnp.int32, sharding=prog.batch_sharding
    )
    return prog.train_step.lower(prog.abstract_state, tokens).compile(compiler_options)


def compile_reduction(cfg: Config, mesh: Mesh):
    """The reducer of `cfg` compiled alone, on abstract gradients (no model: quick). Its dp bytes
    are the train step's less the (loss, token count) psum."""
    axis = cfg.reduce.axis
    model = resolve(cfg, mesh, sharding.make_rules(cfg.mesh.rules))
    reducer = registry.reduction(cfg, mesh, model.abstract, model.stacked_dims)
    state = jax.eval_shape(reducer.init, model.abstract)
    fn = jax.shard_map(
        lambda g, s, i: reducer.update(g, s, i),
        mesh=mesh,
        in_specs=(P(), P(), P()),
        out_specs=(P(), P()),
        axis_names={axis},
        check_vma=False,
    )
    return jax.jit(fn).lower(model.abstract, state, jax.ShapeDtypeStruct((), jnp.int32)).compile()


def compression_ratio(cfg: Config, mesh: Mesh, dp_bytes: float | None = None) -> float:
    """Dense float32 explicit reduction's `dp_bytes_per_step` over this config's, on the same mesh
    (compiles the dense program; 1.0 without compiling when nothing crosses the axis or it is dense)."""
    axis = cfg.reduce.axis
    if mesh.shape[axis] == 1 or registry.is_baseline(cfg):
        return 1.0
    if dp_bytes is None:
        dp_bytes = dp_bytes_per_step(
            compile_train_step(cfg, mesh).as_text(), mesh, axis, sync_every=registry.sync_every(cfg)
        )
    dense_cfg = cfg.replace(reduce=dict(registry.BASELINE))
    dense_bytes = dp_bytes_per_step(compile_train_step(dense_cfg, mesh).as_text(), mesh, axis)
    return dense_bytes / dp_bytes if dp_bytes else float("inf")


def run_bytes_per_step(cfg: Config, mesh: Mesh, compiled_hlo_text: str) -> tuple[float, float]:
    """(steady, run average) dp bytes per step of a compiled train step: the steady state after the
    dense warm-up, and the average over `train.steps` with the warm-up's dense steps included."""
    axis, every = cfg.reduce.axis, registry.sync_every(cfg)
    steady = dp_bytes_per_step(compiled_hlo_text, mesh, axis, sync_every=every)
    steps = cfg.train.steps
    if every > 1:  # DiLoCo: ceil(steps / H) syncs, the last one at the run's end (diloco.syncs)
        sync = (dp_bytes_per_step(compiled_hlo_text, mesh, axis) - steady) * every / (every - 1)
        return steady, steady + sync * (diloco.syncs(cfg) / steps - 1 / every)
    # The warm-up: each phase's own bytes for its own steps (dense; DGC: each density stage).
    phases = registry.warmup_phases(cfg)
    warm = sum((b - a) * dp_bytes_per_step(compiled_hlo_text, mesh, axis, phase=p) for a, b, p in phases)
    w = phases[-1][1] if phases else 0
    return steady, (warm + (steps - w) * steady) / steps


def compression_ratio_run(cfg: Config, mesh: Mesh, compiled_hlo_text: str | None = None) -> float:
    """Dense float32's dp bytes over this config's averaged over the whole run (`train.steps`, the
    dense warm-up included): what a run really saves. `compression_ratio` is the steady state."""
    if mesh.shape[cfg.reduce.axis] == 1 or not registry.method(cfg).compresses:
        return compression_ratio(cfg, mesh)
    text = compiled_hlo_text or compile_train_step(cfg, mesh).as_text()
    steady, run = run_bytes_per_step(cfg, mesh, text)
    return compression_ratio(cfg, mesh, steady) * steady / run


# The vocabulary check's shapes: V=8192 against V=256, the head gathered block by block (loss_gather_mib=0)
VOCAB_SHAPES = dict(seq_len=128, vocab_size=8192, loss_block=256, loss_gather_mib=0)


def vocabulary_temp_misses(cfg: Config, mesh: Mesh) -> tuple[dict, list[str]]:
    """(figures, misses) of the blockwise loss's vocabulary-attributable temp, temp(V=8192) - temp(V=256),
    same shapes, four compiles of `cfg`'s step on `mesh`. Recomputing the logits in the backward: at least
    the float32 gradients of the embedding and the head (each V·D/devices: they exist before the optimizer),
    at most those plus 8 logits blocks (local tokens x 256 rows x 4 B); keeping them (the default at this
    size): at least the kept logits (local tokens x V/tp x 4 B), at most those on top; the naive loss's
    logits above that (what the bounds catch). misses is empty when every bound holds.
    tests/test_loss.py checks tp=2,fsdp=4, scripts/memory/vocab_temp_check.py any mesh (fsdp=8)."""

    def temp(**model) -> int:
        return compile_train_step(cfg.replace(model=model), mesh).memory_analysis().temp_size_in_bytes

    n, shards = mesh.devices.size, mesh.shape.get("tp", 1)
    tokens = cfg.train.global_batch // (n // shards) * VOCAB_SHAPES["seq_len"]
    f = dict(
        grads=2 * VOCAB_SHAPES["vocab_size"] * cfg.model.d_model * 4 / n,
        block=tokens * VOCAB_SHAPES["loss_block"] * 4,
        logits=tokens * VOCAB_SHAPES["vocab_size"] / shards * 4,
    )
    base = temp(**{**VOCAB_SHAPES, "vocab_size": 256, "loss_block": 0})
    f["recompute"] = temp(**VOCAB_SHAPES, loss_keep_mib=0) - base
    f["keep"] = temp(**VOCAB_SHAPES) - base
    f["naive"] = temp(**VOCAB_SHAPES, loss_impl="naive") - base
    top = f["grads"] + 8 * f["block"]
    misses = [
        f"{what}: {f}"
        for what, ok in [
            ("recompute outside [grads, grads + 8 blocks]", f["grads"] <= f["recompute"] <= top),
            ("the logits do not exceed grads + 8 blocks", f["logits"] > top),
            # (the embedding's gradient can reuse the kept logits' memory once the loss is done with them)
            ("keep outside [logits, grads + logits + 8 blocks]", f["logits"] <= f["keep"] <= top + f["logits"]),
            ("naive within grads + logits + 8 blocks", f["naive"] > top + f["logits"]),
        ]
        if not ok
    ]
    return f, misses
