"""A run's parameters alone, read onto a mesh: the newest intact checkpoint through the same verified path
as `train --restore` (checksums, fallback, one-line errors), a pipelined checkpoint restacked into the
plain layer stack. What export (`hf.convert.to_hf`) and generation (`inference.decode`) start from."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist import config as config_mod
from jaxdist.checkpoint.compat import check_model
from jaxdist.checkpoint.restoring import _meta, read_checkpoint
from jaxdist.distributed import sharding
from jaxdist.models.resolve import ResolvedModel, resolve
from jaxdist.parallel import pipeline


@dataclasses.dataclass
class RunParams:
    cfg: config_mod.Config  # the checkpoint's config, mesh set to the one read onto
    params: dict
    model: ResolvedModel  # graphdef, abstract, specs
    step_dir: Path  # the step read (checksums verified)

    @property
    def run_dir(self) -> Path:
        return self.step_dir.parent.parent


def read_run(path: Path, mesh, rules_for: Callable | None = None, log: Callable = print) -> RunParams:
    """A jaxdist checkpoint's parameters on `mesh` as the plain (unstaged) layer stack, read through the
    same verified path as `train --restore` (checksums, fallback, one-line errors). A pipelined checkpoint
    is read in its (stage, layers) layout and restacked on the devices. `rules_for(cfg)`: the sharding
    rules to read with (default: the run's own)."""
    got = read_checkpoint(
        Path(path), lambda manager, directory, step: _read_params(manager, directory, step, mesh, rules_for), log
    )
    cfg, params, model = got.value
    return RunParams(cfg, params, model, got.path)


def load_run_params(path: Path, mesh, rules=None, log: Callable = print):
    """`read_run` as (cfg, params, model)."""
    got = read_run(path, mesh, (lambda _: rules) if rules else None, log)
    return got.cfg, got.params, got.model


def _read_params(manager, directory: Path, step: int, mesh, rules_for):
    step_dir = directory / str(step)
    cfg = config_mod.from_dict(_meta(manager, step)["config"])
    cfg = cfg.replace(mesh={"shape": ",".join(f"{a}={s}" for a, s in mesh.shape.items()), "dcn": ""})
    rules = rules_for(cfg) if rules_for else sharding.make_rules(cfg.mesh.rules)
    model = resolve(cfg, mesh, rules)
    saved = manager.item_metadata(step)["params"]
    layers = cfg.model.num_layers
    staged = any(
        len(s.shape) == len(a.shape) + 1
        for s, a in zip(jax.tree.leaves(saved[pipeline.STACK]), jax.tree.leaves(model.abstract[pipeline.STACK]))
    )
    shardings = sharding.named(mesh, model.specs)
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), model.abstract, shardings)
    if staged:  # (stage, layers/stage, ...): read with the layer sharding, one more unsharded dim in front
        stages = jax.tree.leaves(saved[pipeline.STACK])[0].shape[0]
        repeats = pipeline.virtual_repeats(cfg)
        plan = pipeline.Plan(cfg.pipeline.schedule, stages, 1, repeats, layers // (stages * repeats))
        stack = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(
                (stages, a.shape[0] // stages, *a.shape[1:]), a.dtype, sharding=NamedSharding(mesh, P(None, *s.spec))
            ),
            model.abstract[pipeline.STACK],
            shardings[pipeline.STACK],
        )
        target = {**target, pipeline.STACK: stack}
    check_model(saved, target, step_dir)
    params = manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(target)))["params"]
    if staged:
        with jax.set_mesh(mesh):
            params = jax.jit(lambda p: pipeline.from_stages(p, plan), out_shardings=shardings)(params)
    return cfg, params, model
