"""The model registry (jaxdist/models/registry.py): every family is computed by one architecture, its
parameters carry only the logical axes its entry names (so the default rules place them), its
parameter count is the model's, another architecture's fields are refused and stay out of run names,
and an unsupported config.json is one line naming what is supported."""

from __future__ import annotations

import json
import math
import typing
from pathlib import Path

import jax
import pytest
import yaml
from conftest import SHAPES, SMALL_MODEL
from flax import nnx

from jaxdist.config import ModelConfig
from jaxdist.distributed import sharding
from jaxdist.errors import JaxdistError
from jaxdist.hf import families, mapping
from jaxdist.models import registry


def test_every_family_has_one_architecture():
    names = [f for a in registry.ARCHITECTURES.values() for f in a.families]
    assert len(names) == len(set(names))
    assert set(names) == set(typing.get_args(typing.get_type_hints(ModelConfig)["family"]))
    assert set(families.NAMES) == set(names) and set(SHAPES) <= set(names)


def test_every_family_has_a_shape_here():
    assert set(SHAPES) == set(registry.BY_FAMILY)


@pytest.mark.parametrize("family", list(SHAPES))
def test_parameters_carry_the_entrys_axes_and_count(family):
    m = ModelConfig(**SMALL_MODEL, family=family, **SHAPES[family])
    arch = registry.of(m)
    model = nnx.eval_shape(lambda: arch.model(m, nnx.Rngs(params=0)))
    state = nnx.state(model, nnx.Param)
    names = jax.tree.leaves(sharding.logical_names(state), is_leaf=lambda n: isinstance(n, tuple))
    used = {a for n in names for a in n if a is not None}
    assert used <= arch.axes, used - arch.axes
    assert used <= set(sharding.make_rules({})) | {"layers"}  # the default rules place every one
    total = sum(math.prod(x.shape) for x in jax.tree.leaves(state))
    assert arch.count_params(m)["total"] == total


def test_another_architectures_field_is_refused():
    field = sorted(registry.OWNED)[0]
    owner = registry.ARCHITECTURES[registry.OWNED[field]]
    other = next(f for f in registry.BY_FAMILY if f not in owner.families)
    default = getattr(ModelConfig(), field)
    value = (default or 0) + 3 if not isinstance(default, bool) else not default
    with pytest.raises(JaxdistError, match=f"model.{field}=.*read only by model.family"):
        registry.of(ModelConfig(family=other, **{field: value}))


def test_unsupported_model_type_is_one_line_naming_the_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(JaxdistError) as e:
        mapping.model_fields(tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and "GPT2LMHeadModel" in msg
    assert all(f.architecture in msg for f in families.FAMILIES.values())


def test_other_architectures_fields_stay_out_of_run_names():
    """The default config is named as before any architecture added fields; a Gemma 3 run's name
    does depend on its own fields."""
    from jaxdist.config import Config
    from jaxdist.training import rundir

    assert registry.OWNED and rundir.identity(Config()) == "bef0e0b4"
    gemma = Config().replace(model=dict(family="gemma3", sliding_window=4, sliding_window_pattern=2))
    assert rundir.identity(gemma) != rundir.identity(gemma.replace(model=dict(rope_local_theta=500.0)))


def test_the_planner_offers_only_meshes_the_architecture_takes():
    """Gemma 3's entry refuses cp, and pp under a table schedule (gpipe's pp it takes); the planner's
    candidate filter asks the same check."""
    from jaxdist import config
    from jaxdist.planner.candidates import architecture_takes

    gemma, llama = config.load("configs/gemma3-12b.yaml"), config.load("configs/llama3-8b.yaml")
    base = {"dp": 1, "fsdp": 8, "tp": 1, "pp": 1, "cp": 1, "ep": 1}
    assert architecture_takes(gemma, base) and architecture_takes(llama, {**base, "pp": 2})
    assert architecture_takes(gemma, {**base, "pp": 2}) and not architecture_takes(gemma, {**base, "cp": 2})
    assert not architecture_takes(gemma.replace(pipeline=dict(schedule="1f1b")), {**base, "pp": 2})


FIXTURES = Path(__file__).resolve().parent / "fixtures"
# architecture: (transformers fixture, the fields its config.json sets, the shipped real-shape config)
PRINTED = {
    "gemma3": ("hf_gemma3", {"num_layers": 4, "sliding_window": 4, "sliding_window_pattern": 2, "tie_embeddings": True}, "gemma3-12b"),
    "gpt_oss": ("hf_gpt_oss", {"sliding_window": 4, "swiglu_alpha": 1.702, "swiglu_limit": 1.0, "moe_experts": 4}, "gpt-oss-20b"),
    "deepseek_v3": (
        "hf_deepseek_v3",
        {"mla_q_rank": 24, "mla_kv_rank": 16, "mla_nope_dim": 8, "mla_rope_dim": 4, "mla_v_dim": 6, "dense_layers": 1,
         "moe_groups": 4, "moe_topk_groups": 2, "moe_routed_scale": 2.5},
        "deepseek-v3",
    ),
    "qwen3_next": (
        "hf_qwen3_next",
        {"linear_key_heads": 2, "linear_value_heads": 4, "linear_key_dim": 8, "linear_value_dim": 6,
         "linear_conv_kernel": 4, "moe_shared_dim": 24},
        "qwen3-next-80b-a3b",
    ),
}  # fmt: skip


@pytest.mark.parametrize("family", list(PRINTED))
def test_print_config_of_each_architecture(family, tmp_path, capsys):
    """`train --restore hf:DIR --print-config` prints the architecture's resolved config (its own fields read
    from config.json) without compiling anything, the printed YAML given back as --config prints itself,
    and the shipped real-shape config prints under the same family."""
    from jaxdist import train

    fixture, fields, shipped = PRINTED[family]
    assert train.main(["--restore", f"hf:{FIXTURES / fixture}", "--print-config"]) == 0
    text = capsys.readouterr().out
    model = yaml.safe_load(text)["model"]
    assert model["family"] == family and {k: model[k] for k in fields} == fields
    (tmp_path / "printed.yaml").write_text(text)
    assert train.main(["--config", str(tmp_path / "printed.yaml"), "--print-config"]) == 0
    assert capsys.readouterr().out == text
    assert train.main(["--config", shipped, "--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["model"]["family"] == family
