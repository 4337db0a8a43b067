"""Qwen3-Next in Flax NNX: the decoder skeleton of `models/llama.py` (embedding, scanned stack, final
norm, untied head) with Qwen3-Next's hybrid layers, as transformers' `Qwen3NextForCausalLM` computes them:

- the scanned unit is a group of `full_attention_interval` layers: gated DeltaNet (linear attention) in
  all but the last, gated full attention in the last (transformers' layer_types of the published models);
- gated DeltaNet: one projection to per-key-head q, k, v and the output gate z, one to the write
  strength b and the decay a; a causal depthwise convolution (`linear_conv_kernel` wide, SiLU) over
  q, k, v; L2-normed q and k (q x dk^-1/2); the gated delta rule as a `lax.scan` over time, state
  S (value heads, dk, dv): S <- exp(g_t) S, S <- S + k_t (beta_t (v_t - S^T k_t))^T, o_t = S^T q_t with
  beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias) (transformers' `torch_recurrent_gated_delta_rule`,
  exact; its chunked form is the same sum: models/delta_rule.py); then RMSNorm(o) * w * silu(z) and the output projection;
- gated full attention: the query projection yields a per-head sigmoid gate on the attention output,
  zero-centred (1 + w) q/k norms, rotary on the first `rope_fraction` of each head's dims;
- every norm except the DeltaNet output's is zero-centred (gemma3.Norm: scale 1 + w);
- MoE feed-forward: models/moe.py's softmax top-k experts plus one shared SwiGLU expert (`moe_shared_dim`)
  scaled by sigmoid(x . w_gate) per token.

Decoding carries, per group, the full layer's k/v cache and each DeltaNet layer's convolution tail
(the last kernel-1 inputs) and recurrent state; left padding (decode.generate) is zeroed before a
DeltaNet layer, as transformers' `apply_mask_to_padding_states`, so it leaves the state at zero.
Packed documents (segment ids) are refused: the recurrence would carry one document into the next.

Shapes: B batch, T sequence, D d_model, N/K query/kv heads, H head_dim, Kh/Vh DeltaNet key/value heads,
dk/dv their widths, R = Vh / Kh, C = 2 Kh dk + Vh dv convolved channels, W kernel, n layers per group.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdist.adapters import lora as lora_mod
from jaxdist.config import ModelConfig
from jaxdist.distributed.sharding import constrain
from jaxdist.errors import JaxdistError
from jaxdist.models import decoder_layers, llama, moe
from jaxdist.models.attention import causal_attention, rotary_by
from jaxdist.models.delta_rule import CHUNK, causal_conv, chunked_delta_rule, gated_delta_rule
from jaxdist.models.gemma3 import Norm

param = decoder_layers.param


def rotary_dims(m: ModelConfig) -> int:
    return int(m.head_dim * m.rope_fraction)


class Attention(nnx.Module):
    """Gated full attention: q and a per-head output gate from one projection, (1 + w) q/k norms,
    partial rotary, grouped-query attention, output x sigmoid(gate)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        init = nnx.initializers.normal(cfg.init_std)
        out_init = nnx.initializers.normal(cfg.init_std / (2 * cfg.num_layers) ** 0.5)
        D, N, K, H = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.wq_DNH = param(rngs, init, (D, N, 2 * H), ("embed", "heads", "head_dim"))  # per head: q, gate
        self.wk_DKH = param(rngs, init, (D, K, H), ("embed", "kv_heads", "head_dim"))
        self.wv_DKH = param(rngs, init, (D, K, H), ("embed", "kv_heads", "head_dim"))
        self.wo_NHD = param(rngs, out_init, (N, H, D), ("heads", "head_dim", "embed"))
        self.q_norm = Norm(H, cfg.norm_eps, rngs, ("head_dim",))
        self.k_norm = Norm(H, cfg.norm_eps, rngs, ("head_dim",))
        rd = rotary_dims(cfg)
        self.freq = tuple((1.0 / cfg.rope_theta ** (np.arange(0, rd, 2, dtype=np.float64) / rd)).tolist())

    def _rotary(self, x, positions):
        rd = 2 * len(self.freq)
        y = rotary_by(x[..., :rd], positions, np.asarray(self.freq, np.float32))
        return jnp.concatenate([y, x[..., rd:]], axis=-1)

    def qkv(self, x_BTD, positions):
        qg_BTNH = lora_mod.project(self, "wq_DNH", x_BTD, ("embed", "heads", "head_dim"))
        H = qg_BTNH.shape[-1] // 2
        q_BTNH, gate_BTNH = qg_BTNH[..., :H], qg_BTNH[..., H:]
        k_BTKH = lora_mod.project(self, "wk_DKH", x_BTD, ("embed", "kv_heads", "head_dim"))
        v_BTKH = lora_mod.project(self, "wv_DKH", x_BTD, ("embed", "kv_heads", "head_dim"))
        q_BTNH = self._rotary(self.q_norm(q_BTNH), positions)
        k_BTKH = self._rotary(self.k_norm(k_BTKH), positions)
        q_BTNH = constrain(q_BTNH, ("batch", "seq", "heads", None))
        k_BTKH = constrain(k_BTKH, ("batch", "seq", "kv_heads", None))
        return q_BTNH, k_BTKH, v_BTKH, gate_BTNH

    def out(self, o_BTNH, gate_BTNH):
        B, T, N, H = o_BTNH.shape
        o_BTNH = o_BTNH * jax.nn.sigmoid(gate_BTNH.astype(jnp.float32)).astype(o_BTNH.dtype)
        return lora_mod.project(self, "wo_NHD", o_BTNH.reshape(B, T, N * H), ("heads", "head_dim", "embed"), in_dims=2)

    def __call__(self, x_BTD, positions_T):
        q_BTNH, k_BTKH, v_BTKH, gate_BTNH = self.qkv(x_BTD, positions_T)
        return self.out(causal_attention(q_BTNH, k_BTKH, v_BTKH), gate_BTNH)

    def cached(self, x_BTD, positions_BT, k_BSKH, v_BSKH, index, mask_BTS):
        q_BTNH, k_BTKH, v_BTKH, gate_BTNH = self.qkv(x_BTD, positions_BT)
        k_BSKH = jax.lax.dynamic_update_slice_in_dim(k_BSKH, k_BTKH.astype(k_BSKH.dtype), index, axis=1)
        v_BSKH = jax.lax.dynamic_update_slice_in_dim(v_BSKH, v_BTKH.astype(v_BSKH.dtype), index, axis=1)
        dt = q_BTNH.dtype
        o_BTNH = jax.nn.dot_product_attention(q_BTNH, k_BSKH.astype(dt), v_BSKH.astype(dt), mask=mask_BTS[:, None])
        return self.out(o_BTNH, gate_BTNH), k_BSKH, v_BSKH


