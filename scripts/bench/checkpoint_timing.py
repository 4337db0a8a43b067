"""How long a checkpoint blocks the training loop vs how long it takes to write, and how long a restore takes.

    python scripts/bench/checkpoint_timing.py                      # configs/tiny.yaml
    python scripts/bench/checkpoint_timing.py --config configs/125m.yaml --mesh fsdp=8

Builds the train state (no train step is compiled), saves it three times through `jaxdist.checkpoint.Saver`
(the first save includes orbax's one-off set-up) and restores the latest. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None)
    p.add_argument("--mesh", default="fsdp=-1")
    p.add_argument("--cpu-devices", type=int, default=8)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary folder, removed after)")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()

    from jaxdist.distributed.platform import setup_platform

    setup_platform(args.cpu_devices)
    import jax

    from jaxdist import checkpoint, config
    from jaxdist.data import loader as loader_mod
    from jaxdist.distributed.mesh import mesh_from_string
    from jaxdist.models import registry
    from jaxdist.training import step

    # data.source=text (the built-in corpus): configs that expect token files run anywhere
    cfg = config.load(args.config, ["data.source=text", "data.path=", f"mesh.shape={args.mesh}", *args.overrides])
    prog = step.build_program(cfg, mesh_from_string(cfg.mesh.shape))
    loader = loader_mod.Loader(cfg, prog.batch_sharding)
    state = prog.init_state(0)
    jax.block_until_ready(state)
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))

    root = Path(args.dir or tempfile.mkdtemp(prefix="ckpt-timing-"))
    saver = checkpoint.Saver(root, cfg, log=lambda *a: None)
    for s in (1, 2, 3):
        saver.save(state, s, loader)
        saver.manager.wait_until_finished()
        saver.poll()
    saver.close()

    start = time.perf_counter()
    restored = checkpoint.restore(root, prog, loader, cfg, log=lambda *a: None)
    jax.block_until_ready(restored.state)
    restore_s = time.perf_counter() - start

    print(
        json.dumps(
            {
                "config": args.config or "configs/tiny.yaml",
                "params": registry.of(cfg.model).count_params(cfg.model)["total"],
                "state_bytes": state_bytes,
                "devices": len(jax.devices()),
                "backend": jax.default_backend(),
                "saves": saver.timings,
                "restore_s": restore_s,
            }
        )
    )
    if args.dir is None:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
