"""The model, resolved once for a (config, mesh): graph, parameter names, specs, shapes, pipeline plan.

Everyone that needs to know what the parameters are (the step, the explicit reduction, measurement)
takes this result instead of building the abstract model again.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxdist.adapters import tree as adapters
from jaxdist.config import Config, ModelConfig
from jaxdist.distributed import sharding
from jaxdist.models import registry
from jaxdist.parallel import pipeline

STACKED_AXES = ("layers", "stage")  # leading logical axes that stack independent per-layer tensors


def compute_dtype(model: ModelConfig, backend: str | None = None):
    """The activation/matmul dtype: `model.compute_dtype`, with auto = float32 on CPU, bfloat16 elsewhere."""
    name = model.compute_dtype
    if name == "auto":
        name = "float32" if (backend or jax.default_backend()) == "cpu" else "bfloat16"
    return jnp.dtype(name)


def model_config(cfg: Config) -> ModelConfig:
    """cfg.model as the model runs it: offload.activations=host selects the offloading remat policy."""
    if cfg.offload.activations == "host":
        return dataclasses.replace(cfg.model, remat="offload_dots")
    return cfg.model


def make_model(cfg: Config, seed: int = 0) -> nnx.Module:
    """The NNX model of `cfg.model`'s architecture (jaxdist.models.registry)."""
    lora = cfg.lora if cfg.lora.rank else None  # adapters on the layer matrices (jaxdist.adapters)
    build = registry.of(cfg.model).model
    return build(model_config(cfg), nnx.Rngs(params=seed), compute_dtype=compute_dtype(cfg.model), lora=lora)


@dataclasses.dataclass(frozen=True)
class ResolvedModel:
    graphdef: Any
    names: Any  # pytree of logical-name tuples, as the train state stores the parameters
    specs: Any  # pytree of PartitionSpecs
    abstract: Any  # pytree of ShapeDtypeStructs, as the train state stores them (LoRA: base cast / quantised)
    pipeline: pipeline.Plan | None  # pp > 1: the layer stack is stored (stage, layers, ...)
    rules: dict  # the logical rules the specs came from; trace the model under `sharding.activate(mesh, rules)`

    @property
    def stacked_dims(self):
        """Per tensor, how many leading dims stack independent layers (from the logical names)."""
        return jax.tree.map(
            lambda n: next((i for i, a in enumerate(n) if a not in STACKED_AXES), len(n)),
            self.names,
            is_leaf=lambda x: isinstance(x, tuple),
        )

    def init_params(self, cfg: Config, seed) -> dict:
        params = nnx.to_pure_dict(nnx.state(make_model(cfg, seed), nnx.Param))
        return pipeline.to_stages(params, self.pipeline) if self.pipeline else params


def resolve(cfg: Config, mesh: Mesh, rules) -> ResolvedModel:
    registry.of(cfg.model).validate(cfg, {a: int(n) for a, n in mesh.shape.items()})  # the architecture's refusals
    abstract_model = nnx.eval_shape(lambda: make_model(cfg))
    graphdef, abstract_params = nnx.split(abstract_model, nnx.Param)
    names = nnx.to_pure_dict(sharding.logical_names(abstract_params))
    specs = nnx.to_pure_dict(sharding.state_specs(abstract_params, rules, mesh))
    abstract = nnx.to_pure_dict(abstract_params)
    if cfg.lora.rank:  # the frozen base as stored: bfloat16, or int8 / NF4 codes beside their scales
        abstract = jax.eval_shape(lambda p: adapters.store_base(p, cfg.lora), abstract)
    plan = pipeline.plan(cfg, mesh, rules)
    if plan:
        names = pipeline.stage_names(names)
        abstract = jax.eval_shape(lambda p: pipeline.to_stages(p, plan), abstract)
        specs = pipeline.stage_specs(names, abstract, rules, mesh)
    return ResolvedModel(
        graphdef=graphdef, names=names, specs=specs, abstract=abstract, pipeline=plan, rules=dict(rules)
    )