class GatedDeltaNet(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        init = nnx.initializers.normal(cfg.init_std)
        out_init = nnx.initializers.normal(cfg.init_std / (2 * cfg.num_layers) ** 0.5)
        D, Kh, Vh = cfg.d_model, cfg.linear_key_heads, cfg.linear_value_heads
        dk, dv, W = cfg.linear_key_dim, cfg.linear_value_dim, cfg.linear_conv_kernel
        R = Vh // Kh
        self.dims = (Kh, Vh, dk, dv)
        # Per key head, as transformers' in_proj_qkvz / in_proj_ba: [q dk | k dk | v R*dv | z R*dv], [b R | a R].
        self.wqkvz_DKX = param(rngs, init, (D, Kh, 2 * dk + 2 * R * dv), ("embed", "kv_heads", None))
        self.wba_DKX = param(rngs, init, (D, Kh, 2 * R), ("embed", "kv_heads", None))
        self.conv_C1W = param(rngs, init, (2 * Kh * dk + Vh * dv, 1, W), (None, None, None))
        self.dt_bias_V = param(rngs, nnx.initializers.ones, (Vh,), (None,))
        self.a_log_V = nnx.Param(
            jnp.log(jax.random.uniform(rngs.params(), (Vh,), jnp.float32, 0.01, 16.0)),
            out_sharding=(None,),
            eager_sharding=False,
        )
        self.norm = decoder_layers.RMSNorm(dv, cfg.norm_eps, rngs, (None,))  # plain scale w, then x silu(z)
        self.wo_VHD = param(rngs, out_init, (Vh, dv, D), ("heads", "head_dim", "embed"))

    def __call__(self, x_BTD, tail_BWC=None, state_BVKD=None):
        """-> (y_BTD, conv tail, recurrent state); no tail/state: a sequence from its start."""
        Kh, Vh, dk, dv = self.dims
        B, T, _ = x_BTD.shape
        R = Vh // Kh
        qkvz = lora_mod.project(self, "wqkvz_DKX", x_BTD, ("embed", "kv_heads", None))
        ba = lora_mod.project(self, "wba_DKX", x_BTD, ("embed", "kv_heads", None))
        q, k = qkvz[..., :dk], qkvz[..., dk : 2 * dk]
        v, z = qkvz[..., 2 * dk : 2 * dk + R * dv], qkvz[..., 2 * dk + R * dv :]
        b_BTV, a_BTV = ba[..., :R].reshape(B, T, Vh), ba[..., R:].reshape(B, T, Vh)
        mixed = jnp.concatenate([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], axis=-1)
        W = self.conv_C1W.shape[-1]
        tail_BWC = jnp.zeros((B, W - 1, mixed.shape[-1]), jnp.float32) if tail_BWC is None else tail_BWC
        mixed, tail_BWC = causal_conv(mixed, tail_BWC, self.conv_C1W[...])
        q_BTVK = jnp.repeat(mixed[..., : Kh * dk].reshape(B, T, Kh, dk), R, axis=2)
        k_BTVK = jnp.repeat(mixed[..., Kh * dk : 2 * Kh * dk].reshape(B, T, Kh, dk), R, axis=2)
        v_BTVD = mixed[..., 2 * Kh * dk :].reshape(B, T, Vh, dv)
        beta_BTV = jax.nn.sigmoid(b_BTV.astype(jnp.float32))
        g_BTV = -jnp.exp(self.a_log_V[...]) * jax.nn.softplus(a_BTV.astype(jnp.float32) + self.dt_bias_V[...])
        if state_BVKD is None:
            state_BVKD = jnp.zeros((B, Vh, dk, dv), jnp.float32)
        rule = gated_delta_rule if T == 1 else chunked_delta_rule  # decoding steps: one token
        o_BTVD, state_BVKD = rule(q_BTVK, k_BTVK, v_BTVD, g_BTV, beta_BTV, state_BVKD)
        z_BTVD = z.reshape(B, T, Vh, dv).astype(jnp.float32)
        o_BTVD = (self.norm(o_BTVD) * jax.nn.silu(z_BTVD)).astype(x_BTD.dtype)
        o_BTVD = constrain(o_BTVD, ("batch", "seq", "heads", None))
        y_BTD = lora_mod.project(self, "wo_VHD", o_BTVD.reshape(B, T, Vh * dv), ("heads", "head_dim", "embed"), 2)
        return y_BTD, tail_BWC.astype(jnp.float32), state_BVKD


class MoE(moe.MoE):
    """models/moe.py's routed experts (softmax top-k over ep) plus a shared expert gated by sigmoid(x . w)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        super().__init__(dataclasses.replace(cfg, moe_shared_experts=0), rngs)
        init = nnx.initializers.normal(cfg.init_std)
        out_init = nnx.initializers.normal(cfg.init_std / (2 * cfg.num_layers) ** 0.5)
        D, S = cfg.d_model, cfg.moe_shared_dim
        self.has_shared = bool(S)
        if S:
            self.sh_gate_DS = param(rngs, init, (D, S), ("embed", "mlp"))
            self.sh_up_DS = param(rngs, init, (D, S), ("embed", "mlp"))
            self.sh_down_SD = param(rngs, out_init, (S, D), ("mlp", "embed"))
            self.sh_router_D1 = param(rngs, init, (D, 1), ("embed", None))

    def __call__(self, x_BTD):
        y_BTD, aux = super().__call__(x_BTD)
        if self.has_shared:
            dt = x_BTD.dtype
            h = jax.nn.silu(moe._matmul(x_BTD, self.sh_gate_DS[...].astype(dt)))
            h = constrain(h * moe._matmul(x_BTD, self.sh_up_DS[...].astype(dt)), ("batch", "seq", "mlp"))
            s_BTD = moe._matmul(h, self.sh_down_SD[...].astype(dt))
            gate_BT1 = jax.nn.sigmoid(moe._matmul(x_BTD.astype(jnp.float32), self.sh_router_D1[...]))
            y_BTD = y_BTD + (gate_BT1 * s_BTD.astype(jnp.float32)).astype(y_BTD.dtype)
        return y_BTD, aux


class Block(nnx.Module):
    """One layer: (1 + w) norm, token mixer (gated DeltaNet or gated attention), (1 + w) norm, MLP or MoE."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, linear: bool = False):
        self.attn_norm = Norm(cfg.d_model, cfg.norm_eps, rngs)
        self.attn = GatedDeltaNet(cfg, rngs) if linear else Attention(cfg, rngs)
        self.mlp_norm = Norm(cfg.d_model, cfg.norm_eps, rngs)
        self.sparse = bool(cfg.moe_experts)
        self.mlp = MoE(cfg, rngs) if self.sparse else decoder_layers.MLP(cfg, rngs)

    def _mlp(self, x_BTD):
        y = self.mlp(self.mlp_norm(x_BTD))
        y_BTD, aux = y if self.sparse else (y, None)
        return constrain(x_BTD + y_BTD, ("batch", "seq", None)), aux

    def mixed(self, x_BTD, positions_T):
        """The residual stream after the token mixer."""
        h = self.attn_norm(x_BTD)
        attn = self.attn
        return x_BTD + (attn(h)[0] if isinstance(attn, GatedDeltaNet) else attn(h, positions_T))

    def __call__(self, x_BTD, positions_T):
        x_BTD, aux = self._mlp(self.mixed(x_BTD, positions_T))
        return x_BTD if aux is None else (x_BTD, aux)


class Group(nnx.Module):
    """The scanned unit: `full_attention_interval` layers, gated DeltaNet in all but the last."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        n = cfg.full_attention_interval
        self.layers = nnx.List([Block(cfg, rngs, linear=i < n - 1) for i in range(n)])

    def __call__(self, x_BTD, positions_T, segment_ids_BT=None):
        if segment_ids_BT is not None:
            raise JaxdistError(
                "packed documents (segment ids) are not supported by model.family=qwen3_next: its linear-attention "
                "state would run from one document into the next; turn document masking off"
            )
        auxes = []
        for block in self.layers:
            x_BTD, aux = block._mlp(block.mixed(x_BTD, positions_T))
            auxes.append(aux)
        if auxes[0] is None:
            return x_BTD
        return x_BTD, jax.tree.map(lambda *a: jnp.stack(a), *auxes)

    def cached(self, x_BTD, positions_BT, cache, index, mask_BTS):
        """Decoding: cache = (k, v) of the full layer, (tails (n-1, B, W-1, C), states (n-1, B, Vh, dk, dv))."""
        (k_BSKH, v_BSKH), (tails, states) = cache
        real_BT1 = mask_BTS.any(-1)[..., None]  # left padding: no key visible
        new_tails, new_states = [], []
        for i, block in enumerate(self.layers):
            h = block.attn_norm(x_BTD)
            attn = block.attn
            if isinstance(attn, GatedDeltaNet):
                a_BTD, tail, state = attn(jnp.where(real_BT1, h, 0), tails[i], states[i])
                new_tails.append(tail)
                new_states.append(state)
            else:
                a_BTD, k_BSKH, v_BSKH = attn.cached(h, positions_BT, k_BSKH, v_BSKH, index, mask_BTS)
            x_BTD = block._mlp(x_BTD + a_BTD)[0]
        return x_BTD, ((k_BSKH, v_BSKH), (jnp.stack(new_tails), jnp.stack(new_states)))


class Qwen3Next(llama.Llama):
    """`model(tokens_BT) -> logits_BTV`, `model.loss_head(tokens_BT) -> (loss.Head, aux)`:
    as `llama.Llama`."""

    Norm = Norm

    def unit(self, cfg: ModelConfig):
        return Group, cfg.num_layers // cfg.full_attention_interval

    def combine_aux(self, aux_GN):
        """Per-group aux stacked (groups, layers in a group, ...) -> per layer, then the decoder's."""
        return moe.combine_layers(jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), aux_GN))

    def empty_cache(self, batch: int, slots: int, dtype):
        """Per group: the full layer's (k, v) (G, B, S, K, H), and each DeltaNet layer's convolution tail
        (G, n-1, B, W-1, C) and recurrent state (G, n-1, B, Vh, dk, dv), float32."""
        m = self.cfg
        G, n = m.num_layers // m.full_attention_interval, m.full_attention_interval
        kv = jnp.zeros((G, batch, slots, m.num_kv_heads, m.head_dim), dtype)
        C = 2 * m.linear_key_heads * m.linear_key_dim + m.linear_value_heads * m.linear_value_dim
        tails = jnp.zeros((G, n - 1, batch, m.linear_conv_kernel - 1, C), jnp.float32)
        states = jnp.zeros((G, n - 1, batch, m.linear_value_heads, m.linear_key_dim, m.linear_value_dim), jnp.float32)
        return (kv, kv), (tails, states)

    def decode(self, tokens_BT, positions_BT, attn_cache, linear_cache, index, mask_BTS):
        """The cached forward (as llama.Llama.decode) over `empty_cache`'s two parts."""
        graphdef, stacked = nnx.split(self.blocks)

        def body(x, layer):
            state, kv, lin = layer
            group = nnx.merge(graphdef, state)  # a Group: the scanned unit's own cached()
            x, (kv, lin) = group.cached(x, positions_BT, (kv, lin), index, mask_BTS)  # pyright: ignore[reportCallIssue]
            return x, (kv, lin)

        x_BTD, (kv, lin) = jax.lax.scan(body, self.embed(tokens_BT), (stacked, attn_cache, linear_cache))
        return self.logits(x_BTD), kv, lin


