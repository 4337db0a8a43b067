"""LoRA inside the model: adapters attached to the layer matrices, and the matmul that runs a frozen
(possibly quantised) base weight plus its adapter, W x + (alpha / r) B (A x) (rsLoRA: alpha / sqrt(r)).

Adapters carry logical axis names built from their weight's: A takes the weight's input names and
`lora_rank`, B `lora_rank` and its output names (e.g. wq_DNH (embed, heads, head_dim) -> A (embed,
lora_rank), B (lora_rank, heads, head_dim)), so the sharding rules place them as they place the weight.
A is initialised as PEFT does (uniform +-1/sqrt(fan_in)), B to zero: the adapted model starts equal to
the base. The base is frozen: its matmul has no weight gradient, and only adapters reach the optimizer.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdist.adapters import layout, quant
from jaxdist.distributed.sharding import constrain, current_rules
from jaxdist.parallel.matmul import fp8_frozen_matmul, fp8_mode, token_matmul, weight_matmul

# lora.targets name -> (submodule of a Block, weight attribute, leading input dims of the weight)
TARGETS = {
    "q": ("attn", "wq_DNH", 1),
    "k": ("attn", "wk_DKH", 1),
    "v": ("attn", "wv_DKH", 1),
    "o": ("attn", "wo_NHD", 2),
    "gate": ("mlp", "w_gate_DF", 1),
    "up": ("mlp", "w_up_DF", 1),
    "down": ("mlp", "w_down_FD", 1),
    # DeepSeek-V3's multi-head latent attention (models/deepseek3.py): q's low-rank pair, the compressed
    # kv (latent + shared rotary key) and its per-head expansion
    "q_a": ("attn", "wq_a_DR", 1),
    "q_b": ("attn", "wq_b_RNH", 1),
    "kv_a": ("attn", "wkv_a_DC", 1),
    "kv_b": ("attn", "wkv_b_CNH", 1),
}
IN_DIMS = {w: n for _, w, n in TARGETS.values()}
ATTENTION = ("q", "k", "v", "o")
MLA = ("q_a", "q_b", "kv_a", "kv_b", "o")
EXPERTS = ("gate", "up", "down")  # on routed experts (layout.experts): peft's target_parameters, see attach_experts
GATE_UP = (
    "w_gate_up_EDF"  # the adapter of split gate/up experts as peft fuses them (transformers' experts.gate_up_proj)
)
FUSED = "w_gate_up_EDG"  # a fused (E, D, 2F) gate/up expert weight, gate and up interleaved (gpt-oss), adapted whole
A, B, SCALE = "_lora_a", "_lora_b", "_scale"
RANK = "lora_rank"  # the adapters' own logical axis (replicated by default)


def block_axis(weight: str) -> int:
    """The axis (from the end of the per-layer shape) that int8 / NF4 blocks run along: the weight's
    last input dim (D for wq/wk/wv/gate/up, H for wo, F for down)."""
    per_layer = {"wq_DNH": 3, "wk_DKH": 3, "wv_DKH": 3, "wo_NHD": 3, "wq_b_RNH": 3, "wkv_b_CNH": 3}.get(weight, 2)
    return IN_DIMS[weight] - 1 - per_layer


def scaling(lora) -> float:
    """The adapter's factor: alpha / rank, or alpha / sqrt(rank) with `lora.rslora` (rsLoRA, Kalajdzievski
    2023; peft's `use_rslora`), which keeps the update's scale steady as the rank grows."""
    return lora.alpha / (math.sqrt(lora.rank) if lora.rslora else lora.rank)


def carried(m) -> tuple[str, ...]:
    """The targets a model's layers carry (its registry entry's `layout.LoraLayout`): the seven, or the
    attention's four where the feed-forward is experts without adapters; MLA's projections (q_a and q_b, or q
    without a q rank; kv_a, kv_b, o) for MLA; gate/up/down on the routed experts where they take adapters."""
    lay = layout.of(m)
    attention = (MLA if m.mla_q_rank else ("q", *MLA[2:])) if lay.mla else ATTENTION
    if lay.experts:  # gate/up/down name the routed experts: none without experts (DeepSeek-V3's dense MLP)
        return (*attention, *(EXPERTS if m.moe_experts else ()))
    return (*attention, *(() if m.moe_experts else EXPERTS))


def attach(block, lora, rngs: nnx.Rngs) -> None:
    """Give a Block's targeted matrices adapters, and every layer matrix it has a scale slot when the
    base is quantised (the scales are computed when the base is stored: jaxdist.adapters.tree)."""
    if hasattr(block, "layers"):  # a scanned group of layers (Qwen3-Next): each layer's own matrices
        for layer in block.layers:
            attach(layer, lora, rngs)
        return
    for part, weight, _ in TARGETS.values():
        module = getattr(block, part)
        if not hasattr(module, weight):  # an MoE block's experts, a DeltaNet layer's mixer: not a target
            continue
        module.lora_scale = scaling(lora)  # static: marks the module as frozen-base LoRA
        w = getattr(module, weight)
        names, shape = tuple(w.get_metadata()["out_sharding"]), w[...].shape
        if lora.base_dtype in quant.KINDS:
            axis = block_axis(weight) % len(shape)
            sshape = shape[:axis] + (shape[axis] // lora.block_size,) + shape[axis + 1 :]
            setattr(module, weight + SCALE, _param(jnp.ones(sshape, jnp.float32), names))
    experts = getattr(block, "lora_experts", False)  # DeepSeek-V3, gpt-oss: gate/up/down name the routed experts
    for target in lora.targets:
        part, weight, n_in = TARGETS[target]
        module = getattr(block, part)
        if not hasattr(module, weight) or experts and target in EXPERTS:
            continue
        w = getattr(module, weight)
        names, shape = tuple(w.get_metadata()["out_sharding"]), w[...].shape
        fan_in = math.prod(shape[:n_in])
        bound = 1 / math.sqrt(fan_in)
        a = jax.random.uniform(rngs.params(), (*shape[:n_in], lora.rank), jnp.float32, -bound, bound)
        setattr(module, weight + A, _param(a, (*names[:n_in], RANK)))
        setattr(module, weight + B, _param(jnp.zeros((lora.rank, *shape[n_in:]), jnp.float32), (RANK, *names[n_in:])))

    if experts and hasattr(block.mlp, "w_down_EFD") and set(EXPERTS) & set(lora.targets):
        attach_experts(block.mlp, lora, rngs)


def expert_scales(lora, fused: bool = False) -> tuple[float, float]:
    """(gate/up, down) factors of the expert adapters as peft 0.21.2 sets them. Split gate and up (DeepSeek-V3):
    its v4 -> v5 conversion makes gate_proj + up_proj one adapter on the fused gate_up_proj of rank 2r and
    alpha 2 alpha (rsLoRA: 2 alpha / sqrt(2r)). A `fused` gate/up weight (gpt-oss) is targeted as it is: r,
    alpha. down_proj keeps r and alpha."""
    if fused:
        return scaling(lora), scaling(lora)
    r, alpha = 2 * lora.rank, 2 * lora.alpha
    return alpha / (math.sqrt(r) if lora.rslora else r), scaling(lora)


def attach_experts(module, lora, rngs: nnx.Rngs) -> None:
    """Adapters on an MoE module's routed experts, as peft's ParamWrapper holds them per expert e. Split gate
    and up weights (w_gate_EDF, w_up_EDF): they share A_e (D, 2r) and B_e (2r, 2, F) gives both halves (HF's
    gate_up_proj rows: gate then up). A fused (E, D, 2F) w_gate_up_EDG: A_e (D, r), B_e (r, 2F) in the weight's
    own column order (gpt-oss's interleaved gate/up). down A_e (F, r), B_e (r, D). A uniform +-1/sqrt(fan-in),
    B zero. `expert_weights` adds them to the weights."""
    fused = hasattr(module, FUSED)
    E, F, D = module.w_down_EFD[...].shape
    r = lora.rank
    module.lora_experts = expert_scales(lora, fused)  # static: marks the experts as adapted
    if "gate" in lora.targets and fused:  # with up (adapters.checks)
        a = jax.random.uniform(rngs.params(), (E, D, r), jnp.float32, -(D**-0.5), D**-0.5)
        setattr(module, FUSED + A, _param(a, ("expert", "embed", RANK)))
        setattr(module, FUSED + B, _param(jnp.zeros((E, r, 2 * F)), ("expert", RANK, "mlp")))
    elif "gate" in lora.targets:
        a = jax.random.uniform(rngs.params(), (E, D, 2 * r), jnp.float32, -(D**-0.5), D**-0.5)
        setattr(module, GATE_UP + A, _param(a, ("expert", "embed", RANK)))
        setattr(module, GATE_UP + B, _param(jnp.zeros((E, 2 * r, 2, F)), ("expert", RANK, None, "mlp")))
    if "down" in lora.targets:
        a = jax.random.uniform(rngs.params(), (E, F, r), jnp.float32, -(F**-0.5), F**-0.5)
        setattr(module, "w_down_EFD" + A, _param(a, ("expert", "mlp", RANK)))
        setattr(module, "w_down_EFD" + B, _param(jnp.zeros((E, r, D)), ("expert", RANK, "embed")))


def expert_weights(module):
    """An MoE module's (gate, up, down) expert weights for the dispatch, which takes no adapters: with expert
    adapters, the frozen weights plus each expert's scale * A_e B_e (a weight-space delta, O(E D F r) per
    layer and step, the same arithmetic as peft's merged parametrisation)."""
    wg, wu, wd = module.w_gate_EDF[...], module.w_up_EDF[...], module.w_down_EFD[...]
    scales = getattr(module, "lora_experts", None)
    if scales is None:
        return wg, wu, wd
    wg, wu, wd = (jax.lax.stop_gradient(w) for w in (wg, wu, wd))
    names = ("expert", "embed", "mlp")
    if hasattr(module, GATE_UP + A):
        a, b = getattr(module, GATE_UP + A)[...], getattr(module, GATE_UP + B)[...]
        d = jnp.einsum("edr,erhf->hedf", a.astype(jnp.float32), b.astype(jnp.float32)) * scales[0]
        wg = constrain((wg.astype(jnp.float32) + d[0]).astype(wg.dtype), names)
        wu = constrain((wu.astype(jnp.float32) + d[1]).astype(wu.dtype), names)
    if hasattr(module, "w_down_EFD" + A):
        a, b = getattr(module, "w_down_EFD" + A)[...], getattr(module, "w_down_EFD" + B)[...]
        d = jnp.einsum("efr,erd->efd", a.astype(jnp.float32), b.astype(jnp.float32)) * scales[1]
        wd = constrain((wd.astype(jnp.float32) + d).astype(wd.dtype), ("expert", "mlp", "embed"))
    return wg, wu, wd


def fused_expert_weights(module):
    """A fused-gate/up MoE module's (gate_up (E, D, 2F), down (E, F, D)) expert weights: as stored, or with
    expert adapters the frozen weights plus each expert's scale * A_e B_e (peft's ParamWrapper delta, in the
    weights' own layout)."""
    wgu, wd = module.w_gate_up_EDG[...], module.w_down_EFD[...]
    scales = getattr(module, "lora_experts", None)
    if scales is None:
        return wgu, wd
    out = []
    for name, w, scale, names in (
        (FUSED, wgu, scales[0], ("expert", "embed", "mlp")),
        ("w_down_EFD", wd, scales[1], ("expert", "mlp", "embed")),
    ):
        w = jax.lax.stop_gradient(w)
        if hasattr(module, name + A):
            a, b = getattr(module, name + A)[...], getattr(module, name + B)[...]
            d = jnp.einsum("eir,ero->eio", a.astype(jnp.float32), b.astype(jnp.float32)) * scale
            w = constrain((w.astype(jnp.float32) + d).astype(w.dtype), names)
        out.append(w)
    return out[0], out[1]


def _param(value, names) -> nnx.Param:
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


def project(module, weight: str, x, names: tuple[str | None, ...], in_dims: int = 1):
    """x @ module.<weight> (its first `in_dims` dims contracted). Without LoRA: `weight_matmul`
    (trained, float32 master). With LoRA: the frozen base (de-quantised here when stored as int8 / NF4,
    one layer at a time inside the scan) with no weight gradient, plus the adapter if it has one."""
    scaling = getattr(module, "lora_scale", None)
    w = getattr(module, weight)[...]
    if scaling is None:
        return weight_matmul(x, w, names, in_dims)
    scale = getattr(module, weight + SCALE, None)
    if scale is not None:
        # Gather the codes and scales (~0.5-1 byte per entry), not the de-quantised layer: the weight's
        # dims sharded over data-parallel axes (fsdp) are gathered before de-quantising, locally.
        names = gathered_names(names)
        w = quant.dequantize(constrain(w, names), constrain(scale[...], names), block_axis(weight), x.dtype)
    if fp8_mode() in ("tensorwise", "rowwise"):  # model.fp8: the frozen base's matmul in FP8, no weight gradient
        y = fp8_frozen_matmul(x, w, names, in_dims, fp8_mode() == "rowwise")
    else:
        w = constrain(jax.lax.stop_gradient(w).astype(x.dtype), names)
        y = token_matmul(x, w.reshape(x.shape[-1], *w.shape[in_dims:]))
    a = getattr(module, weight + A, None)
    if a is None:
        return y
    a, b = a[...].astype(x.dtype), getattr(module, weight + B)[...].astype(x.dtype)
    h = token_matmul(x, a.reshape(x.shape[-1], a.shape[-1]))
    return y + scaling * token_matmul(h, b)


# Stacked tensors the layer scan must not cast to the compute dtype: the float32 de-quantisation scales.
KEEP_DTYPE = frozenset(w + SCALE for w in IN_DIMS)


def count_adapter_params(m, lora) -> int:
    """Adapter parameters: rank x (fan-in + fan-out) per targeted matrix and layer (routed experts: per expert
    and MoE layer, r x (F + D) for down and for gate/up 2r x (D + 2F) split (DeepSeek-V3), r x (D + 2F) fused
    (gpt-oss))."""
    shapes = per_layer_shapes(m)
    total, r = 0, lora.rank
    lay = layout.of(m)
    if lay.experts and m.moe_experts:
        E, D, Fe, sparse = (
            m.moe_experts,
            m.d_model,
            m.moe_mlp_dim or m.mlp_dim,
            m.num_layers - (min(m.dense_layers, m.num_layers) if lay.dense_stack else 0),
        )
        gate_up = (1 if lay.experts == "fused" else 2) * r * (D + 2 * Fe)
        per = gate_up * ("gate" in lora.targets) + r * (Fe + D) * ("down" in lora.targets)
        experts = E * per * sparse
    else:
        experts = 0
    for target in lora.targets:
        if experts and target in EXPERTS:
            continue
        _, weight, n_in = TARGETS[target]
        shape = shapes[weight]
        total += lora.rank * (math.prod(shape[:n_in]) + math.prod(shape[n_in:]))
    return total * adapted_layers(m) + experts


def adapted_layers(m) -> int:
    """The layers that carry the targets: all, or Qwen3-Next's full-attention ones (one per group of
    `full_attention_interval`; its DeltaNet layers have no q/k/v/o)."""
    return m.num_layers // m.full_attention_interval if layout.of(m).grouped else m.num_layers


def per_layer_shapes(m) -> dict[str, tuple[int, ...]]:
    D, N, K, H, F = m.d_model, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim
    if layout.of(m).mla:
        return mla_shapes(m)
    gate = 2 if layout.of(m).grouped else 1  # Qwen3-Next's gated attention: q_proj gives q and a gate per head
    return {
        "wq_DNH": (D, N, gate * H),
        "wk_DKH": (D, K, H),
        "wv_DKH": (D, K, H),
        "wo_NHD": (N, H, D),
        "w_gate_DF": (D, F),
        "w_up_DF": (D, F),
        "w_down_FD": (F, D),
    }


def mla_shapes(m) -> dict[str, tuple[int, ...]]:
    """DeepSeek-V3's layer matrices per layer (models/deepseek3.py): MLA's projections (LoRA's targets) and the
    dense first layers' MLP (no adapters; quantised with MLA under QLoRA)."""
    D, N, R, C, F = m.d_model, m.num_heads, m.mla_q_rank, m.mla_kv_rank, m.mlp_dim
    Hn, P, Hv = m.mla_nope_dim, m.mla_rope_dim, m.mla_v_dim
    q = {"wq_a_DR": (D, R), "wq_b_RNH": (R, N, Hn + P)} if R else {"wq_DNH": (D, N, Hn + P)}
    mlp = {"w_gate_DF": (D, F), "w_up_DF": (D, F), "w_down_FD": (F, D)}
    return {**q, "wkv_a_DC": (D, C + P), "wkv_b_CNH": (C, N, Hn + Hv), "wo_NHD": (N, Hv, D), **mlp}


def gathered_names(names: tuple) -> tuple:
    """`names` with every dim the rules shard over a batch (data-parallel) axis left unsharded: what a
    matmul needs whole. Under no rules, unchanged."""
    rules = current_rules()
    if rules is None:
        return names
    data = set(rules.get("batch", ()))
    return tuple(None if n is not None and set(rules.get(n, ())) & data else n for n in names)
