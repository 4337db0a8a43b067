"""`model.*`: the architecture's shape, its family switches and how it computes (`ModelConfig`), and the
fields that decide the parameters' shapes (`SHAPE_FIELDS`). Each field's `# comment` is its documentation."""

from __future__ import annotations

import dataclasses
from typing import Literal

from jaxdist.config.types import NonNegative, NonNegativeFloat, Positive, PositiveFloat


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
        "off"  # the layers' weight matmuls, the routed experts' and LoRA's frozen base's in FP8 (e4m3 forward, e5m2 gradients), scale per tensor or per row (parallel/fp8.py, fp8_experts.py); mxfp8: Blackwell GPUs only, dense
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
        """Length of the stacked layer axis: num_layers, or num_layers / moe_every dense+sparse groups, or
        num_layers / full_attention_interval (qwen3_next's groups of DeltaNet layers and one full layer)."""
        if self.full_attention_interval:
            return self.num_layers // self.full_attention_interval
        return self.num_layers // self.moe_every if self.moe_experts and self.moe_every > 1 else self.num_layers

    @property
    def pipeline_depth(self) -> int:
        """Length of the stack a pipeline splits into stages: stack_depth, less deepseek_v3's dense first
        layers (`dense_layers`: a second stack, run before the pipeline)."""
        if self.moe_experts and self.dense_layers:
            return self.stack_depth - min(self.dense_layers, self.num_layers)
        return self.stack_depth

    @property
    def decoder_dims(self) -> tuple[int, int, int, int, int, int, int]:
        """(D, N, K, H, F, V, L): d_model, heads, kv heads, head_dim, mlp_dim, vocab_size, num_layers, the
        letters the parameter and FLOP counts are written in."""
        return (
            self.d_model,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.mlp_dim,
            self.vocab_size,
            self.num_layers,
        )


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
