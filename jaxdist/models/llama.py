"""Llama-style decoder in Flax NNX: RMSNorm, RoPE, grouped-query attention, SwiGLU, scanned layers.

Only logical axis names appear here. Shapes are suffixed on names: B batch, T sequence, D d_model,
N query heads, K kv heads, H head_dim, F mlp, V vocab, L layers.
"""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdist import loss, mixed
from jaxdist.config import ModelConfig
from jaxdist.models import moe
from jaxdist.parallel import context, embedding
from jaxdist.sharding import Rules, constrain, logical_names

REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def param(rngs: nnx.Rngs, init, shape: tuple[int, ...], names: tuple[str, ...]) -> nnx.Param:
    """A float32 parameter carrying logical axis names (placement is decided by the caller's rules)."""
    return nnx.Param(init(rngs.params(), shape, jnp.float32), out_sharding=names, eager_sharding=False)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, rngs: nnx.Rngs):
        self.scale = param(rngs, nnx.initializers.ones, (dim,), ("embed",))
        self.eps = eps

    def __call__(self, x_BTD):
        x = x_BTD.astype(jnp.float32)  # normalise in float32 whatever the compute dtype
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return (x * self.scale[...]).astype(x_BTD.dtype)


def token_matmul(x, w):
    """x[..., I] @ w[I, ...] with the leading (token) dims flattened into one: a plain 2-D matmul. Its
    weight gradient contracts one token dim, which XLA's CPU backend computes without the transposing
    copies of activations it makes for a (batch, seq) contraction (2.5x faster MLP step on CPU).
    Not when cp splits the sequence: (batch, seq/cp) does not flatten into one sharded dim, and XLA
    would all-gather the activations over cp to do it."""
    if context.splits_sequence():
        return jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())))
    out = x.reshape(-1, x.shape[-1]) @ w.reshape(x.shape[-1], -1)
    return out.reshape(*x.shape[:-1], *w.shape[1:])


def rope_frequencies(half: int, theta: float, scaling: tuple = ()):
    """Per-pair rotation frequencies; `scaling` = (factor, low_freq_factor, high_freq_factor,
    original_max_len) applies Llama 3.1's rescale: long wavelengths slowed by `factor`, short ones kept,
    a smooth blend between (as transformers' `_compute_llama3_parameters`)."""
    freq_H = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    if not scaling:
        return freq_H
    factor, low, high, original = scaling
    wavelen_H = 2 * jnp.pi / freq_H
    slowed_H = jnp.where(wavelen_H > original / low, freq_H / factor, freq_H)
    smooth_H = (original / wavelen_H - low) / (high - low)
    blended_H = (1 - smooth_H) * slowed_H / factor + smooth_H * slowed_H
    medium_H = (wavelen_H >= original / high) & (wavelen_H <= original / low)
    return jnp.where(medium_H, blended_H, slowed_H)


def rope_scaling(cfg: ModelConfig) -> tuple:
    """The static llama3 rescale parameters of `cfg` (() for none): hashable, so NNX keeps it static."""
    if cfg.rope_scaling == "none":
        return ()
    return (cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, float(cfg.rope_original_max_len))


def rotary(x_BTNH, positions_T, theta: float, scaling: tuple = ()):
    """Rotate pairs (first half, second half) of each head by position-dependent angles. Positions are
    (T,), shared by the batch, or (B, T) per row (packed documents restarting at 0; left-padded decoding)."""
    half = x_BTNH.shape[-1] // 2
    freq_H = rope_frequencies(half, theta, scaling)
    angle_BTH = jnp.asarray(positions_T)[..., None].astype(jnp.float32) * freq_H
    angle_BTH = angle_BTH if angle_BTH.ndim == 3 else angle_BTH[None]
    sin, cos = jnp.sin(angle_BTH)[:, :, None, :], jnp.cos(angle_BTH)[:, :, None, :]
    x1, x2 = jnp.split(x_BTNH.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_BTNH.dtype)


def causal_attention(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT=None):
    """Grouped-query causal attention: cuDNN's fused flash attention on GPU in bf16/fp16 (JAX's
    default is XLA's, which materialises the T x T scores), else XLA's. With `segment_ids_BT`, a token
    attends only within its own segment (packed documents)."""
    mask = document_mask(segment_ids_BT)
    if jax.default_backend() == "gpu" and q_BTNH.dtype in (jnp.bfloat16, jnp.float16):
        try:
            return jax.nn.dot_product_attention(
                q_BTNH, k_BTKH, v_BTKH, mask=mask, is_causal=True, implementation="cudnn"
            )
        except (ValueError, NotImplementedError, RuntimeError) as e:  # shape or cuDNN version unsupported
            warnings.warn(f"cuDNN attention unavailable ({e}); using XLA's attention")
    return jax.nn.dot_product_attention(q_BTNH, k_BTKH, v_BTKH, mask=mask, is_causal=True)


