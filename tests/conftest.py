"""Eight simulated CPU devices for every test; must run before any JAX work."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402

from jaxdist import config  # noqa: E402


@pytest.fixture(scope="session")
def tiny_cfg():
    """The CPU default with a short schedule; tests shrink it further with cfg.replace(...)."""
    return config.load(None, ["train.steps=10", "optim.warmup_steps=2", "train.eval_every=0"])
