"""Host offload (the `offload` config section): what lives in pinned host memory between steps, how a
traced function brings it to the device, the one-line refusals, and the bytes each kind moves per step.

- offload.optimizer=host: the AdamW state is host-resident; the step streams it in for the update.
- offload.params=host: the float32 parameters are host-resident. The layer scan fetches each layer's
  slice inside its body (`fetch`), so only the layer being computed is on the device (its backward
  fetches it again); the other parameters (embedding, final norm, head) are fetched before the model
  runs. Gradients flow back through the transfers (the transpose of a device_put is one back to where
  its operand lived), and the update streams parameters in and out like the optimizer state.
- offload.activations=host: the remat policy of the layer scan saves the block's residuals to host
  memory (`activation_policy`) instead of keeping them on the device or recomputing them.
"""

from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name

from jaxdist.errors import JaxdistError

HOST_KIND = "pinned_host"
FETCHED = "offload_fetched"  # checkpoint name of a fetched (device) copy: refetched in the backward, never saved
# The layer scan's remat policy when parameters are offloaded and model.remat=none: keep every residual
# but the fetched weights, so one layer's device copy is live at a time, not the whole stack.
REFETCH_POLICY = jax.checkpoint_policies.save_anything_except_these_names(FETCHED)


def on_host(x) -> bool:
    """Whether a traced (or concrete) array lives in host memory."""
    return getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host


def fetch(tree):
    """Every host-resident array of `tree` copied to device memory (same sharding); the rest as is.
    Traced inside jit: XLA moves the bytes where the copy is used (per layer inside the scan)."""

    def one(x):
        return checkpoint_name(jax.device_put(x, jax.memory.Space.Device), FETCHED) if on_host(x) else x

    return jax.tree.map(one, tree)


def activation_policy():
    """The remat policy of offload.activations=host: the layer's matmul outputs (those without batch
    dimensions in their contraction, what model.remat=dots_saveable keeps on the device) are saved to
    pinned host memory and brought back for the backward pass; the rest is recomputed."""
    return jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", HOST_KIND)


def check(cfg, mesh) -> None:
    """One-line errors for what offload does not compose with (yet)."""
    if cfg.offload.activations == "host" and cfg.model.remat not in ("none", "offload_dots"):
        raise JaxdistError(
            f"offload.activations=host picks the layer's remat policy itself; it conflicts with "
            f"model.remat={cfg.model.remat}: set model.remat=none (or offload.activations=none)"
        )
    if cfg.offload.params != "host":
        return
    pp = dict(mesh.shape).get("pp", 1)
    if pp > 1:
        raise JaxdistError("offload.params=host is not supported with pipeline parallelism (pp > 1); use pp=1")
    if cfg.lora.rank:
        raise JaxdistError(
            "offload.params=host is not supported with LoRA (lora.rank > 0) yet; use offload.params=none"
        )


def bytes_per_step(cfg, param_bytes: int, opt_bytes: int) -> dict[str, int]:
    """Host<->device bytes per device per optimizer step each offload moves (both directions together):
    optimizer: the state in and out once; params, per micro-batch: in for the forward and again for the
    backward, the gradients out (the transpose of the fetch) and back in to be summed; then in and out
    for the update. A model of the program, not read from it. Activations depend on the policy's
    residuals and are not counted here."""
    out = {}
    if cfg.offload.optimizer == "host":
        out["optimizer"] = 2 * opt_bytes
    if cfg.offload.params == "host":
        out["params"] = (4 * cfg.train.grad_accum_steps + 2) * param_bytes
    return out
