"""Compile and measure: the train step or the reduction alone, and the bytes they send over an axis.

Bytes are the compiled program's collectives whose replica groups span the axis, costed with
`hlo.py`'s ring model, times their executions. Used by bench, the compression study and the tests.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from jaxdist import hlo, sharding, step
from jaxdist.config import Config
from jaxdist.parallel import reduce
from jaxdist.resolve import resolve

_COLLECTIVE_OP = re.compile(r"\b(?:%s)(?:-start|-done)?\(" % "|".join(hlo.KINDS))


def dp_bytes_per_step(compiled_hlo_text: str, mesh: Mesh, axis: str = "dp") -> float:
    """Bytes each device sends across `axis` per optimizer step: every collective whose replica
    groups span the axis, times its executions, costed with the ring model.
    The dense warm-up branch of a reducer (reduce.WARMUP_SCOPE) is left out: this is the steady state."""
    text = "\n".join(line for line in compiled_hlo_text.splitlines()
                     if not (reduce.WARMUP_SCOPE in line and _COLLECTIVE_OP.search(line)))
    shape = dict(mesh.shape)
    return float(sum(c.count * c.sent_bytes for c in hlo.collectives(text)
                     if hlo.spans_axis(c, shape, tuple(mesh.axis_names), axis)))


def compile_train_step(cfg: Config, mesh: Mesh):
    """The compiled train step of `cfg` on `mesh` (abstract inputs: nothing is allocated)."""
    prog = step.build_program(cfg, mesh)
    tokens = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.model.seq_len + 1), jnp.int32,
                                  sharding=prog.batch_sharding)
    return prog.train_step.lower(prog.abstract_state, tokens).compile()


def compile_reduction(cfg: Config, mesh: Mesh):
    """The reducer of `cfg` compiled alone, on abstract gradients (no model: quick). Its dp bytes
    are the train step's less the (loss, token count) psum."""
    axis = cfg.reduce.axis
    model = resolve(cfg, mesh, sharding.make_rules(cfg.mesh.rules))
    reducer = reduce.make_reducer(cfg, mesh, model.abstract, model.stacked_dims)
    state = jax.eval_shape(reducer.init, model.abstract)
    fn = jax.shard_map(lambda g, s, i: reducer.update(g, s, i), mesh=mesh, in_specs=(P(), P(), P()),
                       out_specs=(P(), P()), axis_names={axis}, check_vma=False)
    return jax.jit(fn).lower(model.abstract, state, jax.ShapeDtypeStruct((), jnp.int32)).compile()


def compression_ratio(cfg: Config, mesh: Mesh, dp_bytes: float | None = None) -> float:
    """Dense float32 explicit reduction's `dp_bytes_per_step` over this config's, on the same mesh
    (compiles the dense program; 1.0 without compiling when nothing crosses the axis or it is dense)."""
    axis = cfg.reduce.axis
    if mesh.shape[axis] == 1 or (cfg.reduce.method == "dense" and cfg.reduce.dtype == "float32"):
        return 1.0
    if dp_bytes is None:
        dp_bytes = dp_bytes_per_step(compile_train_step(cfg, mesh).as_text(), mesh, axis)
    dense_cfg = cfg.replace(reduce=dict(method="dense", dtype="float32"))
    dense_bytes = dp_bytes_per_step(compile_train_step(dense_cfg, mesh).as_text(), mesh, axis)
    return dense_bytes / dp_bytes if dp_bytes else float("inf")
