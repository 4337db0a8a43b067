"""Model FLOPs per token, what MFU and the planner divide by.

PaLM appendix B convention: 6·N for the matmul parameters (the input embedding is a lookup and does not
count; the output head does) plus the attention scores and values, forward + backward, without halving
for the causal mask: 12·L·T·(heads·head_dim) for full attention; each architecture's registry entry
gives its own term (`attention_flops`: a layer with a window W < T counts W keys per query).
"""

from __future__ import annotations

from jaxdist.adapters.lora import count_adapter_params
from jaxdist.config import ModelConfig
from jaxdist.models import registry


def flops_per_token(cfg: ModelConfig, lora=None) -> float:
    """MoE models count the active parameters only (router + the K routed experts + shared ones). With
    LoRA (`lora.rank` > 0) the frozen base costs 4 FLOPs per parameter (forward and input gradients; no
    weight gradients are computed) and the adapters 6."""
    arch = registry.of(cfg)
    counts = arch.count_params(cfg)
    matmul_params = counts["active"] - counts["embed"] + (counts["embed"] if cfg.tie_embeddings else 0)
    attention = arch.attention_flops(cfg)
    if lora is not None and lora.rank:
        return 4.0 * matmul_params + 6.0 * count_adapter_params(cfg, lora) + attention
    return 6.0 * matmul_params + attention
