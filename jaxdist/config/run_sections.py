"""The sections of how a run trains and keeps its state: `mesh.*`, `optim.*`, `train.*`, `pipeline.*`,
`checkpoint.*`, `offload.*`. Each field's `# comment` is its documentation."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Literal

from jaxdist.config.types import Fraction, NonNegative, NonNegativeFloat, Positive, PositiveFloat, Range


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    shape: str = "fsdp=-1"  # mesh axis sizes, e.g. "dp=2,fsdp=4"; one -1 fills (--mesh)
    dcn: str = ""  # axes spanning hosts, e.g. "dp=2"; default: dp spans hosts when multi-process (--dcn-mesh)
    rules: dict[str, list[str]] = dataclasses.field(
        default_factory=dict
    )  # logical axis -> mesh axes ([] = replicated); merged into the defaults


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    name: Literal["adamw", "muon", "lion"] = (
        "adamw"  # optimizer (optim/registry.py); muon: Muon on the layers' matrices, AdamW on the rest
    )
    lr: PositiveFloat = 3e-3  # peak learning rate
    warmup_steps: NonNegative = 50  # linear warm-up from 0
    warmup_fraction: Fraction = 0.0  # > 0: warm-up is this fraction of the LR schedule's steps (replaces warmup_steps)
    schedule: Literal["cosine", "linear", "constant", "wsd"] = (
        "cosine"  # decay after warm-up; wsd: warm-up, stable at the peak, decay over the last decay_fraction
    )
    min_lr_ratio: Fraction = 0.1  # final lr / peak lr
    decay_fraction: Fraction = 0.2  # wsd: the final fraction of the LR schedule's steps that decays
    decay_steps: NonNegative = 0  # wsd: > 0: the decay's length in steps (replaces decay_fraction; a cool-down)
    decay_shape: Literal["linear", "cosine", "sqrt"] = "linear"  # wsd: the decay's shape (sqrt: 1 - sqrt(progress))
    muon_momentum: Annotated[float, Range(0, 1, hi_open=True)] = 0.95  # muon: momentum of the matrices' update
    muon_nesterov: bool = True  # muon: Nesterov momentum (torch.optim.Muon's default)
    muon_ns_steps: Positive = 5  # muon: Newton-Schulz iterations (coefficients 3.4445, -4.7750, 2.0315)
    muon_scale: Literal["match_rms_adamw", "original"] = (
        "match_rms_adamw"  # muon: update x 0.2*sqrt(max(A,B)) (Moonlight), or x sqrt(max(1, A/B)) (Keller Jordan)
    )
    weight_decay: NonNegativeFloat = 0.1  # AdamW decoupled decay (not on norms)
    clip_norm: NonNegativeFloat = 1.0  # global gradient-norm clip; 0 disables clipping
    b1: Annotated[float, Range(0, 1, hi_open=True)] = 0.9  # AdamW first-moment decay
    b2: Annotated[float, Range(0, 1, hi_open=True)] = 0.95  # AdamW second-moment decay
    eps: PositiveFloat = 1e-8  # AdamW epsilon
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"  # scale lr by global_batch / reference_batch
    reference_batch: Positive = 8  # the batch the lr was tuned for (lr_scaling)
    schedule_steps: NonNegative = 0  # steps the LR schedule spans; 0 = train.steps (pin it to extend a run unchanged)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: Positive = 300  # optimizer steps (--steps)
    global_batch: Positive = 8  # sequences per optimizer step
    grad_accum_steps: Positive = 1  # gradient accumulation: micro-batches summed per optimizer step
    seed: Annotated[int, Range(0, 2**32 - 1)] = 0  # parameter init and data order
    eval_every: NonNegative = 100  # steps between evals; 0 disables eval
    evals: NonNegative = 0  # > 0: sets eval_every = ceil(train.steps / evals): that many evals or fewer, one at the end
    eval_batches: NonNegative = 4  # held-out batches per eval (0: no eval, with a warning at start-up)
    eval_tasks: list[str] = dataclasses.field(
        default_factory=list
    )  # lm-eval tasks run at each eval on the training mesh, logged as eval/TASK/METRIC (the eval extra)
    eval_limit: NonNegative = 0  # examples per task at each in-training eval; 0: all of them
    eval_include_path: str = ""  # folder of your own task YAMLs for eval_tasks (lm-eval's --include_path)
    eval_batch_size: Positive = 8  # eval_tasks: requests per compiled batch
    log_every: Positive = 10  # steps between metric lines
    peak_flops: NonNegativeFloat = 0.0  # per device, for MFU; 0 = the datasheet peak (none on CPU: FLOP/s only)
    max_skipped_steps: Positive = 10  # consecutive non-finite steps before the run stops
    profile_steps: str = ""  # "10:15" writes a profiler trace for those steps
    trackers: list[str] = dataclasses.field(
        default_factory=lambda: ["tensorboard"]
    )  # several at once: tensorboard, wandb, mlflow (extras)
    plot: bool = True  # draw RUN_DIR/loss.png when the run ends (matplotlib); false: none (python -m jaxdist.plot draws it later)


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    schedule: Literal["gpipe", "circular", "1f1b", "1f1b_paired", "interleaved_1f1b", "zb_h1", "zb_v"] = (
        "gpipe"  # pipeline schedule (with pp > 1)
    )
    microbatches: NonNegative = 0  # pipeline micro-batches per step; 0 = pp (the minimum)
    repeats: Positive = 1  # circular, interleaved_1f1b: virtual stages (layer chunks) per device (zb_v: always 2)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: NonNegative = 100  # steps between saves; 0 disables periodic saves
    saves: NonNegative = 0  # > 0: sets every = ceil(train.steps / saves): that many saves or fewer, one at the end
    keep: Positive = 3  # newest checkpoints kept
    params_only: bool = False  # with --restore: load parameters alone (fine-tuning)
    async_save: bool = True  # write in the background while training goes on


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
    optimizer: Literal["none", "host"] = "none"  # host: AdamW state in pinned host memory, streamed in for the update
    params: Literal["none", "host"] = (
        "none"  # host: float32 parameters in pinned host memory, each layer fetched in the scan
    )
    activations: Literal["none", "host"] = "none"  # host: layer matmul outputs saved in host memory