def document_segments(tokens_BT, eos_id: int):
    """Segment ids of packed documents (MaxText's decoder_segment_ids): a new document starts after
    each EOS; the EOS belongs to the document it ends."""
    is_eos = (tokens_BT == eos_id).astype(jnp.int32)
    return jnp.cumsum(is_eos, axis=1) - is_eos


def document_positions(segment_ids_BT):
    """Positions that restart at 0 where the segment id changes (RoPE sees each document alone)."""
    idx_BT = jnp.broadcast_to(jnp.arange(segment_ids_BT.shape[1]), segment_ids_BT.shape)
    starts_BT = jnp.concatenate(
        [jnp.ones_like(segment_ids_BT[:, :1], bool), segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]], axis=1
    )
    return idx_BT - jax.lax.cummax(jnp.where(starts_BT, idx_BT, 0), axis=1)


def document_mask(segment_ids_BT):
    """(B, 1, T, T) True where query and key are in the same segment; None without segments."""
    if segment_ids_BT is None:
        return None
    return (segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :])[:, None]


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rules: Rules | None, rngs: nnx.Rngs):
        init = nnx.initializers.normal(cfg.init_std)
        out_init = nnx.initializers.normal(cfg.init_std / (2 * cfg.num_layers) ** 0.5)
        D, N, K, H = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.wq_DNH = param(rngs, init, (D, N, H), ("embed", "heads", "head_dim"))
        self.wk_DKH = param(rngs, init, (D, K, H), ("embed", "kv_heads", "head_dim"))
        self.wv_DKH = param(rngs, init, (D, K, H), ("embed", "kv_heads", "head_dim"))
        self.wo_NHD = param(rngs, out_init, (N, H, D), ("heads", "head_dim", "embed"))
        self.theta, self.rules = cfg.rope_theta, rules
        self.scaling = rope_scaling(cfg)
        self.context_impl = cfg.context_impl

    def qkv(self, x_BTD, positions_T):
        r = self.rules
        q_BTNH = weight_matmul(x_BTD, self.wq_DNH[...], ("embed", "heads", "head_dim"), r)
        k_BTKH = weight_matmul(x_BTD, self.wk_DKH[...], ("embed", "kv_heads", "head_dim"), r)
        v_BTKH = weight_matmul(x_BTD, self.wv_DKH[...], ("embed", "kv_heads", "head_dim"), r)
        q_BTNH = rotary(q_BTNH, positions_T, self.theta, self.scaling)
        k_BTKH = rotary(k_BTKH, positions_T, self.theta, self.scaling)
        q_BTNH = constrain(q_BTNH, ("batch", "seq", "heads", None), self.rules)
        k_BTKH = constrain(k_BTKH, ("batch", "seq", "kv_heads", None), self.rules)
        return q_BTNH, k_BTKH, v_BTKH

    def out(self, o_BTNH):
        B, T, N, H = o_BTNH.shape
        names = ("heads", "head_dim", "embed")
        return weight_matmul(o_BTNH.reshape(B, T, N * H), self.wo_NHD[...], names, self.rules, in_dims=2)

    def __call__(self, x_BTD, positions_T, segment_ids_BT=None):
        q_BTNH, k_BTKH, v_BTKH = self.qkv(x_BTD, positions_T)
        if context.active(self.rules):  # cp > 1: the sequence is split over devices
            return self.out(context.attention(q_BTNH, k_BTKH, v_BTKH, self.context_impl, self.rules))
        return self.out(causal_attention(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT))

    def cached(self, x_BTD, positions_BT, k_BSKH, v_BSKH, index, mask_BTS):
        """Decoding: write this chunk's keys/values at cache slot `index`, attend to the cache under
        `mask_BTS` (causal and not padding). Returns (output, new k cache, new v cache)."""
        q_BTNH, k_BTKH, v_BTKH = self.qkv(x_BTD, positions_BT)
        k_BSKH = jax.lax.dynamic_update_slice_in_dim(k_BSKH, k_BTKH.astype(k_BSKH.dtype), index, axis=1)
        v_BSKH = jax.lax.dynamic_update_slice_in_dim(v_BSKH, v_BTKH.astype(v_BSKH.dtype), index, axis=1)
        o_BTNH = jax.nn.dot_product_attention(
            q_BTNH, k_BSKH.astype(q_BTNH.dtype), v_BSKH.astype(q_BTNH.dtype), mask=mask_BTS[:, None]
        )
        return self.out(o_BTNH), k_BSKH, v_BSKH


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rules: Rules | None, rngs: nnx.Rngs):
        init = nnx.initializers.normal(cfg.init_std)
        out_init = nnx.initializers.normal(cfg.init_std / (2 * cfg.num_layers) ** 0.5)
        self.w_gate_DF = param(rngs, init, (cfg.d_model, cfg.mlp_dim), ("embed", "mlp"))
        self.w_up_DF = param(rngs, init, (cfg.d_model, cfg.mlp_dim), ("embed", "mlp"))
        self.w_down_FD = param(rngs, out_init, (cfg.mlp_dim, cfg.d_model), ("mlp", "embed"))
        self.rules = rules

    def __call__(self, x_BTD):
        r = self.rules
        gate_BTF = weight_matmul(x_BTD, self.w_gate_DF[...], ("embed", "mlp"), r)
        up_BTF = weight_matmul(x_BTD, self.w_up_DF[...], ("embed", "mlp"), r)
        h_BTF = constrain(jax.nn.silu(gate_BTF) * up_BTF, ("batch", "seq", "mlp"), r)
        return weight_matmul(h_BTF, self.w_down_FD[...], ("mlp", "embed"), r)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rules: Rules | None, rngs: nnx.Rngs, sparse: bool = False):
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, rngs)
        self.attn = Attention(cfg, rules, rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, rngs)
        self.mlp = moe.MoE(cfg, rules, rngs) if sparse else MLP(cfg, rules, rngs)
        self.rules, self.sparse = rules, sparse

    def __call__(self, x_BTD, positions_T, segment_ids_BT=None):
        """-> x_BTD; a sparse (MoE) block returns (x_BTD, aux losses)."""
        x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD), positions_T, segment_ids_BT)
        y_BTD, aux = self.mlp(self.mlp_norm(x_BTD)) if self.sparse else (self.mlp(self.mlp_norm(x_BTD)), None)
        x_BTD = constrain(x_BTD + y_BTD, ("batch", "seq", None), self.rules)
        return x_BTD if aux is None else (x_BTD, aux)

    def cached(self, x_BTD, positions_BT, k_BSKH, v_BSKH, index, mask_BTS):
        a_BTD, k_BSKH, v_BSKH = self.attn.cached(self.attn_norm(x_BTD), positions_BT, k_BSKH, v_BSKH, index, mask_BTS)
        x_BTD = x_BTD + a_BTD
        y_BTD = self.mlp(self.mlp_norm(x_BTD))
        x_BTD = x_BTD + (y_BTD[0] if self.sparse else y_BTD)
        return constrain(x_BTD, ("batch", "seq", None), self.rules), k_BSKH, v_BSKH


