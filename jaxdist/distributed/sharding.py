"""Logical axis rules -> PartitionSpecs for parameters, optimizer state, batches and activations.

The model names logical axes only ("embed", "mlp", ...). Rules are data: a mapping from each logical
name to a tuple of mesh axes (empty = replicated). Every name must have a rule, no mesh axis may be
used twice in one array, and sharded dimensions must divide evenly — checked at start-up, loudly.

The rules are built once per program (`make_rules(cfg.mesh.rules)`) and set by a context beside the
mesh (`activate(mesh, rules)`, as `jax.set_mesh` sets the mesh); layers read them through
`constrain()` while they are traced, so no module stores them. JAX caches a trace by function and
mesh, not by these rules: trace one function under one set of rules (a program's steps set their own,
`step.Program`), or wrap it anew.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.config.axes import DEFAULT_RULES
from jaxdist.distributed.mesh import axis_size
from jaxdist.errors import JaxdistError

Rules = Mapping[str, tuple[str, ...]]


def make_rules(overrides: Mapping[str, Any] | None = None) -> dict[str, tuple[str, ...]]:
    """Defaults updated with config overrides (`mesh.rules: {embed: [fsdp, dp]}`)."""
    rules = dict(DEFAULT_RULES)
    for name, axes in (overrides or {}).items():
        rules[name] = tuple(axes)
    return rules


_RULES: contextvars.ContextVar[Rules | None] = contextvars.ContextVar("jaxdist_rules", default=None)


@contextlib.contextmanager
def use_rules(rules: Rules | None) -> Iterator[None]:
    """Set the logical rules that `constrain()` and the parallel layers read while tracing."""
    token = _RULES.set(None if rules is None else {k: tuple(v) for k, v in rules.items()})
    try:
        yield
    finally:
        _RULES.reset(token)


def current_rules() -> Rules | None:
    """The rules set by `use_rules`/`activate`; None outside one (layers then add no constraints)."""
    return _RULES.get()


@contextlib.contextmanager
def activate(mesh: Mesh, rules: Rules | None) -> Iterator[None]:
    """`jax.set_mesh(mesh)` and `use_rules(rules)` together: trace and call sharded programs inside."""
    with jax.set_mesh(mesh), use_rules(rules):
        yield


def logical_to_spec(names: tuple[str | None, ...], rules: Rules, what: str = "array") -> P:
    """('embed', 'mlp') -> P('fsdp', 'tp'). None stays unsharded."""
    used: dict[str, str] = {}
    spec = []
    for name in names:
        if name is None:
            spec.append(None)
            continue
        if name not in rules:
            raise JaxdistError(
                f"{what}: logical axis '{name}' has no sharding rule; add it under mesh.rules "
                f"(e.g. mesh.rules.{name}: []) — known: {', '.join(sorted(rules))}"
            )
        axes = tuple(rules[name])
        for axis in axes:
            if axis in used:
                raise JaxdistError(
                    f"{what}: logical axes '{used[axis]}' and '{name}' both map to mesh axis '{axis}'; "
                    "change mesh.rules so each mesh axis shards one dimension"
                )
            used[axis] = name
        spec.append(axes[0] if len(axes) == 1 else (axes or None))
    return P(*spec)


def check_divisible(shape: tuple[int, ...], spec: P, mesh: Mesh, what: str) -> None:
    for dim, entry in zip(shape, spec):
        if dim % axis_size(mesh, entry):
            raise JaxdistError(
                f"{what}: dimension {dim} cannot be split over mesh axes {entry} "
                f"(size {axis_size(mesh, entry)}); choose a mesh whose axis sizes divide it"
            )


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def logical_names(state) -> Any:
    """Pytree of logical-name tuples, one per variable of an (abstract) nnx.State."""

    def names(path, var):
        meta = var.get_metadata()
        found = meta.get("out_sharding") or meta.get("sharding_names") or meta.get("sharding")
        if found is None:
            raise JaxdistError(
                f"parameter {jax.tree_util.keystr(path)} has no logical axis names; create it with sharding_names=(...)"
            )
        return tuple(found)

    return jax.tree_util.tree_map_with_path(names, state, is_leaf=_is_var)


def state_specs(state, rules: Rules, mesh: Mesh | None = None):
    """PartitionSpecs for every variable of an nnx.State, validated against `mesh` when given."""

    def spec(path, var):
        what = f"parameter {jax.tree_util.keystr(path)}"
        names = logical_names(var)
        value = var.get_value() if hasattr(var, "get_value") else var.value
        if len(names) != len(value.shape):
            raise JaxdistError(f"{what}: {len(names)} logical names for shape {value.shape}")
        s = logical_to_spec(names, rules, what)
        if mesh is not None:  # its axes are jaxdist.distributed.mesh's (mesh.check_mesh; names checked in config)
            check_divisible(value.shape, s, mesh, what)
        return s

    return jax.tree_util.tree_map_with_path(spec, state, is_leaf=_is_var)


def named(mesh: Mesh, specs):
    """PartitionSpec pytree -> NamedSharding pytree."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def batch_spec(rules: Rules, ndim: int = 2) -> P:
    return logical_to_spec(("batch",) + (None,) * (ndim - 1), rules, "batch")


def constrain(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """Activation sharding constraint by logical names under the current rules; a no-op outside a mesh
    context or without rules. Inside `shard_map` the manual axes (e.g. dp for the explicit gradient
    reduction) are already split by hand, so they are dropped from the constraint."""
    mesh, rules = jax.sharding.get_abstract_mesh(), current_rules()
    if rules is None or mesh.empty:
        return x
    spec = logical_to_spec(names, rules, "activation")
    if mesh.manual_axes:
        spec = drop_axes(spec, set(mesh.manual_axes))
    return jax.lax.with_sharding_constraint(x, spec)


def drop_axes(spec: P, axes: set[str]) -> P:
    """P(('dp', 'fsdp'), 'tp') without {'dp'} -> P('fsdp', 'tp')."""
    out = []
    for entry in spec:
        kept = tuple(a for a in ((entry,) if isinstance(entry, str) else entry or ()) if a not in axes)
        out.append(kept[0] if len(kept) == 1 else (kept or None))
    return P(*out)
