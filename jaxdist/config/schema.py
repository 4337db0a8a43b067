"""The configuration's sections as typed, frozen dataclasses, and building a validated `Config` from
nested dicts. Each field's `# comment` is its documentation (`--help`, docs/configuration.md)."""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Annotated, Any, Literal

from jaxdist.config.checks import LORA_TARGETS, validate
from jaxdist.config.types import (
    Fraction,
    NonNegative,
    NonNegativeFloat,
    Positive,
    PositiveFloat,
    Range,
    YamlWord,
    _base,
    _field_types,
    _type_name,
)
from jaxdist.errors import JaxdistError


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    num_layers: Positive = 4  # decoder blocks
    d_model: Positive = 256  # residual stream width
    num_heads: Positive = 4  # query heads
    num_kv_heads: Positive = 2  # key/value heads (grouped-query attention; divides num_heads)
    head_dim: Positive = 64  # per-head width (even: rotary embeddings)
    mlp_dim: Positive = 1024  # SwiGLU hidden width
    seq_len: Positive = 128  # training window in tokens
    vocab_size: Positive = 256  # 256 = bytes
    tie_embeddings: bool = False  # the output head reuses the embedding table
    rope_theta: PositiveFloat = 10000.0  # rotary base frequency
    rope_scaling: Literal["none", "llama3", "linear", "yarn"] = (
        "none"  # llama3: Llama 3.1/3.2 frequency rescale (factors below); linear (gemma3's full layers): / rope_factor; yarn (gpt_oss, deepseek_v3): YaRN
    )
    rope_factor: PositiveFloat = 8.0  # llama3: slow-down of long wavelengths
    rope_low_freq_factor: PositiveFloat = 1.0  # llama3: low_freq_factor
    rope_high_freq_factor: PositiveFloat = 4.0  # llama3: high_freq_factor
    rope_original_max_len: Positive = 8192  # llama3: original_max_position_embeddings
    norm_eps: PositiveFloat = 1e-5  # RMSNorm epsilon
    family: Literal[
        "llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen3_moe", "gemma3", "deepseek_v3", "gpt_oss", "qwen3_next"
    ] = "llama"  # architecture and Hugging Face family (models/registry.py); the decoder's switches set its math
    qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2/2.5)
    qk_norm: bool = False  # per-head RMSNorm of queries and keys before rotary (Qwen3)
    sliding_window: NonNegative = 0  # each token attends to its last W positions, itself included (Mistral); 0 = all
    sliding_window_pattern: NonNegative = (
        0  # gemma3: every n-th layer attends to all positions, the others to sliding_window; 0 = every layer windowed
    )
    rope_local_theta: NonNegativeFloat = (
        0.0  # gemma3: rotary base of the windowed layers (rope_local_base_freq); 0 = rope_theta
    )
    query_pre_attn_scalar: NonNegativeFloat = 0.0  # gemma3: attention scores x query_pre_attn_scalar^-1/2; 0 = head_dim
    mla_q_rank: NonNegative = 0  # deepseek_v3: query low rank (q_lora_rank), normed; 0 = one full q projection
    mla_kv_rank: NonNegative = 0  # deepseek_v3: compressed key/value latent width (kv_lora_rank), the cached part
    mla_nope_dim: NonNegative = 0  # deepseek_v3: per-head query/key width without rotary (qk_nope_head_dim)
    mla_rope_dim: NonNegative = (
        0  # deepseek_v3: rotary query width per head and the one shared rotary key (qk_rope_head_dim)
    )
    mla_v_dim: NonNegative = 0  # deepseek_v3: per-head value width (v_head_dim)
    rope_interleave: bool = False  # deepseek_v3: rotary pairs are adjacent dims (x0, x1), not the two halves
    dense_layers: NonNegative = 0  # deepseek_v3: the first n layers have a dense MLP (first_k_dense_replace)
    moe_groups: NonNegative = (
        0  # deepseek_v3: experts in n groups; a token picks from moe_topk_groups of them (n_group)
    )
    moe_topk_groups: NonNegative = 0  # deepseek_v3: groups kept per token, ranked by their 2 best scores (topk_group)
    moe_routed_scale: PositiveFloat = 1.0  # deepseek_v3: routed experts' gates x this (routed_scaling_factor)
    rope_beta_fast: PositiveFloat = 32.0  # gpt_oss: YaRN's beta_fast (rotations where interpolation stops)
    rope_beta_slow: PositiveFloat = 1.0  # gpt_oss: YaRN's beta_slow (rotations where it starts)
    rope_truncate: bool = True  # gpt_oss: YaRN's correction range rounded outward to whole dims (truncate)
    swiglu_alpha: PositiveFloat = 1.702  # gpt_oss: experts' gate x sigmoid(alpha x gate) (swiglu_alpha)
    swiglu_limit: PositiveFloat = 7.0  # gpt_oss: gate clamped above, up clamped both sides to this (swiglu_limit)
    rope_mscale: NonNegativeFloat = (
        0.0  # deepseek_v3, rope_scaling=yarn: mscale (with rope_mscale_all_dim: the cos/sin factor)
    )
    rope_mscale_all_dim: NonNegativeFloat = (
        0.0  # deepseek_v3, rope_scaling=yarn: mscale_all_dim (scores x its mscale^2)
    )
    moe_bias_rate: NonNegativeFloat = 0.0  # deepseek_v3: aux-loss-free balancing, the selection bias moves this much per step against each expert's load (0 = frozen)
    linear_key_heads: NonNegative = 0  # qwen3_next: gated DeltaNet query/key heads (linear_num_key_heads)
    linear_value_heads: NonNegative = 0  # qwen3_next: gated DeltaNet value heads, a multiple of the key heads
    linear_key_dim: NonNegative = 0  # qwen3_next: gated DeltaNet query/key width per head (linear_key_head_dim)
    linear_value_dim: NonNegative = 0  # qwen3_next: gated DeltaNet value width per head (linear_value_head_dim)
    linear_conv_kernel: NonNegative = (
        0  # qwen3_next: width of the causal depthwise convolution (linear_conv_kernel_dim)
    )
    full_attention_interval: NonNegative = (
        0  # qwen3_next: every n-th layer is gated full attention, the others gated DeltaNet
    )
    rope_fraction: PositiveFloat = (
        1.0  # qwen3_next: rotary on this fraction of each head's dims (partial_rotary_factor)
    )
    moe_shared_dim: NonNegative = (
        0  # qwen3_next: inner width of the sigmoid-gated shared expert (shared_expert_intermediate_size)
    )
    init_std: PositiveFloat = 0.02  # normal init of weights
    compute_dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bfloat16 on GPU/TPU, float32 on CPU
    fp8: Literal["off", "tensorwise", "rowwise", "mxfp8"] = (
        "off"  # the layers' weight matmuls in FP8 (e4m3 forward, e5m2 gradients), scale per tensor or per row (parallel/fp8.py); mxfp8: Blackwell GPUs only
    )
    remat: Literal["none", "full", "dots_saveable", "offload_dots"] = (
        "none"  # activation recomputation per block (offload_dots: dots_saveable's residuals saved to host memory)
    )
    moe_experts: NonNegative = 0  # mixture of experts (models/moe.py): experts per sparse layer; 0 = dense
    moe_topk: Positive = 2  # experts each token is routed to
    moe_every: Positive = 1  # every n-th layer's MLP is sparse (n divides num_layers)
    moe_shared_experts: NonNegative = 0  # always-on experts (DeepSeek), each of inner dim moe_mlp_dim
    moe_mlp_dim: NonNegative = 0  # expert SwiGLU inner dim; 0 = mlp_dim
    moe_router: Literal["softmax", "sigmoid"] = "softmax"  # gate scores before top-k
    moe_norm_topk: bool = True  # kept top-k scores renormalised to sum to 1 (false: Qwen3-MoE norm_topk_prob=false)
    moe_dispatch: Literal["dropless", "capacity"] = "dropless"  # capacity: overflow tokens dropped (counted)
    moe_capacity_factor: PositiveFloat = 1.25  # capacity dispatch: slots per expert / (tokens x topk / experts)
    moe_aux_weight: NonNegativeFloat = 0.01  # Switch/GShard load-balancing loss weight
    moe_z_weight: NonNegativeFloat = 0.001  # router z-loss weight
    embed_init_std: NonNegativeFloat = 0.0  # normal init of the embedding table; 0 = init_std (torchtitan: 1.0)
    embed_scale: PositiveFloat = 1.0  # embedding output x this (Vaswani et al. 2017, Gemma: sqrt(d_model))
    context_impl: Literal["allgather", "ring", "ulysses"] = (
        "allgather"  # cp > 1: attention across sequence shards (parallel/context.py)
    )
    loss_impl: Literal["blockwise", "naive"] = (
        "blockwise"  # blockwise never materialises B·T·V logits; naive: full logits, one-hot
    )
    loss_block: NonNegative = 0  # blockwise: vocab rows per block on each device (divides V / tp); 0 = from the shapes
    loss_gather_mib: NonNegative = (
        256  # blockwise: the head is all-gathered this many MiB per device at a time (whole blocks; 0 = one block)
    )
    loss_keep_mib: NonNegative = 512  # blockwise: keep the forward's logits (in the compute dtype) for the backward (no second matmul over the vocab) when they take at most this many MiB per device; 0 = recompute

    @property
    def stack_depth(self) -> int:
        """Length of the stacked layer axis: num_layers, or num_layers / moe_every dense+sparse groups."""
        return self.num_layers // self.moe_every if self.moe_experts and self.moe_every > 1 else self.num_layers