class SparseGroup(nnx.Module):
    """model.moe_every = n > 1: the scanned unit is n layers, the last of them sparse."""

    def __init__(self, cfg: ModelConfig, rules: Rules | None, rngs: nnx.Rngs):
        n = cfg.moe_every
        self.layers = nnx.List([Block(cfg, rules, rngs, sparse=i == n - 1) for i in range(n)])

    def __call__(self, x_BTD, positions_T, segment_ids_BT=None):
        for block in self.layers[:-1]:
            x_BTD = block(x_BTD, positions_T, segment_ids_BT)
        return self.layers[-1](x_BTD, positions_T, segment_ids_BT)


def scanned_unit(cfg: ModelConfig):
    """(module class, how many are stacked): Block per layer, or a SparseGroup per moe_every layers."""
    if not cfg.moe_experts:
        return Block, cfg.num_layers
    if cfg.moe_every == 1:
        return (lambda c, r, g: Block(c, r, g, sparse=True)), cfg.num_layers
    return SparseGroup, cfg.num_layers // cfg.moe_every


class Llama(nnx.Module):
    """`model(tokens_BT) -> logits_BTV` (float32). The layer stack has a leading `layers` axis."""

    def __init__(self, cfg: ModelConfig, rules: Rules | None, rngs: nnx.Rngs, compute_dtype=jnp.float32):
        self.cfg, self.rules, self.compute_dtype = cfg, _freeze(rules), compute_dtype
        init = nnx.initializers.normal(cfg.init_std)
        self.embed_VD = param(rngs, init, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"))

        unit, stacked = scanned_unit(cfg)

        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_blocks(key):
            return unit(cfg, self.rules, nnx.Rngs(params=key))

        self.blocks = make_blocks(jax.random.split(rngs.params(), stacked))
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, rngs)
        if not cfg.tie_embeddings:
            self.head_DV = param(rngs, init, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"))

    def embed(self, tokens_BT):
        # A lookup inside a small shard_map over the table's sharded axes: the table is never gathered.
        return embedding.lookup(self.embed_VD[...], tokens_BT, self.rules, self.compute_dtype)

    def run_layers(self, x_BTD, blocks: Block | None = None, segment_ids_BT=None, positions_T=None):
        """Scan one compiled Block over the stacked layers (`blocks` defaults to all of them). With
        `segment_ids_BT` (packed documents), attention stays inside a segment and positions restart.
        `positions_T`: the tokens' positions (default 0..T-1; context parallelism's reordered ones)."""
        return self.run_layers_aux(x_BTD, blocks, segment_ids_BT, positions_T)[0]

    def run_layers_aux(self, x_BTD, blocks: Block | None = None, segment_ids_BT=None, positions_T=None):
        """run_layers, also returning the sparse layers' aux losses stacked over layers (None if dense)."""
        graphdef, stacked = nnx.split(self.blocks if blocks is None else blocks)
        if segment_ids_BT is not None:
            segment_ids_BT = constrain(segment_ids_BT, ("batch", "seq"), self.rules)
            positions_T = document_positions(segment_ids_BT)
        elif positions_T is None:
            positions_T = jnp.arange(x_BTD.shape[1])
        else:
            positions_T = jnp.asarray(positions_T)

        # Per-layer logical names (the stacked axis dropped), for the cast before the fsdp gather.
        names = jax.tree.map(lambda n: n[1:], logical_names(stacked), is_leaf=lambda n: isinstance(n, tuple))

        def body(x, layer_state):
            # Matrices cast while sharded (FSDP then gathers bf16, not float32), their gradients reduced
            # to the parameter's sharding inside the scan (no stack of unreduced layer gradients).
            # The dense layers' matrices stay float32 here: weight_matmul casts them on their shard itself
            # and keeps their gradient float32 through the reduction.
            layer_state = jax.tree_util.tree_map_with_path(
                lambda p, n, v: (
                    v.replace(cast_sharded(v[...], n, x.dtype, self.rules))
                    if len(n) > 1 and str(getattr(p[-1], "key", "")) not in WEIGHT_MATMUL
                    else v
                ),
                names,
                layer_state,
                is_leaf=lambda n: isinstance(n, tuple),
            )
            out = nnx.merge(graphdef, layer_state)(x, positions_T, segment_ids_BT)
            return out if isinstance(out, tuple) else (out, None)

        if self.cfg.remat != "none":
            body = jax.checkpoint(body, policy=REMAT_POLICIES[self.cfg.remat], prevent_cse=False)
        return jax.lax.scan(body, x_BTD, stacked)

    def head(self, x_BTD) -> loss.Head:
        """Final-normed hidden states and the head weight (D, V): the loss applies the head block by block."""
        head_DV = self.embed_VD[...].T if self.cfg.tie_embeddings else self.head_DV[...]
        return loss.Head(self.final_norm(x_BTD), head_DV, self.cfg.loss_impl, self.cfg.loss_block, self.rules)

    def logits(self, x_BTD):
        return loss.logits(self.head(x_BTD))

    def features(self, tokens_BT, segment_ids_BT=None, positions_T=None):
        """What `jaxdist.loss.cross_entropy` takes instead of logits (never B·T·V): a loss.Head, or
        (loss.Head, aux) with MoE layers."""
        return self(tokens_BT, segment_ids_BT, positions_T, features=True)

    def __call__(self, tokens_BT, segment_ids_BT=None, positions_T=None, features: bool = False):
        """-> logits_BTV (features=True: the loss.Head); with MoE layers (out, aux) (jaxdist.gradients adds
        aux['objective']). `positions_T`: context parallelism's load-balanced order (None: 0..T-1)."""
        x_BTD, aux = self.run_layers_aux(self.embed(tokens_BT), segment_ids_BT=segment_ids_BT, positions_T=positions_T)
        out = self.head(x_BTD) if features else self.logits(x_BTD)
        return out if aux is None else (out, moe.combine_layers(aux))

    def decode(self, tokens_BT, positions_BT, cache_k_LBSKH, cache_v_LBSKH, index, mask_BTS):
        """KV-cache forward of a chunk of tokens (the prompt, then one token at a time) written at cache
        slot `index`: -> (logits_BTV, new caches). The caches are stacked by layer like the weights."""
        graphdef, stacked = nnx.split(self.blocks)

        def body(x, layer):
            state, k, v = layer
            x, k, v = nnx.merge(graphdef, state).cached(x, positions_BT, k, v, index, mask_BTS)
            return x, (k, v)

        x_BTD, (cache_k, cache_v) = jax.lax.scan(body, self.embed(tokens_BT), (stacked, cache_k_LBSKH, cache_v_LBSKH))
        return self.logits(x_BTD), cache_k, cache_v


def cast_sharded(w, names, dtype, rules):
    """`w` in `dtype`, converted on its shard before any all-gather (half the bytes for bf16). The
    gradient goes back to float32 on the same sharding, so its reduction runs in float32."""

    @jax.custom_vjp
    def cast(w):
        return constrain(w.astype(dtype), names, rules)

    def bwd(_, g):
        return (constrain(g.astype(jnp.float32), names, rules),)

    cast.defvjp(lambda w: (cast(w), None), bwd)
    return cast(w)


# The layer matrices used only through weight_matmul (Attention, MLP): the scan does not pre-cast them.
WEIGHT_MATMUL = frozenset({"wq_DNH", "wk_DKH", "wv_DKH", "wo_NHD", "w_gate_DF", "w_up_DF", "w_down_FD"})


def weight_matmul(x, w, names, rules, in_dims: int = 1):
    """x[..., I] @ w[I..., O...] (w's first `in_dims` dims flatten to I) for a float32 master weight `w`
    carrying logical `names`. In a lower compute dtype, `w` is cast on its shard before any all-gather
    (FSDP gathers bf16), and the weight gradient comes out of its matmul in float32, so the reduction of
    the partial sums over the batch axes (all-reduce / reduce-scatter) runs in float32 — a plain
    `w.astype(bf16)` makes XLA reduce the bf16 matmul output, then convert (checked in the HLO)."""
    out_dims = w.shape[in_dims:]
    flat = lambda v: v.reshape(x.shape[-1], *out_dims)  # noqa: E731
    if x.dtype == w.dtype:  # as the scan's other matrices: constrained, gradient reduced to the sharding
        return token_matmul(x, flat(cast_sharded(w, names, x.dtype, rules)))

    def run(x, w16):
        return token_matmul(x, flat(w16))

    @jax.custom_vjp
    def mm(x, w):
        return run(x, constrain(w.astype(x.dtype), names, rules))

    def fwd(x, w):
        w16 = constrain(w.astype(x.dtype), names, rules)
        return run(x, w16), (x, w16)

    def bwd(res, g):
        x, w16 = res
        lead = x.ndim - 1
        tokens = tuple(range(lead))
        if context.splits_sequence():  # no (batch, seq) flattening under cp (see token_matmul)
            g2 = g.reshape(*g.shape[:lead], math.prod(out_dims))  # a 2-D result (see jaxdist.mixed)
            dw = mixed.dot_general_f32(x, g2, ((tokens, tokens), ((), ())))
        else:
            x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, math.prod(out_dims))
            dw = mixed.dot_general_f32(x2, g2, (((0,), (0,)), ((), ())))
        dw = constrain(dw.reshape(w16.shape), names, rules)
        w2 = flat(w16)
        out_axes = tuple(range(1, w2.ndim))
        dx = jax.lax.dot_general(g, w2, ((tuple(range(lead, g.ndim)), out_axes), ((), ())))
        return dx.astype(x.dtype), dw

    mm.defvjp(fwd, bwd)
    return mm(x, w)


def _freeze(rules):
    """Rules become a hashable tuple so NNX treats them as static structure, not state."""
    return None if rules is None else tuple((k, tuple(v)) for k, v in dict(rules).items())


def count_params(cfg: ModelConfig) -> dict[str, int]:
    """Exact parameter counts by group, from the config alone."""
    D, N, K, H, F, V, L = (
        cfg.d_model,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.mlp_dim,
        cfg.vocab_size,
        cfg.num_layers,
    )
    per_layer = D * N * H * 2 + D * K * H * 2 + 3 * D * F + 2 * D
    embed = V * D
    head = 0 if cfg.tie_embeddings else D * V
    sparse = L // cfg.moe_every if cfg.moe_experts else 0  # MoE layers replace their MLP
    moe_total, moe_active = moe.count_moe_layer(cfg) if sparse else (0, 0)
    layers = L * per_layer + sparse * (moe_total - 3 * D * F)
    total = embed + layers + head + D
    return {
        "embed": embed,
        "layers": layers,
        "head": head,
        "final_norm": D,
        "total": total,
        "active": total - sparse * (moe_total - moe_active),
    }