Model = Qwen3Next


def other_layers(m: ModelConfig, tp: int):
    """The planner's layer kinds beside `Block` (registry.Architecture.other_layers): the gated DeltaNet
    layers, all but one of every `full_attention_interval`, their linear heads split by tp like the
    attention's, traced at whole chunks of the delta rule (its chunk activations are per chunk)."""
    local = lambda cfg: dataclasses.replace(
        cfg,
        linear_key_heads=max(1, m.linear_key_heads // tp),
        linear_value_heads=max(1, m.linear_value_heads // tp),
    )
    linear = lambda cfg, rngs: Block(local(cfg), rngs, linear=True)
    n = m.full_attention_interval
    return ((linear, (n - 1) / n, CHUNK),)


def linear_params(m: ModelConfig) -> int:
    D, Kh, Vh, dk, dv, W = (m.d_model, m.linear_key_heads, m.linear_value_heads, m.linear_key_dim,
                            m.linear_value_dim, m.linear_conv_kernel)  # fmt: skip
    C = 2 * Kh * dk + Vh * dv
    return D * (2 * Kh * dk + 2 * Vh * dv) + D * 2 * Vh + C * W + 2 * Vh + dv + Vh * dv * D


def attention_params(m: ModelConfig) -> int:
    D, N, K, H = m.d_model, m.num_heads, m.num_kv_heads, m.head_dim
    return D * N * 2 * H + 2 * D * K * H + N * H * D + 2 * H


def mlp_params(m: ModelConfig) -> tuple[int, int]:
    """(total, active) of one layer's feed-forward."""
    D = m.d_model
    if not m.moe_experts:
        return 3 * D * m.mlp_dim, 3 * D * m.mlp_dim
    E, K, F, S = m.moe_experts, m.moe_topk, moe.expert_dim(m), m.moe_shared_dim
    shared = 3 * D * S + D if S else 0
    return D * E + 3 * D * F * E + shared, D * E + 3 * D * F * K + shared


def count_params(cfg: ModelConfig) -> dict[str, int]:
    """Exact parameter counts by group, from the config alone."""
    D, V, L = cfg.d_model, cfg.vocab_size, cfg.num_layers
    full = L // cfg.full_attention_interval
    mlp_total, mlp_active = mlp_params(cfg)
    layers = (L - full) * linear_params(cfg) + full * attention_params(cfg) + L * (mlp_total + 2 * D)
    embed, head = V * D, 0 if cfg.tie_embeddings else D * V
    total = embed + layers + head + D
    return {"embed": embed, "layers": layers, "head": head, "final_norm": D, "total": total,
            "active": total - L * (mlp_total - mlp_active)}  # fmt: skip
