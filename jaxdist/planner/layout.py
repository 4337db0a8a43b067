"""What the planner plans for: a model config on a mesh, and the parameter table of that model.

The parameter table comes from the model itself (`nnx.eval_shape`, no memory is allocated), so shapes
and logical axis names can never drift from the registry's model (`jaxdist.models.registry`); placement follows the same
logical rules as training (`jaxdist.distributed.sharding`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
from flax import nnx

from jaxdist.config import Config, LoraConfig, ModelConfig
from jaxdist.distributed import sharding
from jaxdist.distributed.hlo import dtype_bytes
from jaxdist.distributed.mesh import AXES, format_mesh
from jaxdist.errors import JaxdistError
from jaxdist.models import registry
from jaxdist.objectives import refusals
from jaxdist.parallel import schedule_buffers, schedule_registry
from jaxdist.planner.hardware import Hardware

PARAM_BYTES = 4  # parameters, gradients and AdamW moments are float32


@functools.lru_cache(maxsize=256)
def schedule_table(schedule: str, stages: int, microbatches: int, repeats: int):
    """(Table, buffer sizes: schedule_buffers.sizes) of a table schedule, built once per shape (the
    candidates share them)."""
    table = schedule_registry.get(schedule).table(stages, microbatches, repeats)
    return table, schedule_buffers.sizes(table)


@dataclasses.dataclass(frozen=True)
class ParamGroup:
    path: str
    shape: tuple[int, ...]
    names: tuple[str, ...]  # logical axis names, e.g. ('layers', 'embed', 'mlp')
    role: str  # "layer" (inside the scanned stack) | "embed" | "head" | "norm"

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def param_table(model: ModelConfig) -> tuple[ParamGroup, ...]:
    """Every parameter of the model with its shape, logical names and role."""
    return _table(model, None)


def model_table(model: ModelConfig, lora: LoraConfig) -> tuple[ParamGroup, ...]:
    """param_table of the model built with `lora` attached: its adapters (and QLoRA's scale slots) are
    parameters of the table too, as the model holds them (jaxdist.planner.lora.adapter_groups)."""
    return _table(model, (lora.rank, tuple(lora.targets), lora.base_dtype, lora.block_size))


@functools.lru_cache(maxsize=32)
def _table(model: ModelConfig, lora: tuple | None) -> tuple[ParamGroup, ...]:
    """The table of the model built with the LoRA config (rank, targets, base_dtype, block_size) attached
    (what shapes its adapters), or without (None)."""
    build = registry.of(model).model
    adapters = None
    if lora is not None:
        rank, targets, base_dtype, block_size = lora
        adapters = LoraConfig(rank=rank, targets=list(targets), base_dtype=base_dtype, block_size=block_size)
    abstract = nnx.eval_shape(lambda: build(model, nnx.Rngs(params=0), lora=adapters))
    state = nnx.state(abstract, nnx.Param)
    names = nnx.to_pure_dict(sharding.logical_names(state))
    shapes = nnx.to_pure_dict(state)
    groups = []
    for (path, n), (_, v) in zip(
        jax.tree_util.tree_flatten_with_path(names, is_leaf=lambda x: isinstance(x, tuple))[0],
        jax.tree_util.tree_flatten_with_path(shapes)[0],
    ):
        key = "/".join(str(getattr(p, "key", p)) for p in path)
        top = key.split("/")[0]
        # dense_blocks: the dense first layers' stack (registry.Architecture.dense_first), run before `blocks`
        role = {"blocks": "layer", "dense_blocks": "layer", "embed_VD": "embed", "head_DV": "head"}.get(top, "norm")
        groups.append(ParamGroup(key, tuple(v.shape), tuple(n), role))
    return tuple(groups)


@functools.lru_cache(maxsize=65536)
def _split(group: ParamGroup, rules: tuple, mesh: tuple, only_axis: str | None) -> int:
    """Product of the mesh axes (or only `only_axis`) that shard `group` under `rules`; checks divisibility."""
    spec, sizes = sharding.logical_to_spec(group.names, dict(rules), group.path), dict(mesh)
    n = 1
    for dim, entry in zip(group.shape, spec):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
        size = math.prod(sizes[a] for a in axes)
        if dim % size:
            raise JaxdistError(f"{group.path}: dimension {dim} does not split over {'x'.join(axes)}={size}")
        n *= math.prod(sizes[a] for a in axes if only_axis in (None, a))
    return n


@dataclasses.dataclass(frozen=True)
class Layout:
    """A config on a mesh (axis sizes), with the derived per-device shapes the cost model needs."""

    cfg: Config
    mesh: dict[str, int]  # {'dp':, 'pp':, 'fsdp':, 'cp':, 'tp':}
    hw: Hardware

    @property
    def devices(self) -> int:
        return math.prod(self.mesh.values())

    @property
    def name(self) -> str:
        return format_mesh(self.mesh) if any(s > 1 for s in self.mesh.values()) else "single device"

    @property
    def batch_shards(self) -> int:
        return math.prod(self.mesh[a] for a in self.rules["batch"])

    @functools.cached_property
    def rules(self) -> dict[str, tuple[str, ...]]:
        return sharding.make_rules(self.cfg.mesh.rules)

    @property
    def accum(self) -> int:
        """Gradient-accumulation micro-batches (train.grad_accum_steps)."""
        return self.cfg.train.grad_accum_steps

    @property
    def pipe_micro(self) -> int:
        """Pipeline micro-batches per accumulation micro-batch (pipeline.microbatches; 0 means pp)."""
        return 1 if self.mesh["pp"] == 1 else (self.cfg.pipeline.microbatches or self.mesh["pp"])

    @property
    def repeats(self) -> int:
        entry = schedule_registry.get(self.cfg.pipeline.schedule)
        return entry.repeats(self.cfg.pipeline.repeats) if self.mesh["pp"] > 1 else 1

    @property
    def schedule(self) -> str | None:
        """pipeline.schedule on pp > 1 (with 'xV' for V virtual chunks per stage), else None."""
        if self.mesh["pp"] == 1:
            return None
        return self.cfg.pipeline.schedule + (f" x{self.repeats}" if self.repeats > 1 else "")

    @property
    def table(self):
        """The schedule table (jaxdist.parallel.schedules) of a table schedule (1f1b, 1f1b_paired,
        interleaved_1f1b) on pp > 1, else None (GPipe / circular: autodiff through the schedule's scan)."""
        if self.mesh["pp"] == 1 or not schedule_registry.get(self.cfg.pipeline.schedule).tabled:
            return None
        return schedule_table(self.cfg.pipeline.schedule, self.mesh["pp"], self.pipe_micro, self.repeats)

    @property
    def tabled(self):
        """`table` where the caller counts a table schedule's program (pp > 1 under 1f1b & co): never None."""
        got = self.table
        if got is None:
            raise ValueError(f"{self.cfg.pipeline.schedule} on pp={self.mesh['pp']} is not a table schedule")
        return got

    @property
    def micro_batch(self) -> int:
        """Sequences per device per forward pass (one pipeline micro-batch of one accumulation step)."""
        return self.cfg.train.global_batch // (self.batch_shards * self.accum * self.pipe_micro)

    @property
    def cp(self) -> int:
        return self.mesh.get("cp", 1)

    @property
    def micro_tokens(self) -> int:
        """Tokens per device per forward pass: a micro-batch's rows, each split over cp."""
        return self.micro_batch * self.cfg.model.seq_len // self.cp

    @property
    def weight_shards(self) -> int:
        """Devices a layer weight's fsdp all-gather spans: the mesh axes of the `embed` rule (fsdp; with
        mesh.rules.embed=[fsdp, cp] also cp)."""
        return math.prod(self.mesh[a] for a in self.rules["embed"])

    @property
    def pipe_iterations(self) -> int:
        """GPipe: M + P - 1 iterations; circular: V M + P - 1 (jaxdist.parallel.pipeline)."""
        return self.repeats * self.pipe_micro + self.mesh["pp"] - 1 if self.mesh["pp"] > 1 else 1

    @property
    def compute_dtype(self) -> str:
        name = self.cfg.model.compute_dtype
        if name == "auto":
            name = "float32" if self.hw.backend == "cpu" else "bfloat16"
        return name

    @property
    def act_bytes(self) -> int:
        """Bytes per activation element. XLA:CPU computes bfloat16 in float32 (observed in the HLO)."""
        return 4 if self.hw.backend == "cpu" else dtype_bytes(self.compute_dtype)

    def shards(self, group: ParamGroup) -> int:
        """Devices one copy of `group` is split over (pp splits the layer stack into stages; the dense
        first layers run before the pipeline, replicated over pp)."""
        n = _split(group, tuple(self.rules.items()), tuple(self.mesh.items()), None)
        return n * (self.mesh["pp"] if group.path.startswith("blocks/") else 1)

    def gathered(self, group: ParamGroup) -> bool:
        """Whether the fsdp all-gather splits `group` (a replicated one, as the norm scales under the
        default `norm` rule, is used where it lies)."""
        return _split(group, tuple(self.rules.items()), tuple(self.mesh.items()), None) > self.tp_shards(group)

    def tp_shards(self, group: ParamGroup) -> int:
        """How many ways tp (and, for expert weights, ep) splits `group`: its size after the fsdp
        all-gather is size / this (experts stay split over ep: jaxdist.parallel.moe)."""
        rules, mesh = tuple(self.rules.items()), tuple(self.mesh.items())
        ep = _split(group, rules, mesh, "ep") if "expert" in group.names else 1
        return _split(group, rules, mesh, "tp") * ep

    def validate(self) -> None:
        """Raise JaxdistError if this layout cannot run (divisibility of batch, layers, heads)."""
        m, cfg = self.mesh, self.cfg
        if set(m) != set(AXES):
            raise JaxdistError(f"mesh needs the axes {AXES}")
        per = self.batch_shards * self.accum * self.pipe_micro
        if cfg.train.global_batch % per:
            raise JaxdistError(
                f"train.global_batch={cfg.train.global_batch} does not split into {per} "
                f"(batch shards x accumulation x pipeline micro-batches)"
            )
        if self.cp > 1 and (cfg.model.seq_len % (2 * self.cp) or m["pp"] > 1):
            raise JaxdistError(f"cp={self.cp} needs model.seq_len divisible by {2 * self.cp} and pp=1")
        if self.cp > 1 and cfg.model.sliding_window:  # as parallel/context.py refuses it
            raise JaxdistError(f"cp={self.cp} with model.sliding_window={cfg.model.sliding_window} is not supported")
        if cfg.model.num_layers % (m["pp"] * self.repeats):
            raise JaxdistError(f"model.num_layers={cfg.model.num_layers} does not split into pp={m['pp']} stages")
        for g in param_table(cfg.model):
            self.shards(g)
        if m["pp"] > 1:  # the schedule's own refusals, as parallel/pipeline.plan asks them at start-up
            entry = schedule_registry.get(cfg.pipeline.schedule)
            if not entry.virtual and cfg.pipeline.repeats != 1:
                raise JaxdistError(
                    f"pipeline.repeats={cfg.pipeline.repeats} needs pipeline.schedule="
                    f"{schedule_registry.virtual_names()}; set pipeline.repeats=1 for {cfg.pipeline.schedule}"
                )
            entry.refuses(cfg, m["pp"], self.pipe_micro)
            if self.repeats > 1 and self.pipe_micro < m["pp"]:
                raise JaxdistError(
                    f"{cfg.pipeline.schedule} pipeline.repeats={self.repeats} needs pipeline.microbatches >= "
                    f"pp={m['pp']} (got {self.pipe_micro})"
                )
        refusals.check_sizes(cfg, m)  # the trainer's own start-up refusals: what train refuses is never planned
