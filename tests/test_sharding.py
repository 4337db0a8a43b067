import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxdist import mesh, sharding, step
from jaxdist.errors import JaxdistError


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
    """No parameter is silently replicated: each has a dimension on fsdp under fsdp=8."""
    rules = sharding.make_rules()
    m = mesh.mesh_from_string("fsdp=8")
    abstract = nnx.state(nnx.eval_shape(lambda: step.make_model(tiny_cfg, rules)), nnx.Param)
    specs = nnx.to_pure_dict(sharding.state_specs(abstract, rules, m))
    flat = {k: v for k, v in _flatten(specs)}
    assert flat and all("fsdp" in str(spec) for spec in flat.values()), flat


def test_indivisible_dimension_is_a_start_up_error(tiny_cfg):
    cfg = tiny_cfg.replace(model=dict(num_kv_heads=1, num_heads=4))
    rules = sharding.make_rules()
    m = mesh.mesh_from_string("tp=2,fsdp=4")
    abstract = nnx.state(nnx.eval_shape(lambda: step.make_model(cfg, rules)), nnx.Param)
    with pytest.raises(JaxdistError, match="dimension 1 cannot be split over mesh axes tp"):
        sharding.state_specs(abstract, rules, m)


def _flatten(tree, prefix=""):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _flatten(v, f"{prefix}{k}/")
        else:
            yield f"{prefix}{k}", v
