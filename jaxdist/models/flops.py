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


def full_remat_flops_per_token(cfg: ModelConfig) -> float:
    """Matmul FLOPs per token of a dense decoder's train step under `model.remat=full`, as XLA compiles
    it (the parameters' matmuls only: the norm scales multiply, they do not contract): the forward (2 per
    weight), the backward (4), the backward's recompute of each layer's forward (2 per layer weight)
    except its last projection, w_down (its output only feeds the next layer, whose input is saved, so
    XLA drops it from the recompute), and the attention's scores and values in the forward, the
    recompute and the backward's two (4 x 4·T·heads·head_dim per layer, the causal mask not halved).
    Equal to the compiled count (tests/test_step_work.py::test_no_matmul_flops_beyond_full_remat)."""
    if cfg.moe_experts or registry.of(cfg).name != "decoder":
        raise ValueError("full_remat_flops_per_token counts a dense decoder's matmuls only")
    D, N, K, H, F, V, L = cfg.decoder_dims
    layer = 2 * D * N * H + 2 * D * K * H + 3 * D * F
    attention = 4 * cfg.seq_len * N * H * L
    return 6.0 * (L * layer + D * V) + 2.0 * L * (layer - D * F) + 4.0 * attention
