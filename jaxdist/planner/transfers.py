"""Host<->device bytes per device per step of the offload section, and their time at the hardware
table's host bandwidth (PCIe, NVLink-C2C).

The bytes are those the traced step moves (`jaxdist.distributed.offload.host_transfers` counts them; checked
against it in tests/test_offload.py), with P the stored parameters per device (P_L of them in the
layer stack), O the AdamW state and A the micro-batches:
  optimizer=host: O in for the update, O out with the result.
  params=host, per micro-batch: P in for the forward (the layer scan fetches each layer's slice, the
    embedding, norm and head are fetched before it); with a remat policy the backward fetches each
    layer again (P_L), without one it keeps the forward's fetched layer weights as residuals (counted:
    no second fetch). The gradients stay on the device (taken with respect to device zeros added to
    the fetched copies: jaxdist.distributed.offload.differentiable). Then P in and P out for the update.
  host to device = O + (A + 1) P + A P_L (remat), device to host = O + P.
  activations=host moves the policy's residuals: not modelled here (bench counts them).

Time: the link is full duplex, so a set of moves costs max(in, out) / host_bandwidth. The layer scan's
fetches are asynchronous copies XLA:GPU's scheduler can run beside the layers' compute (on the copy
engines, not the NVLink the collectives use): hidden behind compute in the overlapped step time, like
the FSDP gathers. That assumes each fetch is issued during the layer before (a prefetch XLA:GPU makes
with its pipelined host offloading or the double-buffered layer scan: docs/memory.md; unmeasured).
The rest (the embedding, norm and head fetched before each forward, the update's streaming) has
nothing to hide behind: exposed. The no-overlap step time adds all of it. An assumption until a GPU
measures it.
"""

from __future__ import annotations

import dataclasses

from jaxdist.planner import state_memory
from jaxdist.planner.layout import Layout


@dataclasses.dataclass(frozen=True)
class HostTraffic:
    host_to_device: float  # bytes per device per step
    device_to_host: float
    hidden_s: float  # seconds the layer scan's moves take (overlappable with compute)
    exposed_s: float  # seconds of the rest (added to the step)
    bandwidth: float  # bytes/s per direction (0: not in the hardware table; no time modelled)

    @property
    def total_s(self) -> float:
        return self.hidden_s + self.exposed_s


def _remat(lay: Layout) -> str:
    return "offload_dots" if lay.cfg.offload.activations == "host" else lay.cfg.model.remat


def host_traffic(lay: Layout) -> HostTraffic:
    o, a = lay.cfg.offload, lay.accum
    p = state_memory.param_bytes(lay) if o.params == "host" else 0.0
    p_layer = state_memory.stored_bytes(lay, lambda g: g.role == "layer") if o.params == "host" else 0.0
    opt = state_memory.optimizer_bytes(lay) if o.optimizer == "host" else 0.0
    refetch = p_layer if _remat(lay) != "none" else 0.0
    scan_in = a * (p_layer + refetch)  # inside the layer scan (overlappable): forward fetches, backward refetches
    h2d = opt + (a + 1) * p + a * refetch
    d2h = opt + p
    bw = lay.hw.host_bandwidth
    if not bw:
        return HostTraffic(h2d, d2h, 0.0, 0.0, 0.0)
    hidden = scan_in / bw
    exposed = max(h2d - scan_in, d2h) / bw
    return HostTraffic(h2d, d2h, hidden, exposed, bw)
