"""Exports hold exactly the tensors transformers saves and loads: names and shapes against committed
key lists that transformers made (tests/fixtures/hf_keys/<Architecture>.json, scripts/fixtures/make_hf_keys.py:
for each tiny variant, what `save_pretrained` wrote and `from_pretrained` loaded back with no missing,
unexpected or mismatched key). So transformers loads jaxdist's exports with none either. One case per
(architecture, variant) file entry; torch and transformers are not needed here."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors import safe_open

from jaxdist.distributed import sharding
from jaxdist.distributed.mesh import mesh_from_string
from jaxdist.hf import export, mapping
from jaxdist.models.resolve import resolve

KEYS = Path(__file__).resolve().parent / "fixtures" / "hf_keys"
CASES = [
    (path.stem, name, variant)
    for path in sorted(KEYS.glob("*.json"))
    for name, variant in json.loads(path.read_text())["variants"].items()
]


def exported_tensors(out: Path) -> dict:
    tensors = {}
    for file in sorted(out.glob("*.safetensors")):
        with safe_open(str(file), "np") as f:
            tensors.update({k: list(f.get_slice(k).get_shape()) for k in f.keys()})  # noqa: SIM118 (safe_open is not iterable)
    return tensors


@pytest.mark.parametrize("arch,name,variant", CASES, ids=[f"{a}-{n}" for a, n, _ in CASES])
def test_export_holds_exactly_transformers_keys(tmp_path, arch, name, variant):
    source = tmp_path / "hf"
    source.mkdir()
    (source / "config.json").write_text(json.dumps(variant["config"]))
    cfg = mapping.hf_config(None, [], source)
    mesh = mesh_from_string("fsdp=1", jax.devices()[:1])
    abstract = resolve(cfg, mesh, sharding.DEFAULT_RULES).abstract
    params = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), abstract)
    export.export(params, cfg.model, tmp_path / "out", "float32", source_dir=source, log=lambda *a: None)
    got, want = exported_tensors(tmp_path / "out"), variant["tensors"]
    assert sorted(set(want) - set(got)) == [], "transformers would report these missing"
    assert sorted(set(got) - set(want)) == [], "transformers would report these unexpected"
    assert got == want  # and no shape mismatch
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == [arch]
