"""The model registry: an architecture is a module plus one `Architecture` entry here, and everyone
that needs the model (the step, the pipeline, the planner, LoRA, generation, Hugging Face import and
export, FLOPs and parameter counts) asks `of(model_config)` instead of importing a class.

An entry names, as torchtitan's `ModelSpec` does for its models:
- `families`: the `model.family` values it computes, each with its Hugging Face mapping (`hf`,
  `models/hf_spec.Family`: config.json fields in and out) and `hf_layer` (one layer's tensor names);
- `fields`: the `ModelConfig` fields only it reads (another architecture's must keep their defaults,
  and they stay out of a run's default name, so adding an architecture renames no run);
- `module`: where its NNX code lives, a module that defines `Model` (the model), `Block` (one dense
  layer, which the planner traces) and `count_params`, and, where the stack mixes layer kinds,
  `other_layers` (the kinds beside `Block` the planner traces too, `Architecture.other_layers`); it is
  imported on first use, so reading the registry (the commands' start, config.json mapping) loads no JAX;
- `axes`: the logical axis names its parameters carry (the default rules place them; no placement code);
- `count_params` and `attention_flops`: the parameter count and the attention term of FLOPs per token
  (`models/flops.py` adds 6 per matmul parameter);
- `refused_axes`: the mesh axes its layers cannot meet, each with why; `tabled_pp`: why a table pipeline
  schedule (1F1B and its kin) cannot run a config of it, empty when one can; `check`: its other refusals of a whole
  config, one line each. `validate` applies all three (the trainer's start and the planner's candidates).
- `dense_experts` and `dense_first`: how its MoE layers meet the tokens, for the planner (`jaxdist/planner/`):
  every token through every expert, no dispatch (gpt-oss), and how many first layers have a dense MLP
  instead of experts (DeepSeek-V3's `dense_layers`, a stack of their own);
- `lora`: what LoRA adapts in its layers (`adapters.layout.LoraLayout`: MLA or q/k/v/o, its routed experts
  and how, a dense first stack), handed to the adapters, a layer below, as this module loads;
- `planner_gap`: what the planner (`jaxdist/planner/`) does not model for it, its measured miss in
  docs/planner.md; `python -m jaxdist.plan` prints it beside its figures (empty: modelled and checked).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable

from jaxdist.adapters import layout
from jaxdist.adapters.layout import LoraLayout
from jaxdist.config import ModelConfig
from jaxdist.errors import JaxdistError
from jaxdist.models import decoder_hf, deepseek3_hf, deepseek3_rules, gemma3_hf, gpt_oss_hf, qwen3next_hf

# Logical axes a parameter may carry (docs/architecture.md's conventions; `lora_rank` is the adapters').
COMMON_AXES = frozenset({"layers", "embed", "vocab", "heads", "kv_heads", "head_dim", "mlp", "norm"})


def _no_check(cfg, sizes: dict) -> None:
    return None


@dataclasses.dataclass(frozen=True)
class Architecture:
    name: str
    hf: tuple  # its Hugging Face families (hf_spec.Family), one per model.family value
    fields: tuple[str, ...]  # ModelConfig fields only this architecture reads
    module: str  # defines Model, Block and count_params (below)
    axes: frozenset  # logical axis names of its parameters
    hf_layer: Callable  # (ModelConfig, sparse) -> [(path in the unit, HF name with {i}/{e}, n_in, per expert)]
    attention_flops: Callable  # ModelConfig -> attention FLOPs per token, forward + backward
    check: Callable = _no_check  # (Config, mesh axis sizes) -> None, or a one-line JaxdistError
    refused_axes: tuple[tuple[str, str], ...] = ()  # (mesh axis, why its layers cannot meet it)
    tabled_pp: Callable | None = None  # ModelConfig -> why a table pipeline schedule cannot run it ("" if one can)
    # every token through every expert (no token dispatch): XLA gathers the experts whole, exchanges no tokens
    dense_experts: bool = False
    dense_first: Callable | None = None  # ModelConfig -> its first layers with a dense MLP; None: moe_every's
    planner_gap: str = ""  # what the planner does not model for it (plan prints it); "" when it does
    hf_tensors: Callable | None = None  # ModelConfig -> every tensor (hf.mapping.Tensor fields); None: from hf_layer
    # (ModelConfig, params, expert loads (L, E)) -> params: a non-gradient update after the optimizer's
    after_step: Callable | None = None
    lora: LoraLayout = LoraLayout()  # what lora.targets adapt in its layers (adapters/layout.py)

    def validate(self, cfg, sizes: dict) -> None:
        """Every refusal of (config, mesh axis sizes) this architecture makes, as a one-line JaxdistError."""
        fam = cfg.model.family
        for axis, why in self.refused_axes:
            if sizes.get(axis, 1) > 1:
                raise JaxdistError(
                    f"mesh {axis}={sizes[axis]} is not supported by model.family={fam} ({why}); use {axis}=1"
                )
        why = self.tabled_pp(cfg.model) if self.tabled_pp else ""
        if why and sizes.get("pp", 1) > 1:
            # deferred: the registry is read at the commands' start, and the schedule registry imports jax
            from jaxdist.parallel import schedule_registry

            if schedule_registry.get(cfg.pipeline.schedule).tabled:
                raise JaxdistError(
                    f"pipeline.schedule={cfg.pipeline.schedule} does not run model.family={fam}: {why} "
                    f"(gpipe and circular do); set pipeline.schedule=gpipe"
                )
        self.check(cfg, sizes)

    def moe_layers(self, m: ModelConfig) -> int:
        """How many of `m`'s layers hold experts: all but `dense_first`'s, or every `moe_every`-th."""
        if not m.moe_experts:
            return 0
        return m.num_layers - self.dense_first(m) if self.dense_first else m.num_layers // m.moe_every

    @property
    def families(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.hf)

    @property
    def model(self) -> Callable:
        """(ModelConfig, nnx.Rngs, compute_dtype=, lora=) -> the NNX model."""
        return importlib.import_module(self.module).Model

    @property
    def block(self) -> Callable:
        """(ModelConfig, nnx.Rngs) -> one dense layer, called as layer(x_BTD, positions_T)."""
        return importlib.import_module(self.module).Block

    @property
    def other_layers(self) -> Callable | None:
        """(ModelConfig, tp) -> ((layer factory (ModelConfig, nnx.Rngs) -> layer, share of the stack's
        layers, trace-length multiple), ...): the layer kinds beside `Block` (Qwen3-Next's gated DeltaNet)
        whose residuals the planner traces in place of a `Block`'s (jaxdist.planner.residuals.other_per_token);
        None where every layer is a `Block`."""
        return getattr(importlib.import_module(self.module), "other_layers", None)

    @property
    def count_params(self) -> Callable:
        """ModelConfig -> {embed, layers, head, final_norm, total, active}: exact, from the config alone."""
        return importlib.import_module(self.module).count_params


def _decoder_attention_flops(m: ModelConfig) -> float:
    """PaLM appendix B: 12·L·T·(heads·head_dim), forward + backward, the causal mask not halved."""
    return 12 * m.num_layers * m.seq_len * m.num_heads * m.head_dim


def _decoder_check(cfg, sizes: dict) -> None:
    """The decoder's MoE layers (parallel/moe.py's dispatch) take no LoRA."""
    if cfg.lora.rank and cfg.model.moe_experts:
        raise JaxdistError(
            "lora.rank > 0 with model.moe_experts > 0: LoRA on the decoder's mixture-of-experts layers is not "
            "supported yet; use a dense model or lora.rank=0"
        )


DECODER = Architecture(
    name="decoder",
    hf=decoder_hf.FAMILIES,
    fields=(),  # the switches (qkv_bias, qk_norm, sliding_window, moe_*) are shared fields
    module="jaxdist.models.llama",
    axes=COMMON_AXES | {"expert"},
    hf_layer=decoder_hf.layer_tensors,
    attention_flops=_decoder_attention_flops,
    check=_decoder_check,
)


def _gemma3_attention_flops(m: ModelConfig) -> float:
    """The decoder's term per layer, a windowed layer counting min(T, W) keys per query."""
    full = [m.sliding_window_pattern > 0 and (i + 1) % m.sliding_window_pattern == 0 for i in range(m.num_layers)]
    keys = sum(m.seq_len if f or not m.sliding_window else min(m.seq_len, m.sliding_window) for f in full)
    return 12 * keys * m.num_heads * m.head_dim


