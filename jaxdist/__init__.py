"""jaxdist: train models sharded over a device mesh.

The library's entry, for notebooks and scripts (docs/getting-started.md#from-python); the commands
(`python -m jaxdist.train` and the others) are the same calls behind argument parsing:

    jaxdist.setup_platform(8)                                 # before any JAX work: 8 simulated CPU devices
    cfg = jaxdist.config.load("tiny", ["train.steps=20"])     # a shipped config by name or a YAML path
    result = jaxdist.run(cfg, "runs/notebook")                # -> jaxdist.RunResult; errors: jaxdist.JaxdistError

These names load on first use: `import jaxdist` runs before every jaxdist module, the supervisor (which
never loads JAX) and the platform set-up (which must come before JAX) included, so it imports nothing.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "run": "jaxdist.training.loop",
    "RunResult": "jaxdist.training.finish",
    "JaxdistError": "jaxdist.errors",
    "setup_platform": "jaxdist.distributed.platform",
}
__all__ = sorted([*_EXPORTS, "config"])


def __getattr__(name: str):
    if name == "config":  # the package itself: load, dump, Config and its sections
        return importlib.import_module("jaxdist.config")
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