# The ModelConfig fields that decide the parameters' shapes (a checkpoint of another value is another model).
SHAPE_FIELDS = (
    "num_layers",
    "d_model",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "mlp_dim",
    "vocab_size",
    "tie_embeddings",
)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    shape: str = "fsdp=-1"  # mesh axis sizes, e.g. "dp=2,fsdp=4"; one -1 fills (--mesh)
    dcn: str = ""  # axes spanning hosts, e.g. "dp=2"; default: dp spans hosts when multi-process (--dcn-mesh)
    rules: dict[str, list[str]] = dataclasses.field(
        default_factory=dict
    )  # logical axis -> mesh axes ([] = replicated); merged into the defaults


@dataclasses.dataclass(frozen=True)
class SourceConfig:
    """One source of a mixture (`data.sources`): a name, what `data.path` accepts, a sampling weight."""

    name: str = ""  # logged as eval_loss/NAME; unique within data.sources
    path: str = ""  # what data.path accepts: a prepared folder, token files, a text glob or folder
    weight: float = 1.0  # relative share of the batch rows (> 0); normalised over the sources
    stream: bool = (
        False  # path holds raw documents (JSONL, Parquet, Arrow, text) tokenized while training (data/stream.py)
    )
    field: str = "text"  # stream: the JSONL / Parquet / Arrow field holding each document's text
    workers: Positive = 1  # stream: tokenizing processes (1: in the loader's reader thread)


