import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxdist.distributed import mesh, sharding
from jaxdist.errors import JaxdistError
from jaxdist.training import step


def test_rules_to_specs():
    rules = sharding.make_rules()
    assert sharding.logical_to_spec(("embed", "mlp"), rules) == P("fsdp", "tp")
    assert sharding.logical_to_spec(("batch", None), rules) == P(("dp", "fsdp", "ep"), None)
    assert sharding.logical_to_spec(("expert", "embed", "mlp"), rules) == P("ep", "fsdp", "tp")
    assert sharding.logical_to_spec(("layers", "embed"), rules) == P(None, "fsdp")


def test_unknown_name_and_conflict_are_loud():
    rules = sharding.make_rules()
    with pytest.raises(JaxdistError, match="'experts' has no sharding rule"):
        sharding.logical_to_spec(("experts", "embed"), rules)
    clash = sharding.make_rules({"mlp": ["fsdp"]})
    with pytest.raises(JaxdistError, match="both map to mesh axis 'fsdp'"):
        sharding.logical_to_spec(("embed", "mlp"), clash)


def test_every_parameter_is_sharded_under_fsdp(tiny_cfg):
    """No parameter is silently replicated: each has a dimension on fsdp under fsdp=8, but for the norm
    scales, which the default `norm` rule replicates on purpose (a few kilobytes; no gather)."""
    rules = sharding.make_rules()
    m = mesh.mesh_from_string("fsdp=8")
    abstract = nnx.state(nnx.eval_shape(lambda: step.make_model(tiny_cfg)), nnx.Param)
    specs = nnx.to_pure_dict(sharding.state_specs(abstract, rules, m))
    flat = {k: v for k, v in _flatten(specs)}
    replicated = {k for k, spec in flat.items() if "fsdp" not in str(spec)}
    assert flat and replicated == {k for k in flat if k.endswith("norm/scale")} and len(replicated) == 3, flat


def test_indivisible_dimension_is_a_start_up_error(tiny_cfg):
    cfg = tiny_cfg.replace(model=dict(num_kv_heads=1, num_heads=4))
    rules = sharding.make_rules()
    m = mesh.mesh_from_string("tp=2,fsdp=4")
    abstract = nnx.state(nnx.eval_shape(lambda: step.make_model(cfg)), nnx.Param)
    with pytest.raises(JaxdistError, match="dimension 1 cannot be split over mesh axes tp"):
        sharding.state_specs(abstract, rules, m)


def _flatten(tree, prefix=""):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _flatten(v, f"{prefix}{k}/")
        else:
            yield f"{prefix}{k}", v


def _constraint_specs(fn, x) -> list[str]:
    """The sharding constraints `fn` traces to, as written in its lowered StableHLO."""
    text = jax.jit(fn).lower(x).as_text()
    return re.findall(r"sdy\.sharding_constraint \S+ <@\w+, \[(.*?)\]>", text)


def test_constrain_reads_the_rules_of_the_active_context():
    """No rules, no constraint; under `activate` the rules decide the spec, and a nested `use_rules`
    overrides them only inside its block. (Each case traces a new function: JAX caches a trace by
    function and mesh, not by the rules, which is why a program's steps set their own.)"""
    m = mesh.mesh_from_string("fsdp=4,tp=2")
    x = jax.ShapeDtypeStruct((8, 4), jnp.float32)

    def specs():
        return _constraint_specs(lambda a: sharding.constrain(a * 2, ("batch", "mlp")), x)

    with jax.set_mesh(m):
        assert specs() == []  # a mesh but no rules: layers add nothing
    with sharding.activate(m, sharding.make_rules()):
        assert specs() == ['{"dp", "fsdp", "ep"}, {"tp"}']
        with sharding.use_rules(sharding.make_rules({"batch": [], "mlp": ["fsdp"]})):
            assert specs() == ['{}, {"fsdp"}']
        assert sharding.current_rules()["mlp"] == ("tp",)
    assert sharding.current_rules() is None


def test_program_steps_trace_under_their_own_rules(tiny_cfg):
    """A program's steps carry its rules however they are called (no context set by the caller): the
    fsdp=8 train step's parameters stay sharded, and an override in mesh.rules reaches the layers."""
    cfg = tiny_cfg.replace(model=dict(num_layers=1), train=dict(global_batch=8))
    prog = step.build_program(cfg, mesh.mesh_from_string("fsdp=8"))
    assert sharding.current_rules() is None
    tokens = jax.ShapeDtypeStruct((8, cfg.model.seq_len + 1), jnp.int32)
    text = prog.eval_step.lower(prog.abstract_state.params, tokens).as_text()
    assert text.count("sharding_constraint") > 0
    assert prog.rules == prog.model.rules == sharding.make_rules(cfg.mesh.rules)
