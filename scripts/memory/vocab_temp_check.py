"""The blockwise loss's vocabulary-attributable temp, held two-sided, on any mesh of 8 CPU devices.

    nice -n 10 python scripts/memory/vocab_temp_check.py [--mesh fsdp=8 tp=2,fsdp=4]

The check of tests/test_loss.py::test_vocabulary_attributable_temp_bytes (jaxdist.analysis.measure's
vocabulary_temp_misses: the tiny model at tests/test_loss.py's SMALL shape, V=8192 against V=256, four
compiles per mesh, under the suite's XLA flags), for the meshes the suite does not compile: the test holds
tp=2,fsdp=4, this script fsdp=8 by default. Prints one JSON line per mesh (bytes per device) and exits 1 if a bound misses.
"""

import argparse
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite's compile flags (xla_flags.FAST_CPU_COMPILE, as tests/conftest.py), under which the test's bounds are set: under
# XLA:CPU's defaults (this script without these flags), fsdp=8's kept-logits temp measured 8.54 MB, above the
# bound's 5.77 MB: buffer assignment differs.
from jaxdist.distributed.xla_flags import FAST_CPU_COMPILE as SUITE_XLA_FLAGS  # no jax

os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *SUITE_XLA_FLAGS]).strip()

SMALL = dict(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128, seq_len=32)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mesh", nargs="+", default=["fsdp=8"])
    args = p.parse_args()
    from jaxdist import config
    from jaxdist.analysis import measure
    from jaxdist.distributed import mesh as mesh_mod
    from jaxdist.distributed.platform import setup_platform

    setup_platform(8)
    cfg = config.load(None, ["train.steps=10", "optim.warmup_steps=2", "train.eval_every=0"])
    cfg = cfg.replace(model=SMALL, optim=dict(warmup_steps=2, lr=1e-3))
    failed = False
    for mesh in args.mesh:
        figures, misses = measure.vocabulary_temp_misses(cfg, mesh_mod.mesh_from_string(mesh))
        print(json.dumps({"mesh": mesh, **figures, "misses": misses}), flush=True)
        failed |= bool(misses)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