@dataclasses.dataclass(frozen=True)
class StageConfig:
    """From optimizer step `step` on, the mixture's weights are `weights` (`data.stages`)."""

    step: int = 0  # the first step these weights apply to (> 0; stages in increasing order)
    weights: dict[str, float] = dataclasses.field(default_factory=dict)  # source name -> weight (>= 0); unnamed: 0


@dataclasses.dataclass(frozen=True)
class DataConfig:
    source: Literal["text", "tokens"] = (
        "text"  # text: UTF-8 files as bytes (or data.tokenizer); tokens: flat token-id files
    )
    path: str = ""  # glob or folder (a prepare output: train/ + val/); empty with source=text: the stdlib
    token_dtype: Literal["auto", "uint16", "uint32"] = (
        "auto"  # token-id files (source=tokens); auto: a prepared folder's manifest, else uint16
    )
    eval_fraction: Annotated[float, Range(0, 1, hi_open=True)] = 0.02  # tail of the stream held out for eval
    separator: Annotated[int, Range(0, 255)] = 0  # byte placed between documents (text source)
    prefetch: Positive = 2  # batches prepared ahead by background threads
    tokenizer: str = ""  # tokenizer.json or HF model folder (text source); empty: byte tokens
    document_mask: bool = False  # attention stays inside each EOS-ended document; positions restart
    sources: list[SourceConfig] = dataclasses.field(
        default_factory=list
    )  # a mixture: [{name, path, weight}, ...] instead of data.path; rows drawn by weight; stream: true reads raw documents (docs/data.md)
    stages: list[StageConfig] = dataclasses.field(
        default_factory=list
    )  # [{step: S, weights: {name: w}}, ...]: from step S on, these weights (an annealing phase)
    on_exhausted: Literal["repeat", "stop"] = (
        "repeat"  # a mixture source read to its end: repeat it reshuffled, or stop (refused at start-up)
    )


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


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    schedule: Literal["gpipe", "circular", "1f1b", "1f1b_paired", "interleaved_1f1b", "zb_h1"] = (
        "gpipe"  # pipeline schedule (with pp > 1)
    )
    microbatches: NonNegative = 0  # pipeline micro-batches per step; 0 = pp (the minimum)
    repeats: Positive = 1  # circular, interleaved_1f1b: virtual stages (layer chunks) per device


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


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    rank: NonNegative = (
        0  # LoRA adapter rank; 0 = off (every parameter trained). On: only adapters train (jaxdist/adapters)
    )
    alpha: PositiveFloat = 16.0  # the adapted weight is W + (alpha / rank) A B
    rslora: bool = False  # rsLoRA: scale by alpha / sqrt(rank) instead of alpha / rank (peft's use_rslora)
    dropout: Annotated[float, Range(0, 1, hi_open=True)] = (
        0.0  # dropout on the adapters' input (only 0 is supported yet)
    )
    targets: list[str] = dataclasses.field(
        default_factory=lambda: list(LORA_TARGETS)
    )  # projections that get adapters, among q, k, v, o, gate, up, down
    base_dtype: Literal["float32", "bfloat16", "int8", "nf4"] = (
        "float32"  # how the frozen base is stored: int8 / nf4 (QLoRA) layer matrices with per-block scales
    )
    block_size: Positive = 64  # int8 / nf4: entries per scale, along each matrix's last input dimension


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
    method: Literal["lm", "dpo", "simpo", "orpo", "grpo"] = (
        "lm"  # lm: next-token cross-entropy; dpo, simpo, orpo: preference pairs from prepare --preference; grpo: rollouts on prompts from prepare --prompts (docs/post-training.md)
    )
    beta: PositiveFloat = 0.1  # dpo: strength of the implicit KL to the reference; simpo: reward scale (TRL's beta; the SimPO paper uses 2-2.5); grpo: weight of the k3 KL to the reference
    dpo_loss: Literal["sigmoid", "ipo", "robust"] = (
        "sigmoid"  # dpo: TRL's loss_type: sigmoid (DPO), ipo (length-normalised squared loss), robust (label_smoothing = flip probability)
    )
    label_smoothing: Annotated[float, Range(0, 0.5, hi_open=True)] = (
        0.0  # dpo_loss=robust: probability a label is flipped; simpo: conservative (cDPO-style) smoothing
    )
    gamma: NonNegativeFloat = 0.5  # simpo: target reward margin (TRL's simpo_gamma)
    orpo_lambda: PositiveFloat = (
        0.1  # orpo: weight of the odds-ratio term beside the chosen NLL (TRL ORPOConfig's beta)
    )
    reward: list[str] = dataclasses.field(
        default_factory=list
    )  # grpo: reward functions, each a built-in (answer_match, digits) or FILE.py:NAME called as TRL calls one
    reward_weights: list[float] = dataclasses.field(
        default_factory=list
    )  # grpo: one weight per objective.reward entry, summed as TRL's reward_weights; empty: 1.0 each
    group_size: Positive = 4  # grpo: completions sampled per prompt, at least 2 (TRL's num_generations)
    max_new_tokens: Positive = 16  # grpo: completion tokens sampled (TRL's max_completion_length)
    temperature: PositiveFloat = 1.0  # grpo: sampling temperature; log-probs are of the logits / temperature
    top_p: Annotated[float, Range(0, 1, lo_open=True)] = 1.0  # grpo: nucleus sampling, in (0, 1]
    epsilon: PositiveFloat = 0.2  # grpo: the ratio is clipped below at 1 - epsilon (TRL's epsilon)
    epsilon_high: NonNegativeFloat = 0.0  # grpo: clipped above at 1 + epsilon_high; 0: epsilon (TRL's epsilon_high)
    iterations: Positive = 1  # grpo: optimizer steps on each batch of rollouts (TRL's num_iterations)
    grpo_loss: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = (
        "dapo"  # grpo: token aggregation, TRL's loss_type: grpo (row means), bnpo, dr_grpo (/ rows x max_new_tokens), dapo
    )
    scale_rewards: Literal["group", "batch", "none"] = (
        "group"  # grpo: advantages divided by the group's (or batch's) reward std, or not (TRL's scale_rewards)
    )


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    pipeline: PipelineConfig = dataclasses.field(default_factory=PipelineConfig)
    reduce: ReduceConfig = dataclasses.field(default_factory=ReduceConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    offload: OffloadConfig = dataclasses.field(default_factory=OffloadConfig)
    objective: ObjectiveConfig = dataclasses.field(default_factory=ObjectiveConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **sections: Any) -> Config:
        """`cfg.replace(train=dict(steps=5))` -> a new, validated config."""
        raw = self.to_dict()
        for section, values in sections.items():
            _merge(raw[section], values)
        return from_dict(raw)


def _merge(into: dict, values: dict) -> None:
    """`values` written over `into`, nested sections key by key (`reduce=dict(topk=dict(dgc="off"))`
    keeps reduce.topk's other keys)."""
    for k, v in values.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict) and k in into:
            _merge(into[k], v)
        else:
            into[k] = v


