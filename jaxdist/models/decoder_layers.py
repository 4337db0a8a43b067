"""The Llama-style decoder's layers in Flax NNX: RMSNorm, grouped-query attention with RoPE (and the Qwen,
Mistral switches: q/k/v biases, q/k norms, a sliding window), the SwiGLU MLP, the block and the MoE group the
layer scan stacks (`scanned_unit`), the remat policies. The model around them: models/llama.py; the other
architectures reuse these parts.

Only logical axis names appear here. Shapes are suffixed on names: B batch, T sequence, D d_model,
N query heads, K kv heads, H head_dim, F mlp, L layers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdist.adapters import lora as lora_mod
from jaxdist.config import ModelConfig
from jaxdist.distributed import offload
from jaxdist.distributed.sharding import constrain
from jaxdist.models import moe
from jaxdist.models.attention import causal_attention, rope_scaling, rotary, window_mask
from jaxdist.parallel import context
from jaxdist.parallel.matmul import gathered

REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "offload_dots": offload.activation_policy(),  # the same residuals, saved in host memory
}


def param(rngs: nnx.Rngs, init, shape: tuple[int, ...], names: tuple[str | None, ...]) -> nnx.Param:
    """A float32 parameter carrying logical axis names (placement is decided by the logical rules)."""
    return nnx.Param(init(rngs.params(), shape, jnp.float32), out_sharding=names, eager_sharding=False)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, rngs: nnx.Rngs, names: tuple[str | None, ...] = ("norm",)):
        self.scale = param(rngs, nnx.initializers.ones, (dim,), names)
        self.eps = eps
        self.names = names

    def __call__(self, x_BTD):
        x = x_BTD.astype(jnp.float32)  # normalise in float32 whatever the compute dtype
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        # Gathered explicitly: the backward's two uses (input and scale gradients) share that one copy.
        return (x * gathered(self.scale[...], self.names)).astype(x_BTD.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        init = nnx.initializers.normal(cfg.init_std)
        out_init = nnx.initializers.normal(cfg.init_std / (2 * cfg.num_layers) ** 0.5)
        D, N, K, H = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.wq_DNH = param(rngs, init, (D, N, H), ("embed", "heads", "head_dim"))
        self.wk_DKH = param(rngs, init, (D, K, H), ("embed", "kv_heads", "head_dim"))
        self.wv_DKH = param(rngs, init, (D, K, H), ("embed", "kv_heads", "head_dim"))
        self.wo_NHD = param(rngs, out_init, (N, H, D), ("heads", "head_dim", "embed"))
        # Family switches (config/model_section.py); their defaults create nothing, so Llama is unchanged.
        self.qkv_bias, self.qk_norm, self.window = cfg.qkv_bias, cfg.qk_norm, cfg.sliding_window
        if cfg.qkv_bias:  # Qwen2
            zeros = nnx.initializers.zeros
            self.bq_NH = param(rngs, zeros, (N, H), ("heads", "head_dim"))
            self.bk_KH = param(rngs, zeros, (K, H), ("kv_heads", "head_dim"))
            self.bv_KH = param(rngs, zeros, (K, H), ("kv_heads", "head_dim"))
        if cfg.qk_norm:  # Qwen3: RMSNorm over each head's H features, before rotary
            self.q_norm = RMSNorm(H, cfg.norm_eps, rngs, ("head_dim",))
            self.k_norm = RMSNorm(H, cfg.norm_eps, rngs, ("head_dim",))
        self.theta = cfg.rope_theta
        self.scaling = rope_scaling(cfg)
        self.context_impl = cfg.context_impl

    def qkv(self, x_BTD, positions_T):
        q_BTNH = lora_mod.project(self, "wq_DNH", x_BTD, ("embed", "heads", "head_dim"))
        k_BTKH = lora_mod.project(self, "wk_DKH", x_BTD, ("embed", "kv_heads", "head_dim"))
        v_BTKH = lora_mod.project(self, "wv_DKH", x_BTD, ("embed", "kv_heads", "head_dim"))
        if self.qkv_bias:
            q_BTNH = q_BTNH + self.bq_NH[...].astype(q_BTNH.dtype)
            k_BTKH = k_BTKH + self.bk_KH[...].astype(k_BTKH.dtype)
            v_BTKH = v_BTKH + self.bv_KH[...].astype(v_BTKH.dtype)
        if self.qk_norm:
            q_BTNH, k_BTKH = self.q_norm(q_BTNH), self.k_norm(k_BTKH)
        q_BTNH = rotary(q_BTNH, positions_T, self.theta, self.scaling)
        k_BTKH = rotary(k_BTKH, positions_T, self.theta, self.scaling)
        q_BTNH = constrain(q_BTNH, ("batch", "seq", "heads", None))
        k_BTKH = constrain(k_BTKH, ("batch", "seq", "kv_heads", None))
        return q_BTNH, k_BTKH, v_BTKH

    def out(self, o_BTNH):
        B, T, N, H = o_BTNH.shape
        names = ("heads", "head_dim", "embed")
        return lora_mod.project(self, "wo_NHD", o_BTNH.reshape(B, T, N * H), names, in_dims=2)

    def __call__(self, x_BTD, positions_T, segment_ids_BT=None):
        q_BTNH, k_BTKH, v_BTKH = self.qkv(x_BTD, positions_T)
        if context.active():  # cp > 1: the sequence is split over devices
            return self.out(context.attention(q_BTNH, k_BTKH, v_BTKH, self.context_impl))
        return self.out(causal_attention(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, self.window))

    def cached(self, x_BTD, positions_BT, k_BSKH, v_BSKH, index, mask_BTS):
        """Decoding: write this chunk's keys/values at cache slot `index`, attend to the cache under
        `mask_BTS` (causal and not padding). Returns (output, new k cache, new v cache)."""
        q_BTNH, k_BTKH, v_BTKH = self.qkv(x_BTD, positions_BT)
        k_BSKH = jax.lax.dynamic_update_slice_in_dim(k_BSKH, k_BTKH.astype(k_BSKH.dtype), index, axis=1)
        v_BSKH = jax.lax.dynamic_update_slice_in_dim(v_BSKH, v_BTKH.astype(v_BSKH.dtype), index, axis=1)
        if self.window:
            T, S = x_BTD.shape[1], k_BSKH.shape[1]
            mask_BTS = mask_BTS & window_mask(index + jnp.arange(T), jnp.arange(S), self.window)[None]
        o_BTNH = jax.nn.dot_product_attention(
            q_BTNH, k_BSKH.astype(q_BTNH.dtype), v_BSKH.astype(q_BTNH.dtype), mask=mask_BTS[:, None]
        )
        return self.out(o_BTNH), k_BSKH, v_BSKH


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        init = nnx.initializers.normal(cfg.init_std)
        out_init = nnx.initializers.normal(cfg.init_std / (2 * cfg.num_layers) ** 0.5)
        self.w_gate_DF = param(rngs, init, (cfg.d_model, cfg.mlp_dim), ("embed", "mlp"))
        self.w_up_DF = param(rngs, init, (cfg.d_model, cfg.mlp_dim), ("embed", "mlp"))
        self.w_down_FD = param(rngs, out_init, (cfg.mlp_dim, cfg.d_model), ("mlp", "embed"))

    def __call__(self, x_BTD):
        gate_BTF = lora_mod.project(self, "w_gate_DF", x_BTD, ("embed", "mlp"))
        up_BTF = lora_mod.project(self, "w_up_DF", x_BTD, ("embed", "mlp"))
        h_BTF = constrain(jax.nn.silu(gate_BTF) * up_BTF, ("batch", "seq", "mlp"))
        return lora_mod.project(self, "w_down_FD", h_BTF, ("mlp", "embed"))


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, sparse: bool = False):
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, rngs)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, rngs)
        self.mlp = moe.MoE(cfg, rngs) if sparse else MLP(cfg, rngs)
        self.sparse = sparse

    def __call__(self, x_BTD, positions_T, segment_ids_BT=None):
        """-> x_BTD; a sparse (MoE) block returns (x_BTD, aux losses)."""
        x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD), positions_T, segment_ids_BT)
        y_BTD, aux = self.mlp(self.mlp_norm(x_BTD)) if self.sparse else (self.mlp(self.mlp_norm(x_BTD)), None)
        x_BTD = constrain(x_BTD + y_BTD, ("batch", "seq", None))
        return x_BTD if aux is None else (x_BTD, aux)

    def cached(self, x_BTD, positions_BT, k_BSKH, v_BSKH, index, mask_BTS):
        a_BTD, k_BSKH, v_BSKH = self.attn.cached(self.attn_norm(x_BTD), positions_BT, k_BSKH, v_BSKH, index, mask_BTS)
        x_BTD = x_BTD + a_BTD
        y_BTD = self.mlp(self.mlp_norm(x_BTD))
        x_BTD = x_BTD + (y_BTD[0] if self.sparse else y_BTD)
        return constrain(x_BTD, ("batch", "seq", None)), k_BSKH, v_BSKH


class SparseGroup(nnx.Module):
    """model.moe_every = n > 1: the scanned unit is n layers, the last of them sparse."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        n = cfg.moe_every
        self.layers = nnx.List([Block(cfg, rngs, sparse=i == n - 1) for i in range(n)])

    def __call__(self, x_BTD, positions_T, segment_ids_BT=None):
        for block in self.layers[:-1]:
            x_BTD = block(x_BTD, positions_T, segment_ids_BT)
        return self.layers[-1](x_BTD, positions_T, segment_ids_BT)

    def cached(self, x_BTD, positions_BT, k_nBSKH, v_nBSKH, index, mask_BTS):
        """Decoding: the group's n layers in turn, each with its slice of the (n, ...) caches."""
        ks, vs = [], []
        for i, block in enumerate(self.layers):
            x_BTD, k, v = block.cached(x_BTD, positions_BT, k_nBSKH[i], v_nBSKH[i], index, mask_BTS)
            ks.append(k)
            vs.append(v)
        return x_BTD, jnp.stack(ks), jnp.stack(vs)


def scanned_unit(cfg: ModelConfig):
    """(module class, how many are stacked): Block per layer, or a SparseGroup per moe_every layers."""
    if not cfg.moe_experts:
        return Block, cfg.stack_depth
    if cfg.moe_every == 1:
        return (lambda c, g: Block(c, g, sparse=True)), cfg.stack_depth
    return SparseGroup, cfg.stack_depth
