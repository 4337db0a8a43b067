"""Per-device memory of one training step (`Memory`, `estimate`): the sum of the state
(`planner/state_memory.py`), the saved activations (`planner/activations.py`) and the backward's
temporaries (`planner/temporaries.py`), against the usable HBM.

These terms were revised against the compiled temp allocation. XLA's heap simulator packs it with
little waste (jaxdist.planner.heap replays its trace: the allocation is 0.0-1.8% above the bytes held at
its peak on most checked pairs, at most 8.7%), so a miss is a buffer the terms leave out or count
wrongly, not fragmentation — or a value XLA placed in a donated parameter buffer instead of temp
(heap.donated_live; 0-82% of the moment copies' bytes at the peak on 18 traced programs).
"""

from __future__ import annotations

import dataclasses

from jaxdist.planner.activations import activation_bytes, fetched_bytes, loss_side_bytes
from jaxdist.planner.layout import Layout
from jaxdist.planner.state_memory import (
    accumulator_bytes,
    batch_bytes,
    grad_bytes,
    host_bytes,
    optimizer_bytes,
    param_bytes,
    reference_bytes,
)
from jaxdist.planner.temporaries import loss_bytes, moment_copy_bytes, schedule_gradient_bytes, temporary_bytes

USABLE_FRACTION = 0.9  # of HBM: runtime, allocator fragmentation and buffers the model does not see
STATE_SCALARS = 2 * 4  # TrainState.step and .skipped (int32)


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes per device."""

    params: float
    grads: float
    optimizer: float
    activations: float  # saved for the backward pass (all layers / in-flight micro-batches)
    temporary: float  # the layers' working set in the backward (temporary_bytes)
    batch: float  # the step's input tokens
    capacity: float  # usable HBM
    loss: float = 0.0  # the loss's working set (loss_bytes)
    moment_copies: float = 0.0  # the old AdamW moments' copies, held through the step (moment_copy_bytes)
    host: float = 0.0  # of params + optimizer, what lives in host memory between steps (offload.*=host)
    fetched: float = 0.0  # offload.params=host without remat: the fetched layer weights the backward keeps
    loss_activations: float = 0.0  # what is live beside the loss's working set at its peak (loss_side_bytes)
    reference: float = 0.0  # a frozen reference copy of the parameters in the gradient stage's state (reference_bytes)

    @property
    def arguments(self) -> float:
        """What the compiled step receives in device memory: params + optimizer state + tokens, less what
        offload keeps in host memory (metrics.compiled_memory's device arguments)."""
        return self.params + self.optimizer + self.reference + self.batch + STATE_SCALARS - self.host

    @property
    def compiled_temp(self) -> float:
        """Comparable with memory_analysis().temp_size_in_bytes (see compiled_temp_bytes)."""
        return compiled_temp_bytes(self)

    @property
    def total(self) -> float:
        return self.arguments + self.compiled_temp + self.fetched

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(total=self.total, fits=self.fits)
        return d


def compiled_temp_bytes(mem: Memory) -> float:
    """What memory_analysis() calls temp: the peak of the backward pass — the saved activations, and
    either the loss's working set beside the moments' copies, taken at the step's start (before any
    layer gradient exists), or the gradients and the layers' working set (the copies included). The optimizer update adds no peak of its own: clip, AdamW and the non-finite guard fuse
    into elementwise passes that write the new parameters and moments into the donated state's buffers,
    reading the gradients and the old moments' copies, which the backward already holds."""
    return max(mem.activations + mem.grads + mem.temporary, mem.loss_activations + mem.loss + mem.moment_copies)


def estimate(lay: Layout) -> Memory:
    params = param_bytes(lay)
    grads = grad_bytes(lay) + (accumulator_bytes(lay) if lay.accum > 1 else 0) + schedule_gradient_bytes(lay)
    batch = batch_bytes(lay)
    return Memory(
        params=params,
        grads=grads,
        optimizer=optimizer_bytes(lay),
        activations=activation_bytes(lay),
        temporary=temporary_bytes(lay),
        batch=batch,
        capacity=lay.hw.hbm_bytes * USABLE_FRACTION,
        loss=loss_bytes(lay),
        moment_copies=moment_copy_bytes(lay),
        host=host_bytes(lay),
        fetched=fetched_bytes(lay),
        loss_activations=loss_side_bytes(lay),
        reference=reference_bytes(lay),
    )