YAML_BOOL_WORDS = {False: "off", True: "on"}


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check `value` against the field type; ints are accepted for floats."""
    tp, _ = _base(tp)
    origin = typing.get_origin(tp)
    if isinstance(value, YamlWord):  # off / on / yes / no: the bool for a bool field, else the word
        value = value.truth if tp is bool else str(value)
    if origin is Literal:
        return _choice(key, value, typing.get_args(tp))
    if origin is dict:
        return _weights(key, value) if typing.get_args(tp)[1] is float else _axis_rules(key, value)
    if origin is list:
        (item,) = typing.get_args(tp)
        if item is float:
            return _numbers(key, value)
        return (
            _records(key, value, item)
            if isinstance(item, type) and dataclasses.is_dataclass(item)
            else _names(key, value)
        )
    return _scalar(key, value, tp)


def _choice(key: str, value: Any, allowed: tuple) -> Any:
    if isinstance(value, bool) and YAML_BOOL_WORDS[value] in allowed:
        value = YAML_BOOL_WORDS[value]  # YAML 1.1 reads a bare off / on as a bool
    if value not in allowed:
        close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise JaxdistError(f"{key}={value!r} is not one of {', '.join(map(str, allowed))}{hint}")
    return value


def _axis_rules(key: str, value: Any) -> dict:
    """{name: [mesh axes]}; a bare name is a one-axis list, None an empty one."""
    if not isinstance(value, dict):
        raise JaxdistError(f"{key} must be a mapping, got {value!r}; write it as {{name: [axes]}} in YAML")
    out = {}
    for k, v in value.items():
        v = [] if v is None else [v] if isinstance(v, str) else v
        if not isinstance(v, (list, tuple)) or not all(isinstance(a, str) for a in v):
            raise JaxdistError(f"{key}.{k} must be a list of mesh axis names, got {v!r}")
        out[str(k)] = list(v)
    return out


def _records(key: str, value: Any, cls: type) -> list:
    """A list of mappings, each one `cls` with its fields type-checked (data.sources, data.stages)."""
    value = [] if value is None else value
    if not isinstance(value, (list, tuple)):
        raise JaxdistError(f"{key} must be a list of mappings, got {value!r}; write it as [{{...}}, {{...}}]")
    out, hints = [], _field_types(cls)
    for i, item in enumerate(value):
        if dataclasses.is_dataclass(item) and not isinstance(item, type):
            item = dataclasses.asdict(item)
        if not isinstance(item, dict):
            raise JaxdistError(f"{key}[{i}] must be a mapping of {', '.join(hints)}, got {item!r}")
        for k in item:
            if k not in hints:
                raise _unknown(f"{key}[{i}].{k}", [f"{key}[{i}].{h}" for h in hints])
        out.append(cls(**{k: _coerce(f"{key}[{i}].{k}", v, hints[k]) for k, v in item.items()}))
    return out


def _weights(key: str, value: Any) -> dict:
    """{source name: weight}: a mapping of names to numbers."""
    if not isinstance(value, dict):
        raise JaxdistError(f"{key} must be a mapping of source names to weights, got {value!r}")
    return {str(k): _scalar(f"{key}.{k}", v, float) for k, v in value.items()}


def _names(key: str, value: Any) -> list:
    value = [value] if isinstance(value, str) else [] if value is None else value
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise JaxdistError(f"{key} must be a list of names, got {value!r}; write it as [a, b]")
    return list(value)


def _numbers(key: str, value: Any) -> list:
    value = [] if value is None else value if isinstance(value, (list, tuple)) else [value]
    return [_scalar(f"{key}[{i}]", v, float) for i, v in enumerate(value)]


def _scalar(key: str, value: Any, tp: type) -> Any:
    """int, float, str or bool: ints are accepted for floats, numeric strings (YAML's "1e-3") for numbers."""
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float) and isinstance(value, str):
        try:  # YAML reads "1e-3" as a string
            return tp(value)
        except ValueError:
            pass
    if tp is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # e.g. a path like 123 is fine
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise JaxdistError(
            f"{key} must be {_type_name(tp)}, got {value!r} ({type(value).__name__}); "
            f"fix the value in your config or override"
        )
    return value


