"""DeepSeek-V3 in Flax NNX: the decoder skeleton of `models/llama.py` (embedding, scanned layers, final
norm, head) with DeepSeek's parts:

- multi-head latent attention (MLA, DeepSeek-V2 §2.1): queries through a low-rank `mla_q_rank` projection
  and its RMSNorm (or one full projection when 0); keys and values from one compressed latent of width
  `mla_kv_rank` (RMS-normed) expanded per head into `mla_nope_dim` key and `mla_v_dim` value features, plus
  one rotary key of `mla_rope_dim` shared by every head; queries carry nope + rope features per head.
  Scores scaled by (nope + rope)^-1/2. `rope_interleave`: the rotary pairs are adjacent dims (x0, x1).
  Rotary default or YaRN (`rotary_setup`: frequencies, the cos/sin factor and the scores' mscale^2).
  The decoding cache holds the normed latent and the rotated shared key, (kv_rank + rope) numbers per
  token and layer, not the full keys and values (N * (nope + rope + v)): `cache_bytes_per_token`.
- mixture of experts with sigmoid scores, `moe_groups` groups of which each token keeps the
  `moe_topk_groups` with the best two-expert sums, a per-expert selection bias (`e_bias_E`,
  transformers' e_score_correction_bias) added for the choice only, gates renormalised (`moe_norm_topk`)
  and multiplied by `moe_routed_scale`, and shared experts seeing every token (`models/moe.py`'s MoE,
  its expert parallelism over `ep` and all);
- the first `dense_layers` layers with a dense SwiGLU MLP (`mlp_dim`): a second scanned stack
  (`dense_blocks`) run before the MoE stack (`blocks`).

The selection bias is no gradient parameter: `balance_bias` is the auxiliary-loss-free update
(DeepSeek-V3 §2.1.2) the training step applies after the optimizer, b_e -= rate * sign(load_e - mean load).

Shapes: B batch, T sequence, D d_model, N heads, R q rank, C kv rank, P rope dim, E experts.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdist.adapters import lora as lora_mod
from jaxdist.config import ModelConfig
from jaxdist.distributed.sharding import constrain
from jaxdist.models import decoder_layers, llama, moe
from jaxdist.models.attention import document_mask, rotary_by
from jaxdist.models.deepseek3_rules import dense_count

param = decoder_layers.param
RMSNorm = decoder_layers.RMSNorm
LATENT_EPS = 1e-6  # transformers' q_a_layernorm / kv_a_layernorm: the RMSNorm default, not rms_norm_eps
BIAS = "e_bias_E"  # the selection bias's name in the parameters (not trained by the optimizer)


BETA_FAST, BETA_SLOW = 32.0, 1.0  # YaRN's ramp ends (transformers' defaults; every DeepSeek config's values)


def _mscale(scale: float, m: float = 1.0) -> float:
    """YaRN's attention temperature, Eq. 21: 0.1 m ln(scale) + 1 (1 when not stretched)."""
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def rotary_setup(cfg: ModelConfig) -> tuple[tuple[float, ...], float, float]:
    """(per-pair frequencies, the rotated features' factor, the scores' factor) for the rotary dims, as
    transformers' default rope or `_compute_yarn_parameters` + `yarn_apply_mscale` (rope_scaling=yarn:
    interpolated frequencies below the beta_slow rotations, extrapolated above beta_fast, a linear ramp
    between; cos/sin x mscale(factor, mscale) / mscale(factor, mscale_all_dim); the softmax scale x
    mscale(factor, mscale_all_dim)^2)."""
    P, base = cfg.mla_rope_dim, cfg.rope_theta
    pos = (base ** (np.arange(0, P, 2, dtype=np.float32) / P)).astype(np.float32)
    if cfg.rope_scaling != "yarn":
        return tuple((1.0 / pos).tolist()), 1.0, 1.0
    f, orig, m, m_all = cfg.rope_factor, cfg.rope_original_max_len, cfg.rope_mscale, cfg.rope_mscale_all_dim
    attention = _mscale(f, m) / _mscale(f, m_all) if m and m_all else _mscale(f)
    dim = lambda rot: P * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))
    low, high = max(math.floor(dim(BETA_FAST)), 0), min(math.ceil(dim(BETA_SLOW)), P - 1)
    high = high + 0.001 if low == high else high
    ramp = np.clip((np.arange(P // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp
    freq = 1.0 / (f * pos) * (1 - extrapolate) + 1.0 / pos * extrapolate
    return tuple(freq.astype(np.float32).tolist()), attention, (_mscale(f, m_all) ** 2 if m_all else 1.0)


def rope_dims(x, interleave: bool):
    """The rotary part laid out as pairs (first half, second half): adjacent pairs de-interleaved."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1) if interleave else x


class Attention(nnx.Module):
    """Multi-head latent attention (no grouped heads: every head has its own expanded key/value)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        init = nnx.initializers.normal(cfg.init_std)
        out_init = nnx.initializers.normal(cfg.init_std / (2 * cfg.num_layers) ** 0.5)
        D, N, R, C = cfg.d_model, cfg.num_heads, cfg.mla_q_rank, cfg.mla_kv_rank
        Hn, P, Hv = cfg.mla_nope_dim, cfg.mla_rope_dim, cfg.mla_v_dim
        self.dims = (Hn, P, Hv, C)
        if R:
            self.wq_a_DR = param(rngs, init, (D, R), ("embed", None))
            self.q_norm = RMSNorm(R, LATENT_EPS, rngs, (None,))
            self.wq_b_RNH = param(rngs, init, (R, N, Hn + P), (None, "heads", "head_dim"))
        else:
            self.wq_DNH = param(rngs, init, (D, N, Hn + P), ("embed", "heads", "head_dim"))
        self.wkv_a_DC = param(rngs, init, (D, C + P), ("embed", None))
        self.kv_norm = RMSNorm(C, LATENT_EPS, rngs, (None,))
        self.wkv_b_CNH = param(rngs, init, (C, N, Hn + Hv), (None, "heads", "head_dim"))
        self.wo_NHD = param(rngs, out_init, (N, Hv, D), ("heads", "head_dim", "embed"))
        self.q_rank, self.interleave = R, cfg.rope_interleave
        self.freq, self.rope_factor, scores = rotary_setup(cfg)  # static: plain floats
        self.scale = float(Hn + P) ** -0.5 * scores

    def _rotary(self, x, positions):
        y = rotary_by(rope_dims(x, self.interleave), positions, jnp.asarray(self.freq, jnp.float32))
        return y if self.rope_factor == 1.0 else y * jnp.asarray(self.rope_factor, y.dtype)

    def query(self, x_BTD, positions):
        if self.q_rank:
            c_BTR = self.q_norm(lora_mod.project(self, "wq_a_DR", x_BTD, ("embed", None)))
            q_BTNH = lora_mod.project(self, "wq_b_RNH", c_BTR, (None, "heads", "head_dim"))
        else:
            q_BTNH = lora_mod.project(self, "wq_DNH", x_BTD, ("embed", "heads", "head_dim"))
        Hn = self.dims[0]
        q_BTNH = jnp.concatenate([q_BTNH[..., :Hn], self._rotary(q_BTNH[..., Hn:], positions)], axis=-1)
        return constrain(q_BTNH, ("batch", "seq", "heads", None))

    def latent(self, x_BTD, positions):
        """-> (normed latent (B, T, C), rotated shared key (B, T, P)): what the cache keeps."""
        C = self.dims[3]
        a_BTC = lora_mod.project(self, "wkv_a_DC", x_BTD, ("embed", None))
        k_BTP = self._rotary(a_BTC[..., None, C:], positions)[..., 0, :]
        return self.kv_norm(a_BTC[..., :C]), k_BTP

    def attend(self, q_BTNH, c_BSC, k_BSP, mask):
        """Keys and values expanded from the latent, attention under `mask` (broadcast to (B, N, T, S))."""
        Hn = self.dims[0]
        kv_BSNH = lora_mod.project(self, "wkv_b_CNH", c_BSC.astype(q_BTNH.dtype), (None, "heads", "head_dim"))
        kv_BSNH = constrain(kv_BSNH, ("batch", "seq", "heads", None))
        k_nope, v_BSNH = kv_BSNH[..., :Hn], kv_BSNH[..., Hn:]
        k_rope = jnp.broadcast_to(k_BSP[:, :, None, :].astype(q_BTNH.dtype), (*k_nope.shape[:3], k_BSP.shape[-1]))
        k_BSNH = jnp.concatenate([k_nope, k_rope], axis=-1)
        s_BNTS = jnp.einsum("btnh,bsnh->bnts", q_BTNH, k_BSNH, preferred_element_type=jnp.float32) * self.scale
        s_BNTS = jnp.where(mask, s_BNTS, jnp.finfo(jnp.float32).min)
        p_BNTS = jax.nn.softmax(s_BNTS, axis=-1).astype(v_BSNH.dtype)
        o_BTNH = jnp.einsum("bnts,bsnh->btnh", p_BNTS, v_BSNH)
        B, T, N, Hv = o_BTNH.shape
        return lora_mod.project(self, "wo_NHD", o_BTNH.reshape(B, T, N * Hv), ("heads", "head_dim", "embed"), 2)

    def __call__(self, x_BTD, positions_T, segment_ids_BT=None):
        T = x_BTD.shape[1]
        mask = jnp.tril(jnp.ones((T, T), bool))[None, None]
        seg = document_mask(segment_ids_BT)
        mask = mask if seg is None else mask & seg
        c_BTC, k_BTP = self.latent(x_BTD, positions_T)
        return self.attend(self.query(x_BTD, positions_T), c_BTC, k_BTP, mask)

    def cached(self, x_BTD, positions_BT, c_BSC, k_BSP, index, mask_BTS):
        """Decoding: this chunk's latent and rotary key written at slot `index` of the latent cache."""
        c_BTC, k_BTP = self.latent(x_BTD, positions_BT)
        c_BSC = jax.lax.dynamic_update_slice_in_dim(c_BSC, c_BTC.astype(c_BSC.dtype), index, axis=1)
        k_BSP = jax.lax.dynamic_update_slice_in_dim(k_BSP, k_BTP.astype(k_BSP.dtype), index, axis=1)
        return self.attend(self.query(x_BTD, positions_BT), c_BSC, k_BSP, mask_BTS[:, None]), c_BSC, k_BSP


def route(logits_BTE, bias_E, topk: int, groups: int, topk_groups: int, scale: float, norm: bool):
    """transformers' DeepseekV3TopkRouter: sigmoid scores; the choice on scores + bias, among the
    `topk_groups` groups whose two best biased scores sum highest; gates = the unbiased scores of the
    chosen experts, renormalised (`norm`, + 1e-20) and multiplied by `scale`. -> (ids, gates), (B, T, K)."""
    s_BTE = jax.nn.sigmoid(logits_BTE)
    choice_BTE = s_BTE + bias_E
    B, T, E = s_BTE.shape
    if groups > 1 and topk_groups < groups and E // groups > 1:
        group_BTG = jax.lax.top_k(choice_BTE.reshape(B, T, groups, E // groups), 2)[0].sum(-1)
        kept_BTG = jax.nn.one_hot(jax.lax.top_k(group_BTG, topk_groups)[1], groups, dtype=bool).any(-2)
        choice_BTE = jnp.where(jnp.repeat(kept_BTG, E // groups, axis=-1), choice_BTE, -jnp.inf)
    idx_BTK = jax.lax.top_k(choice_BTE, topk)[1]
    gate_BTK = jnp.take_along_axis(s_BTE, idx_BTK, axis=-1)
    if norm:
        gate_BTK = gate_BTK / (jnp.sum(gate_BTK, axis=-1, keepdims=True) + 1e-20)
    return idx_BTK, gate_BTK * scale


class MoE(moe.MoE):
    """models/moe.py's MoE (experts over ep, shared experts, aux sums) with DeepSeek-V3's router."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        super().__init__(cfg, rngs)
        self.e_bias_E = param(rngs, nnx.initializers.zeros, (cfg.moe_experts,), (None,))
        self.groups = (cfg.moe_groups, cfg.moe_topk_groups, cfg.moe_routed_scale)

    def __call__(self, x_BTD):
        groups, topk_groups, scale = self.groups
        bias_E = jax.lax.stop_gradient(self.e_bias_E[...]).astype(jnp.float32)
        fn = functools.partial(route, topk=self.topk, groups=groups, topk_groups=topk_groups,
                               scale=scale, norm=self.norm_topk)  # fmt: skip
        return super().__call__(x_BTD, route_fn=fn, route_args=(bias_E,))


class Block(decoder_layers.Block):
    """Llama's block (its forward and cached step) around MLA and the bias-corrected MoE; the cached
    step's two cache arrays are MLA's latent and rotary key instead of k and v."""

    lora_experts = True  # LoRA's gate/up/down targets are the routed experts (as peft's), not the dense MLP

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, sparse: bool = False):
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, rngs)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, rngs)
        self.mlp = MoE(cfg, rngs) if sparse else decoder_layers.MLP(cfg, rngs)
        self.sparse = sparse


class DeepseekV3(llama.Llama):
    """`model(tokens_BT) -> logits_BTV`, `model.loss_head(tokens_BT) -> (loss.Head, aux)`:
    as `llama.Llama`; two stacks."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, compute_dtype=jnp.float32, lora=None):
        super().__init__(cfg, rngs, compute_dtype, lora)
        k = dense_count(cfg)
        if cfg.moe_experts and k:

            @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
            def make_dense(key):
                block = Block(cfg, nnx.Rngs(params=key))
                if lora is not None:  # adapters on the dense layers' MLA, as on the MoE stack's
                    lora_mod.attach(block, lora, nnx.Rngs(params=jax.random.fold_in(key, 1)))
                return block

            self.dense_blocks = make_dense(jax.random.split(rngs.params(), k))
        else:
            self.dense_blocks = None

    def unit(self, cfg: ModelConfig):
        if not cfg.moe_experts:
            return Block, cfg.num_layers
        return (lambda c, g: Block(c, g, sparse=True)), cfg.num_layers - dense_count(cfg)

    def run_layers_aux(self, x_BTD, blocks=None, segment_ids_BT=None, positions_T=None, consts=None):
        if blocks is None and self.dense_blocks is not None:
            x_BTD = super().run_layers_aux(x_BTD, self.dense_blocks, segment_ids_BT, positions_T)[0]
        return super().run_layers_aux(x_BTD, blocks, segment_ids_BT, positions_T, consts)

    def pre_layers(self, x_BTD, positions_T=None):
        """The dense first layers: under pp they run before the pipeline, on every pp rank (as the
        embedding does; their weights replicated over pp), and the stages split the MoE stack."""
        if self.dense_blocks is None:
            return x_BTD
        return super().run_layers_aux(x_BTD, self.dense_blocks, positions_T=positions_T)[0]

    def empty_cache(self, batch: int, slots: int, dtype):
        """The latent cache: (L, B, S, kv_rank) normed latents and (L, B, S, rope_dim) rotated keys."""
        m = self.cfg
        return (jnp.zeros((m.num_layers, batch, slots, m.mla_kv_rank), dtype),
                jnp.zeros((m.num_layers, batch, slots, m.mla_rope_dim), dtype))  # fmt: skip

    def decode(self, tokens_BT, positions_BT, cache_c_LBSC, cache_k_LBSP, index, mask_BTS):
        """KV-cache forward (as llama.Llama.decode) over the latent cache of `empty_cache`."""

        def run(blocks, x, c, k):
            graphdef, stacked = nnx.split(blocks)

            def body(x, layer):
                state, c, k = layer
                x, c, k = nnx.merge(graphdef, state).cached(x, positions_BT, c, k, index, mask_BTS)
                return x, (c, k)

            return jax.lax.scan(body, x, (stacked, c, k))

        x_BTD, n = self.embed(tokens_BT), 0
        cs, ks = [], []
        for blocks in (self.dense_blocks, self.blocks):
            if blocks is None:
                continue
            depth = jax.tree.leaves(nnx.state(blocks))[0].shape[0]
            x_BTD, (c, k) = run(blocks, x_BTD, cache_c_LBSC[n : n + depth], cache_k_LBSP[n : n + depth])
            cs.append(c)
            ks.append(k)
            n += depth
        return self.logits(x_BTD), jnp.concatenate(cs), jnp.concatenate(ks)


Model = DeepseekV3


def balance_bias(bias_LE, load_LE, rate: float):
    """The auxiliary-loss-free update (DeepSeek-V3 §2.1.2): each expert's selection bias moves by `rate`
    against the sign of its load's deviation from the layer's mean (overloaded down, underloaded up)."""
    mean_L1 = jnp.mean(load_LE, axis=-1, keepdims=True)
    return bias_LE - rate * jnp.sign(load_LE - mean_L1).astype(bias_LE.dtype)


def after_step(m: ModelConfig, params, load_LE):
    """`balance_bias` on the MoE stack's selection biases at rate `model.moe_bias_rate` (0: unchanged)."""
    if not m.moe_bias_rate:
        return params
    return jax.tree_util.tree_map_with_path(
        lambda p, x: balance_bias(x, load_LE, m.moe_bias_rate) if jax.tree_util.keystr(p).endswith(f"'{BIAS}']") else x,
        params,
    )


def cache_bytes_per_token(cfg: ModelConfig, dtype_bytes: int) -> tuple[int, int]:
    """(latent cache, full k/v cache) bytes per token over all layers."""
    m = cfg
    latent = m.num_layers * (m.mla_kv_rank + m.mla_rope_dim) * dtype_bytes
    full = m.num_layers * m.num_heads * (m.mla_nope_dim + m.mla_rope_dim + m.mla_v_dim) * dtype_bytes
    return latent, full


def attention_params(cfg: ModelConfig) -> int:
    D, N, R, C = cfg.d_model, cfg.num_heads, cfg.mla_q_rank, cfg.mla_kv_rank
    Hn, P, Hv = cfg.mla_nope_dim, cfg.mla_rope_dim, cfg.mla_v_dim
    q = D * R + R + R * N * (Hn + P) if R else D * N * (Hn + P)
    return q + D * (C + P) + C + C * N * (Hn + Hv) + N * Hv * D


def count_params(cfg: ModelConfig) -> dict[str, int]:
    """Exact parameter counts by group (the selection biases counted: they are in the checkpoint)."""
    D, F, V, L = cfg.d_model, cfg.mlp_dim, cfg.vocab_size, cfg.num_layers
    k = dense_count(cfg)
    base = attention_params(cfg) + 2 * D
    moe_total, moe_active = moe.count_moe_layer(cfg) if cfg.moe_experts else (0, 0)
    E = cfg.moe_experts
    layers = k * (base + 3 * D * F) + (L - k) * (base + moe_total + E)
    embed, head = V * D, 0 if cfg.tie_embeddings else D * V
    total = embed + layers + head + D
    return {
        "embed": embed,
        "layers": layers,
        "head": head,
        "final_norm": D,
        "total": total,
        "active": total - (L - k) * (moe_total - moe_active),
    }
