"""The optimizer's own collectives: Muon moves each layer matrix whole for Newton–Schulz (optim.name=muon).

Read from jaxdist's compiled HLO (jaxdist.optim.muon.spread; tests/test_plan.py): where one mesh axis
splits a matrix stack and the stack's size divides over it (fsdp; dp x fsdp, whose dp replicates the
weights), the momentum-corrected gradient goes to whole matrices, stack split over that axis, and the
update comes back: 2 all-to-alls of the device's shard. Where two axes split it (fsdp x tp), or the
stack does not divide, each matrix is gathered whole on every device: the all-gathers of its shard
over the axes that split it, the ring bytes of one all-gather of the whole matrix (the way back is a
slice). AdamW and Lion are elementwise: nothing.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

from jaxdist.distributed.hlo import ring_bytes
from jaxdist.optim import muon
from jaxdist.optim import registry as optimizers
from jaxdist.planner import lora
from jaxdist.planner.layout import PARAM_BYTES, Layout, param_table
from jaxdist.planner.traffic import Traffic


def optimizer_traffic(lay: Layout) -> list[Traffic]:
    """Per step, the collectives the optimizer update adds (Muon's; none for the elementwise ones)."""
    if optimizers.entry(lay.cfg.optim).name != "muon":
        return []
    mesh, out = SimpleNamespace(shape=lay.mesh, manual_axes=()), []
    for g in lora.adapter_groups(lay) if lora.enabled(lay) else param_table(lay.cfg.model):
        axes = muon.matrix_axes(g.path, g.names)
        split = sorted(muon.split_axes(g.names, lay.rules, mesh)) if axes else []
        if axes is None or not split:  # no split without axes
            continue
        shard = g.size * PARAM_BYTES / lay.shards(g)
        axis = muon.whole_matrices_axis(math.prod(g.shape[i] for i in axes[0]), g.names, lay.rules, mesh)
        if axis:
            sent = 2 * ring_bytes("all-to-all", lay.mesh[axis], shard)
            out.append(Traffic(axis, "all-to-all", "Muon: matrices whole for Newton-Schulz, and back", sent, 2))
        else:
            k = math.prod(lay.mesh[a] for a in split)
            label = "fsdp" if "fsdp" in split else split[0]
            out.append(
                Traffic(
                    label,
                    "all-gather",
                    "Muon: matrices gathered whole",
                    ring_bytes("all-gather", k, shard * k),
                    len(split),
                )
            )
    return out