def _gemma3_check(cfg, sizes: dict) -> None:
    """The decoder's switches have no Gemma form."""
    m = cfg.model
    for field, ok in (("qkv_bias", False), ("moe_experts", 0), ("embed_scale", 1.0)):
        if getattr(m, field) != ok:
            raise JaxdistError(
                f"model.{field}={getattr(m, field)!r} has no Gemma 3 form (model.family=gemma3); remove it"
            )


GEMMA3 = Architecture(
    name="gemma3",
    hf=(gemma3_hf.FAMILY,),
    fields=("sliding_window_pattern", "rope_local_theta", "query_pre_attn_scalar"),
    module="jaxdist.models.gemma3",
    axes=COMMON_AXES,
    hf_layer=gemma3_hf.layer_tensors,
    attention_flops=_gemma3_attention_flops,
    check=_gemma3_check,
    refused_axes=(("cp", "context parallelism has no per-layer window yet"),),
    tabled_pp=gemma3_hf.tabled_pp,
)


DEEPSEEK_V3 = Architecture(
    name="deepseek_v3",
    hf=(deepseek3_hf.FAMILY,),
    fields=(
        "mla_q_rank",
        "mla_kv_rank",
        "mla_nope_dim",
        "mla_rope_dim",
        "mla_v_dim",
        "rope_interleave",
        "dense_layers",
        "moe_groups",
        "moe_topk_groups",
        "moe_routed_scale",
        "moe_bias_rate",
        "rope_mscale",
        "rope_mscale_all_dim",
    ),  # fmt: skip
    module="jaxdist.models.deepseek3",
    axes=COMMON_AXES | {"expert"},
    hf_layer=deepseek3_hf.layer_tensors,
    attention_flops=deepseek3_rules.attention_flops,
    check=deepseek3_rules.check,
    refused_axes=(("cp", "MLA has no context-parallel attention"),),
    tabled_pp=deepseek3_rules.tabled_pp,
    dense_first=deepseek3_rules.dense_count,
    hf_tensors=deepseek3_hf.tensors,
    after_step=deepseek3_rules.after_step,
    lora=LoraLayout(
        experts="split",
        mla=True,
        dense_stack=True,
        why="DeepSeek-V3 adapts MLA's q_a, q_b (q without a q rank), kv_a, kv_b and o, and with gate/up/down its "
        "routed experts",
    ),
)

