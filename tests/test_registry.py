"""The reduce.method registry: one entry for each value config accepts, and nothing else decides."""

import dataclasses
import typing
from pathlib import Path

import pytest

from jaxdist import config
from jaxdist.config.reduce_section import DilocoReduce, ReduceConfig
from jaxdist.errors import JaxdistError
from jaxdist.reduce import registry

PKG = Path(__file__).resolve().parent.parent / "jaxdist"


def test_registry_covers_exactly_the_methods_config_accepts():
    accepted = set(typing.get_args(typing.get_type_hints(ReduceConfig)["method"]))
    assert accepted == set(registry.METHODS)  # both ways: none missing, none extra
    assert all(name == m.name for name, m in registry.METHODS.items())
    # DiLoCo's outer codec names an entry with a codec (or dense)
    codecs = set(typing.get_args(typing.get_type_hints(DilocoReduce)["outer_codec"]))
    assert all(registry.METHODS[c].codec or c == "dense" for c in codecs)


def test_each_accepted_method_resolves_to_its_entry():
    for name in registry.METHODS:
        cfg = config.load(None, [f"reduce.method={name}"])
        assert registry.method(cfg).name == name
    topk = config.load(None, ["reduce.method=topk"])
    assert registry.method(topk) is registry.DGC  # reduce.topk.dgc=update: its default
    plain = config.load(None, ["reduce.method=topk", "reduce.topk.dgc=off"])
    assert registry.method(plain) is registry.METHODS["topk"]


def test_an_unknown_method_is_a_one_line_error():
    cfg = config.load(None, [])
    cfg = dataclasses.replace(cfg, reduce=dataclasses.replace(cfg.reduce, method="nope"))  # past validation
    with pytest.raises(JaxdistError, match=r"reduce.method='nope' is not one of implicit, dense, .*; pick one") as e:
        registry.method(cfg)
    assert "\n" not in str(e.value)


def test_no_other_module_compares_method_names():
    """Every decision on reduce.method (and objective.method) asks its registry. Not decisions: checkpoint/compat.py compares a
    saved config's value with this run's. Left: config/checks.py's one knob rule (reduce.error_feedback
    under topk's reduce.topk.dgc), which config.load checks before anything above the config layer loads."""
    allowed = {"registry.py", "checks.py"}
    offenders = []
    for path in PKG.rglob("*.py"):
        if path.name in allowed and path.parent.name in ("reduce", "config", "objectives"):
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if ".method ==" in code or ".method !=" in code or ".method in " in code:
                offenders.append(f"{path.relative_to(PKG)}:{i}: {line.strip()}")
    assert offenders == []


def test_refusals_are_asked_of_the_registry_up_front():
    """Per-replica methods refuse LoRA and host-resident parameters; DiLoCo refuses cp > 1."""
    import jax

    from jaxdist.distributed.mesh import mesh_from_string

    base = config.load(None, [])
    cases = [
        (dict(reduce=dict(method="int8"), lora=dict(rank=4)), "dp=8", "lora.rank > 0 with reduce.method=int8"),
        (dict(reduce=dict(method="dense"), offload=dict(params="host")), "dp=8", "offload.params=host is not"),
        (dict(reduce=dict(method="diloco")), "dp=4,cp=2", "reduce.method=diloco with cp=2 is not supported"),
    ]
    for change, mesh, words in cases:
        with pytest.raises(JaxdistError, match=words):
            registry.check(base.replace(**change), mesh_from_string(mesh, jax.devices()))
    registry.check(base.replace(lora=dict(rank=4)), mesh_from_string("dp=8", jax.devices()))  # implicit: fine
