"""jaxdist: train models sharded over a device mesh.

The library's entry, for notebooks and scripts (docs/getting-started.md#from-python); the commands
(`python -m jaxdist.train` and the others) are the same calls behind argument parsing:

    jaxdist.setup_platform(8)                                 # before any JAX work: 8 simulated CPU devices
    cfg = jaxdist.config.load("tiny", ["train.steps=20"])     # a shipped config by name or a YAML path
    result = jaxdist.run(cfg, "runs/notebook")                # -> jaxdist.RunResult; errors: jaxdist.JaxdistError

The names are plain: `config` (the package), `JaxdistError`, `setup_platform` and `RunResult` are imported
here, from modules that load no JAX (`import jaxdist` runs before every jaxdist module, the supervisor's and
the platform set-up's included); `run` is `jaxdist.training.loop.run`, which imports the library (JAX,
flax, optax, orbax) when called.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jaxdist import config
from jaxdist.config import Config
from jaxdist.distributed.platform import setup_platform
from jaxdist.errors import JaxdistError
from jaxdist.models import registry as _models  # noqa: F401  (declares each family's LoRA layout: adapters/layout.py)
from jaxdist.training.state import RunResult

__all__ = ["JaxdistError", "RunResult", "config", "run", "setup_platform"]


def run(cfg: Config, run_dir: Path | str, **options: Any) -> RunResult:
    """Train `cfg` and write `run_dir`: `jaxdist.training.loop.run` (options: log, restore, stopper, allowed,
    origin, tasks, rollouts; its docstring says what each does)."""
    # deferred: flax, jax, optax, orbax load on first use, not when python -m jaxdist.train, python -m jaxdist.plan starts
    from jaxdist.objectives import registry as objectives
    from jaxdist.training.loop import run as train

    if objectives.rollouts(cfg) and options.get("rollouts") is None:
        # deferred: GRPO's driver (the decoder, above training) loads only for GRPO configs
        from jaxdist.inference import rollout

        options["rollouts"] = rollout.for_run
    return train(cfg, run_dir, **options)
