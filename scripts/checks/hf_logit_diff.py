"""Imported logits vs transformers' (docs/huggingface.md): the largest |difference| on the committed fixture.

    python scripts/checks/hf_logit_diff.py [--fixture tests/fixtures/hf_llama] [--mesh fsdp=1 fsdp=4,tp=2]

Imports the fixture (a tiny random LlamaForCausalLM saved by transformers, scripts/fixtures/make_hf_fixture.py)
onto each mesh (8 simulated CPU devices) and prints, per mesh, max |logits - transformers' logits| on the
fixture's fixed sequences, float32, as one JSON line. The tests
(tests/test_hf.py::test_logits_match_transformers_*) bound the same figure by 1e-4. torch is not needed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
REPO = Path(__file__).resolve().parents[2]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--fixture", default=str(REPO / "tests" / "fixtures" / "hf_llama"))
    p.add_argument("--mesh", nargs="+", default=["fsdp=1", "fsdp=4,tp=2"])
    args = p.parse_args()
    from jaxdist.distributed.platform import setup_platform

    setup_platform(8)
    import jax
    import numpy as np
    from flax import nnx

    from jaxdist.distributed import sharding
    from jaxdist.distributed.mesh import mesh_from_string
    from jaxdist.hf import mapping, tensors

    fixture = Path(args.fixture)
    ref = np.load(fixture / "reference.npz")
    for mesh_text in args.mesh:
        n = math.prod(int(part.split("=")[1]) for part in mesh_text.split(","))
        cfg = mapping.hf_config(None, [], fixture, mesh_text)
        mesh = mesh_from_string(mesh_text, jax.devices()[:n])
        params, model = tensors.import_params(fixture, cfg, mesh)
        with sharding.activate(mesh, model.rules):
            out = np.asarray(jax.jit(lambda p, t, g=model.graphdef: nnx.merge(g, p)(t))(params, ref["sequences"]))
        diff = float(np.abs(out - ref["logits"]).max())
        print(json.dumps({"fixture": fixture.name, "mesh": mesh_text, "max_abs_logit_diff": diff}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
