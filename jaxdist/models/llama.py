"""Llama-style decoder in Flax NNX: the model (embedding, the scanned layer stack, final norm, head; its entry
points; KV-cache decoding) and its parameter count. Its layers: models/decoder_layers.py.

Only logical axis names appear here. Shapes are suffixed on names: B batch, T sequence, D d_model,
N query heads, K kv heads, H head_dim, F mlp, V vocab, L layers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdist.adapters import lora as lora_mod
from jaxdist.config import ModelConfig
from jaxdist.distributed import offload
from jaxdist.distributed.sharding import constrain, logical_names
from jaxdist.models import moe
from jaxdist.models.attention import document_positions
from jaxdist.models.decoder_layers import (
    REMAT_POLICIES,
    Block,
    RMSNorm,
    param,
    scanned_unit,
)
from jaxdist.parallel import embedding, loss, matmul
from jaxdist.parallel.matmul import WEIGHT_MATMUL, cast_sharded


class Llama(nnx.Module):
    """The decoder. Its entry points have one return type each: `model(tokens_BT) -> logits_BTV` (float32:
    generation, evaluation, the comparisons with transformers); `model.loss_head(tokens_BT) -> (loss.Head,
    aux)` (training: the loss applies the head block by block; aux holds the MoE layers' sums, {} when
    dense); `model.decode(...) -> (logits, k cache, v cache)`. The layer stack has a leading `layers` axis.

    Another architecture that keeps this skeleton (embedding, scanned stack, norm, head) subclasses it
    and replaces its parts: `Norm`, `unit` (the scanned module), `embed_factor`, and `layer_consts`
    (per-layer constants scanned beside the weights, e.g. Gemma 3's window and rotary base)."""

    Norm = RMSNorm

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, compute_dtype=jnp.float32, lora=None):
        """`lora`: a LoraConfig with rank > 0 gives the layer matrices adapters (jaxdist.adapters)."""
        self.cfg, self.compute_dtype = cfg, compute_dtype
        init = nnx.initializers.normal(cfg.init_std)
        # Every layer reads its input through RMSNorm, so a small table (0.02) lets the first layers'
        # outputs, shared by a sequence's tokens at init, outweigh the tokens themselves (see models/moe.py).
        embed_init = nnx.initializers.normal(cfg.embed_init_std or cfg.init_std)
        self.embed_VD = param(rngs, embed_init, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"))

        unit, stacked = self.unit(cfg)

        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_blocks(key):
            block = unit(cfg, nnx.Rngs(params=key))
            if lora is not None:
                lora_mod.attach(block, lora, nnx.Rngs(params=jax.random.fold_in(key, 1)))
            return block

        self.blocks = make_blocks(jax.random.split(rngs.params(), stacked))
        self.final_norm = self.Norm(cfg.d_model, cfg.norm_eps, rngs)
        if not cfg.tie_embeddings:
            self.head_DV = param(rngs, init, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"))

    def unit(self, cfg: ModelConfig):
        """(scanned module class (cfg, rngs) -> module, how many are stacked)."""
        return scanned_unit(cfg)

    def embed_factor(self) -> float:
        """What the embedding lookup is multiplied by (1: nothing)."""
        return self.cfg.embed_scale

    def layer_consts(self):
        """Per-layer constants (leading axis: the stacked layers) passed to each unit as `consts`; None here."""
        return None

    def _consts(self, blocks, consts=None):
        if consts is not None:  # a part of the stack with its rows of `layer_consts` (the pipeline's stages)
            return consts
        consts = self.layer_consts()
        if consts is not None and blocks is not None:
            raise NotImplementedError("layers with per-layer constants run as one whole stack or with their consts")
        return consts

    def pre_layers(self, x_BTD, positions_T=None):
        """Layers run before the scanned stack (outside a pipeline's stages); none here."""
        return x_BTD

    def embed(self, tokens_BT):
        # A lookup inside a small shard_map over the table's sharded axes: the table is never gathered.
        # A LoRA base stored in bfloat16 is cast to the compute dtype first (on its shard): XLA:CPU aborts
        # ("Invalid binary instruction opcode copy") on the bfloat16 lookup under tp with float32 compute.
        table_VD = self.embed_VD[...]
        table_VD = table_VD if table_VD.dtype == jnp.float32 else table_VD.astype(self.compute_dtype)
        x_BTD = embedding.lookup(table_VD, tokens_BT, self.compute_dtype)
        # model.embed_scale: a large residual stream from a small table, which Adam moves at its own pace.
        factor = self.embed_factor()
        return x_BTD if factor == 1.0 else x_BTD * factor

    def run_layers(self, x_BTD, blocks: Block | None = None, segment_ids_BT=None, positions_T=None):
        """Scan one compiled Block over the stacked layers (`blocks` defaults to all of them). With
        `segment_ids_BT` (packed documents), attention stays inside a segment and positions restart.
        `positions_T`: the tokens' positions (default 0..T-1; context parallelism's reordered ones)."""
        return self.run_layers_aux(x_BTD, blocks, segment_ids_BT, positions_T)[0]

    def run_layers_aux(self, x_BTD, blocks: Block | None = None, segment_ids_BT=None, positions_T=None, consts=None):
        """run_layers, also returning the sparse layers' aux losses stacked over layers (None if dense).
        `consts`: `blocks`' rows of `layer_consts` when `blocks` is a part of the stack (a pipeline stage)."""
        consts = self._consts(blocks, consts)
        graphdef, stacked = nnx.split(self.blocks if blocks is None else blocks)
        if segment_ids_BT is not None:
            segment_ids_BT = constrain(segment_ids_BT, ("batch", "seq"))
            positions_T = document_positions(segment_ids_BT)
        elif positions_T is None:
            positions_T = jnp.arange(x_BTD.shape[1])
        else:
            positions_T = jnp.asarray(positions_T)

        # Per-layer logical names (the stacked axis dropped), for the cast before the fsdp gather.
        names = jax.tree.map(lambda n: n[1:], logical_names(stacked), is_leaf=lambda n: isinstance(n, tuple))

        def body(x, layer):
            layer_state, c = layer
            layer_state = offload.fetch(layer_state)  # offload.params=host: this layer only, to the device
            # Matrices cast while sharded (FSDP then gathers bf16, not float32), their gradients reduced
            # to the parameter's sharding inside the scan (no stack of unreduced layer gradients).
            # The dense layers' matrices stay float32 here: weight_matmul casts them on their shard itself
            # and keeps their gradient float32 through the reduction.
            layer_state = jax.tree_util.tree_map_with_path(
                lambda p, n, v: (
                    v.replace(cast_sharded(v[...], n, x.dtype))
                    if len(n) > 1
                    and str(getattr(p[-1], "key", "")) not in WEIGHT_MATMUL | lora_mod.KEEP_DTYPE
                    and jnp.issubdtype(v[...].dtype, jnp.floating)  # never QLoRA's integer codes (DeepSeek-V3's MLA)
                    else v
                ),
                names,
                layer_state,
                is_leaf=lambda n: isinstance(n, tuple),
            )
            # The family's block: pyright reads this module's Block, but some families' blocks take consts `c`
            unit = cast(Callable[..., Any], nnx.merge(graphdef, layer_state))
            out = unit(x, positions_T, segment_ids_BT) if c is None else unit(x, positions_T, segment_ids_BT, c)
            return out if isinstance(out, tuple) else (out, None)

        with matmul.fp8_matmuls(self.cfg.fp8):
            if self.cfg.remat == "none":
                if any(offload.on_host(x) for x in jax.tree.leaves(stacked)):  # offload.params=host
                    body = jax.checkpoint(body, policy=offload.REFETCH_POLICY, prevent_cse=False)
                return jax.lax.scan(body, x_BTD, (stacked, consts))
            body = jax.checkpoint(body, policy=REMAT_POLICIES[self.cfg.remat], prevent_cse=False)
            with matmul.recomputed_layers():  # one gather per weight in the backward, shared by its matmuls
                return jax.lax.scan(body, x_BTD, (stacked, consts))

    def head(self, x_BTD) -> loss.Head:
        """Final-normed hidden states and the head weight (D, V): the loss applies the head block by block."""
        head_DV = self.embed_VD[...].T if self.cfg.tie_embeddings else self.head_DV[...]
        m = self.cfg
        return loss.Head(self.final_norm(x_BTD), head_DV, m.loss_impl, m.loss_block, m.loss_gather_mib, m.loss_keep_mib)

    def logits(self, x_BTD):
        return loss.logits(self.head(x_BTD))

    def combine_aux(self, aux_L):
        """Per-layer aux sums (leading layer axis) -> the model's (the pipeline calls it too)."""
        return moe.combine_layers(aux_L)

    def loss_head(self, tokens_BT, segment_ids_BT=None, positions_T=None) -> tuple[loss.Head, dict]:
        """The training forward: (loss.Head, aux). The head is what `jaxdist.parallel.loss.cross_entropy` takes
        instead of logits (never B·T·V); aux holds the MoE layers' sums ({} for a dense model):
        aux['objective'] is added to the training loss (jaxdist.reduce.gradients), the rest are statistics.
        `positions_T`: context parallelism's load-balanced order (None: 0..T-1)."""
        x_BTD, aux = self.run_layers_aux(self.embed(tokens_BT), segment_ids_BT=segment_ids_BT, positions_T=positions_T)
        return self.head(x_BTD), ({} if aux is None else self.combine_aux(aux))

    def __call__(self, tokens_BT, segment_ids_BT=None, positions_T=None) -> jax.Array:
        """-> logits_BTV, whatever the layers (MoE included: their aux sums are `loss_head`'s)."""
        x_BTD, _ = self.run_layers_aux(self.embed(tokens_BT), segment_ids_BT=segment_ids_BT, positions_T=positions_T)
        return self.logits(x_BTD)

    def empty_cache(self, batch: int, slots: int, dtype):
        """The (k, v) caches `decode` fills: (L, B, S, K, H) each."""
        m = self.cfg
        cache = jnp.zeros((m.num_layers, batch, slots, m.num_kv_heads, m.head_dim), dtype)
        return cache, cache

    def decode(self, tokens_BT, positions_BT, cache_k_LBSKH, cache_v_LBSKH, index, mask_BTS):
        """KV-cache forward of a chunk of tokens (the prompt, then one token at a time) written at cache
        slot `index`: -> (logits_BTV, new caches). The caches are stacked by layer like the weights."""
        graphdef, stacked = nnx.split(self.blocks)

        consts = self.layer_consts()

        def body(x, layer):
            state, k, v, c = layer
            unit = nnx.merge(graphdef, state)
            extra = () if c is None else (c,)
            x, k, v = unit.cached(x, positions_BT, k, v, index, mask_BTS, *extra)
            return x, (k, v)

        L, group = cache_k_LBSKH.shape[0], self.cfg.num_layers // self.cfg.stack_depth  # SparseGroup: n layers
        ck, cv = (
            c.reshape(L // group, group, *c.shape[1:]) if group > 1 else c for c in (cache_k_LBSKH, cache_v_LBSKH)
        )
        x_BTD, (ck, cv) = jax.lax.scan(body, self.embed(tokens_BT), (stacked, ck, cv, consts))
        return self.logits(x_BTD), ck.reshape(cache_k_LBSKH.shape), cv.reshape(cache_v_LBSKH.shape)


def count_params(cfg: ModelConfig) -> dict[str, int]:
    """Exact parameter counts by group, from the config alone."""
    D, N, K, H, F, V, L = cfg.decoder_dims
    per_layer = D * N * H * 2 + D * K * H * 2 + 3 * D * F + 2 * D
    per_layer += (N + 2 * K) * H * cfg.qkv_bias + 2 * H * cfg.qk_norm
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


Model = Llama  # the registry's names (jaxdist.models.registry)