def _section_types() -> dict[str, type]:
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config)}


def _unknown(key: str, known: list[str]) -> JaxdistError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"did you mean '{close[0]}'?" if close else f"known keys: {', '.join(sorted(known))}"
    return JaxdistError(f"unknown config key '{key}': {hint}")


def _not_a_section(name: str, values: Any, where: str = "") -> JaxdistError:
    return JaxdistError(
        f"config section '{name}'{where} must be a mapping of keys to values (e.g. "
        f"{name}: {{key: value}}), got {values!r}"
    )


# Keys renamed since an earlier release: old -> new. Using the old one is a one-line error naming the new.
RENAMED = {"train.microbatches": "train.grad_accum_steps", "optim.offload": "offload.optimizer"}
# reduce.* options that belong to one method, moved into that method's section (issue 43). Run names hash
# them under the old flat names (training/rundir.identity), so a run's default folder did not move.
REGROUPED = {
    "reduce.dgc": "reduce.topk.dgc",
    "reduce.warmup_density": "reduce.topk.warmup_density",
    "reduce.rank": "reduce.powersgd.rank",
    "reduce.block_size": "reduce.int8.block_size",
    "reduce.sync_every": "reduce.diloco.sync_every",
    "reduce.outer_lr": "reduce.diloco.outer_lr",
    "reduce.outer_momentum": "reduce.diloco.outer_momentum",
    "reduce.outer_codec": "reduce.diloco.outer_codec",
    "reduce.momentum_decay": "reduce.demo.momentum_decay",
    "reduce.chunk": "reduce.demo.chunk",
}
RENAMED.update(REGROUPED)


