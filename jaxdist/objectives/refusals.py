"""Every start-up refusal of a (config, mesh) pair, as one-line errors: the one function the trainer
(`training.step.check`) and the planner (`planner.layout.Layout.validate`, so every candidate it sizes or
recommends) both call, so `plan` never proposes a command that `train` refuses. It lives in objectives/
because the objective registry's refusals are the highest-layer ones it gathers; it needs only the mesh's
axis sizes (`mesh.shape`), so the planner passes an abstract mesh of any device count.
"""

from __future__ import annotations

from jax.sharding import AbstractMesh

from jaxdist.adapters import checks as lora_checks
from jaxdist.config import Config
from jaxdist.distributed import offload, sharding
from jaxdist.distributed.mesh import AXES, axis_size, check_mesh
from jaxdist.errors import JaxdistError
from jaxdist.objectives import registry as objectives
from jaxdist.parallel import context, fp8
from jaxdist.parallel import moe as moe_parallel
from jaxdist.reduce import registry


def check(cfg: Config, mesh, rules) -> None:
    """Every start-up check that needs the mesh (a `Mesh` or anything with its `.shape`), before tracing."""
    check_mesh(mesh)  # its axes; the axis names the config uses were checked when it was loaded
    check_batch(cfg, mesh, rules)
    moe_parallel.check(cfg, mesh, rules)
    context.check(cfg, mesh, rules)
    lora_checks.check(cfg, mesh, rules)
    fp8.check(cfg, mesh)
    offload.check(cfg, mesh)
    registry.check(cfg, mesh)
    objectives.check(cfg, mesh)


def check_sizes(cfg: Config, sizes: dict[str, int]) -> None:
    """`check` on a mesh given as axis sizes (the planner's, of any device count: nothing is allocated)."""
    full = {a: int(sizes.get(a, 1)) for a in AXES}
    check(cfg, AbstractMesh(tuple(full.values()), tuple(full)), sharding.make_rules(cfg.mesh.rules))


def check_batch(cfg: Config, mesh, rules) -> None:
    shards = axis_size(mesh, sharding.batch_spec(rules)[0])
    per_step = cfg.train.grad_accum_steps * shards
    if cfg.train.global_batch % per_step:
        raise JaxdistError(
            f"train.global_batch={cfg.train.global_batch} must be divisible by train.grad_accum_steps="
            f"{cfg.train.grad_accum_steps} x {shards} batch shards (dp*fsdp*ep); use a multiple of {per_step}"
        )
