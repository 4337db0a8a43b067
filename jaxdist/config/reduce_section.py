"""`reduce.*`: the data-parallel reduction (`ReduceConfig`) and each method's own section (`reduce.topk`,
`reduce.powersgd`, `reduce.int8`, `reduce.diloco`, `reduce.demo`). Each field's `# comment` is its documentation."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Literal

from jaxdist.config.types import NonNegative, NonNegativeFloat, Positive, PositiveFloat, Range


@dataclasses.dataclass(frozen=True)
class TopkReduce:
    dgc: Literal["update", "gradient", "off"] = (
        "update"  # DGC momentum correction on each replica's Adam-scaled update (gradient: the sum fed to Adam with b1=0; off: plain error feedback)
    )
    warmup_density: Annotated[float, Range(0, 1, lo_open=True)] = (
        0.0625  # with dgc: density at the start of the sparsity warm-up, at most 25x reduce.ratio (falls to reduce.ratio over reduce.warmup_fraction)
    )


@dataclasses.dataclass(frozen=True)
class PowerSGDReduce:
    rank: Positive = 4  # rank of the low-rank factors


@dataclasses.dataclass(frozen=True)
class Int8Reduce:
    block_size: Positive = 256  # entries per scale (also diloco's outer_codec=int8)


@dataclasses.dataclass(frozen=True)
class DilocoReduce:
    sync_every: Positive = 16  # local steps between outer steps (H)
    outer_lr: PositiveFloat = 1.0  # outer SGD learning rate on the pseudo-gradient (1, momentum 0: averaging)
    outer_momentum: Annotated[float, Range(0, 1, hi_open=True)] = 0.0  # outer Nesterov momentum (paper: 0.9, lr 0.7)
    outer_codec: Literal["dense", "int8", "topk"] = (
        "dense"  # how the pseudo-gradient crosses dp (int8: reduce.int8.block_size; topk: reduce.ratio, dgc off)
    )


@dataclasses.dataclass(frozen=True)
class DemoReduce:
    momentum_decay: Annotated[float, Range(0, 1)] = 0.999  # decay of each replica's unsent momentum
    chunk: Positive = 64  # side of the DCT tiles (at most chunk x chunk entries; divisors of each dim)


@dataclasses.dataclass(frozen=True)
class ReduceConfig:
    """The data-parallel reduction: the method and the options several methods share; each method's
    own options in its section (`reduce.topk.dgc`, `reduce.diloco.sync_every`, ...)."""

    method: Literal["implicit", "dense", "topk", "powersgd", "int8", "diloco", "demo"] = (
        "implicit"  # implicit: XLA inserts it
    )
    dtype: Literal["float32", "bfloat16"] = (
        "float32"  # the gradient reduction's dtype: dense's all-reduce; implicit's reduce-scatter / all-reduce of the bf16 weight gradients (layers, head) under model.compute_dtype=bfloat16. float32 by default: a bf16 sum over many replicas rounds each partial sum to 8 bits of mantissa (torchtitan's FSDP2 also reduces in float32); bfloat16 halves the bytes (MaxText's choice)
    )
    axis: str = "dp"  # the mesh axis reduced explicitly
    ratio: Annotated[float, Range(0, 1, lo_open=True)] = (
        0.01  # topk, demo: fraction of entries kept per chunk (topk: of <= 65536 entries; demo: of DCT coefficients)
    )
    error_feedback: bool = True  # topk (dgc=off; DGC always accumulates), powersgd, int8, diloco's codec: keep what was not sent and add it next step
    start_step: NonNegative = 0  # topk, powersgd: dense before this step (or warmup_fraction, the larger)
    warmup_fraction: Annotated[float, Range(0, 1, hi_open=True)] = (
        0.1  # topk, powersgd: warm-up for this fraction of train.steps (at least start_step): dense (torch's advice), or DGC's density warm-up
    )
    freeze_variance: bool = (
        False  # topk, powersgd: freeze Adam's second moment after the warm-up (1-bit Adam; topk: dgc=off only)
    )
    variance_floor: NonNegativeFloat = 0.01  # frozen second moments floored at this times their tensor's mean
    topk: TopkReduce = dataclasses.field(default_factory=TopkReduce)  # method=topk's own options
    powersgd: PowerSGDReduce = dataclasses.field(default_factory=PowerSGDReduce)  # method=powersgd's own options
    int8: Int8Reduce = dataclasses.field(default_factory=Int8Reduce)  # method=int8's own options
    diloco: DilocoReduce = dataclasses.field(default_factory=DilocoReduce)  # method=diloco's own options
    demo: DemoReduce = dataclasses.field(default_factory=DemoReduce)  # method=demo's own options