def from_dict(raw: dict[str, Any]) -> Config:
    """Build a validated Config from nested dicts (missing keys take defaults)."""
    sections = {}
    section_types = _section_types()
    for name, values in raw.items():
        if name not in section_types:
            raise _unknown(str(name), list(section_types))
        sections[name] = _section(str(name), section_types[name], values)
    cfg = Config(**sections)
    validate(cfg)
    return cfg


def _section(name: str, cls: type, values: Any):
    """One section (or a section inside one, like reduce.topk) from its dict, every key checked."""
    if values is None:
        values = {}
    if isinstance(values, cls):
        values = dataclasses.asdict(values)
    if not isinstance(values, dict):
        raise _not_a_section(name, values)
    hints = _field_types(cls)
    kwargs = {}
    for key, value in values.items():
        if f"{name}.{key}" in RENAMED:
            new = RENAMED[f"{name}.{key}"]
            raise JaxdistError(f"config key {name}.{key} was renamed {new}; use {new}={value!r}")
        if key not in hints:
            raise _unknown(f"{name}.{key}", [f"{name}.{k}" for k in hints])
        if _is_section(hints[key]):
            kwargs[key] = _section(f"{name}.{key}", hints[key], value)
        else:
            kwargs[key] = _coerce(f"{name}.{key}", value, hints[key])
    return cls(**kwargs)


def inner_sections() -> frozenset[str]:
    """The sections inside sections ("reduce.topk", ...): their keys are three-part names."""
    return frozenset(
        f"{name}.{key}"
        for name, cls in _section_types().items()
        for key, tp in _field_types(cls).items()
        if _is_section(tp)
    )


def flatten(tree: dict) -> dict[str, Any]:
    """{"optim.lr": 0.003, "reduce.topk.dgc": "update", ...}: a config dict by its keys' full names. A
    saved config of an older jaxdist has reduce.* options flat (reduce.dgc); they read as their new names."""
    inner, out = inner_sections(), {}
    for s, d in tree.items():
        for k, v in d.items() if isinstance(d, dict) else ():
            if f"{s}.{k}" in inner and isinstance(v, dict):
                out.update({f"{s}.{k}.{kk}": vv for kk, vv in v.items()})
            else:
                out[REGROUPED.get(f"{s}.{k}", f"{s}.{k}")] = v
    return out


def _is_section(tp: Any) -> bool:
    """A field that is itself a section of keys (a dataclass type, not a list of records)."""
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)
