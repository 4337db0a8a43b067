import pytest

from jaxdist import config
from jaxdist.errors import JaxdistError


def test_defaults_load_and_overrides_apply():
    cfg = config.load(None, ["optim.lr=1e-3", "train.steps=7", "model.remat=full", "mesh.rules={embed: [fsdp, dp]}"])
    assert cfg.optim.lr == 1e-3 and cfg.train.steps == 7 and cfg.model.remat == "full"
    assert cfg.mesh.rules == {"embed": ["fsdp", "dp"]}
    assert cfg.model.d_model == 256 and cfg.train.global_batch == 8  # tiny.yaml


def test_dump_roundtrips(tmp_path):
    cfg = config.load(None, ["train.seed=3"])
    path = tmp_path / "c.yaml"
    path.write_text(config.dump(cfg))
    assert config.load(path) == cfg


@pytest.mark.parametrize("override, message", [
    ("train.stepz=3", "did you mean 'train.steps'"),
    ("trian.steps=3", "unknown config key 'trian'"),
    ("train.steps=abc", "train.steps must be int"),
    ("train.steps=2.5", "train.steps must be int"),
    ("model.tie_embeddings=3", "model.tie_embeddings must be bool"),
    ("optim.schedule=exp", "not one of cosine, linear, constant"),
    ("train.global_batch=0", "must be positive"),
    ("train.microbatches=3", "not divisible by train.microbatches=3"),
    ("model.num_kv_heads=3", "not a multiple of model.num_kv_heads"),
    ("train.profile_steps=5", "START:STOP"),
    ("steps=3", "section.key=value"),
])
def test_bad_values_are_one_line_errors(override, message):
    with pytest.raises(JaxdistError, match=message) as err:
        config.load(None, [override])
    assert "\n" not in str(err.value)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(JaxdistError, match="not found"):
        config.load(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed")
    with pytest.raises(JaxdistError, match="not valid YAML"):
        config.load(bad)


def test_replace_validates():
    cfg = config.load()
    assert cfg.replace(train=dict(steps=5)).train.steps == 5
    with pytest.raises(JaxdistError):
        cfg.replace(train=dict(steps=-1))


@pytest.mark.parametrize("name", ["tiny", "125m", "1b", "llama2-7b", "llama3-8b", "llama2-70b"])
def test_shipped_configs_load(name):
    assert config.load(config.DEFAULT_CONFIG.parent / f"{name}.yaml").model.num_layers > 0