GPT_OSS = Architecture(
    name="gpt_oss",
    hf=(gpt_oss_hf.FAMILY,),
    fields=("rope_beta_fast", "rope_beta_slow", "rope_truncate", "swiglu_alpha", "swiglu_limit"),
    module="jaxdist.models.gpt_oss",
    axes=COMMON_AXES | {"expert"},
    hf_layer=gpt_oss_hf.layer_tensors,
    attention_flops=gpt_oss_hf.attention_flops,
    check=gpt_oss_hf.check,
    refused_axes=(("cp", "context parallelism has no attention sinks"),),
    tabled_pp=gpt_oss_hf.tabled_pp,
    dense_experts=True,
    hf_tensors=gpt_oss_hf.tensors,
    lora=LoraLayout(
        experts="fused",
        why="gpt-oss adapts q, k, v, o and with gate/up/down its experts' fused gate_up_proj and down_proj",
    ),
)

QWEN3_NEXT = Architecture(
    name="qwen3_next",
    hf=(qwen3next_hf.FAMILY,),
    fields=(
        "linear_key_heads",
        "linear_value_heads",
        "linear_key_dim",
        "linear_value_dim",
        "linear_conv_kernel",
        "full_attention_interval",
        "rope_fraction",
        "moe_shared_dim",
    ),  # fmt: skip
    module="jaxdist.models.qwen3next",
    axes=COMMON_AXES | {"expert"},
    hf_layer=qwen3next_hf.layer_tensors,
    attention_flops=qwen3next_hf.attention_flops,
    check=qwen3next_hf.check,
    refused_axes=(("cp", "the linear-attention recurrence runs over the whole sequence on one device"),),
    hf_tensors=qwen3next_hf.tensors,
    lora=LoraLayout(grouped=True),
)

ARCHITECTURES = {a.name: a for a in (DECODER, GEMMA3, DEEPSEEK_V3, GPT_OSS, QWEN3_NEXT)}
BY_FAMILY = {f: a for a in ARCHITECTURES.values() for f in a.families}
FAMILIES = {f.name: f for a in ARCHITECTURES.values() for f in a.hf}  # model.family -> hf_spec.Family
OWNED = {field: a.name for a in ARCHITECTURES.values() for field in a.fields}
layout.declare({f: a.lora for a in ARCHITECTURES.values() for f in a.families})


def of(m: ModelConfig) -> Architecture:
    """The architecture `m.family` is computed by; a field of another architecture set away from its
    default is a one-line error (it would be silently ignored)."""
    if m.family not in BY_FAMILY:
        raise JaxdistError(f"model.family={m.family!r} is not registered; choose one of {', '.join(BY_FAMILY)}")
    arch = BY_FAMILY[m.family]
    default = ModelConfig()
    for field, owner in OWNED.items():
        if owner != arch.name and getattr(m, field) != getattr(default, field):
            fams = ", ".join(ARCHITECTURES[owner].families)
            raise JaxdistError(
                f"model.{field}={getattr(m, field)!r} is read only by model.family {fams}, not {m.family}; "
                f"remove it or set model.family"
            )
    return arch


def inert_fields(m: ModelConfig) -> set[str]:
    """The fields other architectures own (at their defaults for `m`): not part of what `m` computes."""
    return {field for field, owner in OWNED.items() if owner != BY_FAMILY[m.family].name}
