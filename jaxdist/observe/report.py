"""What the run says about itself at start-up and at the end, beyond the mesh and model lines: where each
artefact goes, what the data is, the loss unit and its uniform baseline, where the MFU peak comes from,
and device memory beside the planner's prediction for the same config.
"""

from __future__ import annotations

import math
from pathlib import Path

import jax

from jaxdist.adapters.lora import count_adapter_params
from jaxdist.config.run_sections import PipelineConfig
from jaxdist.data.run_tokenizer import byte_tokens
from jaxdist.distributed import offload
from jaxdist.distributed.mesh import format_mesh
from jaxdist.errors import JaxdistError
from jaxdist.models import registry
from jaxdist.models.resolve import compute_dtype
from jaxdist.observe import metrics
from jaxdist.observe.metrics import DEVICE_KINDS
from jaxdist.parallel import pipeline
from jaxdist.planner import hardware, memory
from jaxdist.planner.layout import Layout

MiB = 2**20


def run_dir_line(run_dir: Path, origin: str, restored, resuming: bool, restore: str | None, cfg) -> str:
    """Which run dir, how it was chosen, and whether this start resumed it (from which step)."""
    where = f"run dir {run_dir}" + (f" ({origin})" if origin else "")
    if resuming:
        return f"{where}: resuming from step {restored.step} ({restored.path})"
    if restored is not None:
        hf = (restore or "").startswith("hf:")  # restored from somewhere: restore names it
        params = hf or cfg.checkpoint.params_only
        what = "the parameters of" if params else f"step {restored.step} of"
        return f"{where}: new run, starting from {what} {restored.path if not hf else restore}"
    return f"{where}: new run, starting at step 0"


def artefact_lines(cfg, run_dir: Path) -> list[str]:
    r = Path(run_dir)
    where = [f"config {r / 'config.yaml'}", f"metrics {r / 'metrics.jsonl'}"]
    for name in cfg.train.trackers:
        where.append(
            {
                "tensorboard": f"events {r / 'tb'} (tensorboard --logdir {r / 'tb'})",
                "wandb": f"W&B files {r / 'wandb'}",
                "mlflow": f"MLflow run (MLFLOW_TRACKING_URI, else sqlite {r / 'mlflow.db'})",
            }[name]
        )
    ck = cfg.checkpoint
    where.append(
        f"checkpoints {r / 'checkpoints'} every {ck.every} steps, keep {ck.keep}"
        if ck.every
        else f"checkpoints {r / 'checkpoints'} off (checkpoint.every=0)"
    )
    where.append(f"loss plot {r / 'loss.png'} at the end (python -m jaxdist.plot {r})")
    if cfg.train.profile_steps:
        where.append(f"profile of steps {cfg.train.profile_steps} in {r / 'profile'}")
    return ["writes: " + "; ".join(where)]


def no_effect_lines(cfg, pp: int) -> list[str]:
    """Settings that change nothing on this mesh, said once at start-up (they were ignored silently)."""
    if pp == 1 and cfg.pipeline.schedule != PipelineConfig.schedule:  # set away from its default
        return [
            f"warning: pipeline.schedule={cfg.pipeline.schedule} has no effect at pp=1 (no pipeline on this mesh); "
            "give the mesh a pp axis > 1 to pipeline, or drop it"
        ]
    return []


def data_line(cfg, loader) -> str:
    """What is read (token shards only, the dtype actually read), tokens, windows, where evaluation reads,
    and how many passes over the training windows the run will make (with data.sources, per source)."""
    if loader.mixture is not None:
        return loader.mixture.line(cfg)
    if hasattr(loader, "line"):  # GRPO's prompt stream
        return loader.line(cfg)
    tokens = sum(len(a) for a in loader.train.source.arrays)
    train, held = len(loader.train), len(loader.held_out)
    read = cfg.train.steps * cfg.train.global_batch
    return (
        f"data: {loader.train.label}, {tokens:,} tokens; {train:,} train windows of {cfg.model.seq_len + 1} tokens "
        f"+ {held:,} held out ({loader.held_out.label}); {cfg.train.steps} steps x {cfg.train.global_batch} "
        f"windows = {read / max(train, 1):.3g} epochs"
    )


def units_line(cfg) -> str:
    v = cfg.model.vocab_size
    line = f"loss in nats/token; uniform baseline ln {v} = {math.log(v):.3f}"

    if byte_tokens(cfg):
        line += f" nats/token = {math.log(v) / math.log(2):.2f} bits/byte (byte tokens: bits/byte = nats / ln 2)"
    return line


def peak_line(peak: float | None, source: str) -> str:
    if not peak:
        return (
            f"throughput: achieved model FLOP/s (flops_per_sec), no MFU ({source}; set train.peak_flops "
            "per device for MFU)"
        )
    return f"throughput: MFU against {peak / 1e9:,.1f} GFLOP/s peak ({source}), and achieved FLOP/s"


def hardware_for(device):
    """The planner's hardware entry for this device, or None."""

    if device.platform == "cpu":
        return hardware.get("cpu")
    kind = device.device_kind.lower()
    return next((hardware.get(h) for k, h in DEVICE_KINDS.items() if k in kind), None)


def predicted_bytes(cfg, mesh) -> float | None:
    """The planner's per-device memory for this config on this mesh (None if it cannot model it)."""

    hw = hardware_for(mesh.devices.flat[0])
    if hw is None:
        return None
    try:
        return float(memory.estimate(Layout(cfg, {a: int(s) for a, s in mesh.shape.items()}, hw)).total)
    except (JaxdistError, KeyError, ValueError):
        return None


def memory_summary(compiled, predicted: float | None, device_memory: dict | None) -> dict:
    """Memory figures for metrics.jsonl's summary: the compiled step's, the device's, the planner's."""

    out = {}
    c = metrics.compiled_memory(compiled)
    if c:
        out["memory_compiled"] = c["total"]
        out["memory_compiled_arguments"] = c["arguments"]  # the state and batch the step receives
    if predicted:
        out["memory_predicted"] = predicted
    if device_memory:
        out.update(device_memory)
    return out


def memory_line(figures: dict) -> str:
    parts = []
    if "memory_peak" in figures:
        limit = figures.get("memory_limit")
        parts.append(
            f"device peak {figures['memory_peak'] / MiB:,.0f} MiB"
            + (f" of {limit / MiB:,.0f} MiB ({figures['memory_peak'] / limit:.0%})" if limit else "")
        )
    if "memory_compiled" in figures:
        parts.append(f"compiled step {figures['memory_compiled'] / MiB:,.1f} MiB")
    if "memory_predicted" in figures:
        parts.append(f"planner predicted {figures['memory_predicted'] / MiB:,.1f} MiB")
    return "memory per device: " + (", ".join(parts) if parts else "not available")


def compiled_line(compiled) -> str:

    c = metrics.compiled_memory(compiled)
    if not c:
        return "compiled step memory: not reported by this backend"
    host = c["host_arguments"] + c["host_outputs"] + c["host_temp"]
    return (
        f"compiled step per device: arguments {c['arguments'] / MiB:.1f} MiB, outputs {c['outputs'] / MiB:.1f}"
        f" MiB, temporaries {c['temp'] / MiB:.1f} MiB, donated {c['aliased'] / MiB:.1f} MiB "
        f"-> {c['total'] / MiB:.1f} MiB"
        + (f"; host memory: arguments {c['host_arguments'] / MiB:.1f} MiB (offloaded)" if host else "")
    )


def param_and_state_bytes(prog) -> tuple[int, int]:
    """Bytes per device of parameters and of optimizer state (the largest shard, from shardings)."""

    def per_device(abstract, shardings):
        total = 0
        for a, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)):
            total += math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize
        return total

    st, sh = prog.abstract_state, prog.state_shardings
    return per_device(st.params, sh.params), per_device(st.opt_state, sh.opt_state)


def reducer_state_bytes(prog) -> int:
    """Bytes per device of the gradient stage's state (DGC's momentum and residuals, error feedback...):
    under a per-replica method the optimizer's state lives there, not in `opt_state`."""

    leaves = zip(
        jax.tree.leaves(prog.abstract_state.reducer_state), jax.tree.leaves(prog.state_shardings.reducer_state)
    )
    return sum(math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize for a, s in leaves)


def summary_lines(cfg, prog, flops_tok: float) -> list[str]:

    p_bytes, o_bytes = param_and_state_bytes(prog)
    r_bytes = reducer_state_bytes(prog)
    reducer = f", gradient-stage state {r_bytes / 2**20:.1f} MiB ({prog.gradients.name})" if r_bytes else ""
    counts = registry.of(cfg.model).count_params(cfg.model)
    n = counts["total"]
    mesh = {a: int(s) for a, s in prog.mesh.shape.items()}
    active = (
        f" ({counts['active'] / 1e6:.2f}M active: {cfg.model.moe_experts} experts, top-"
        f"{cfg.model.moe_topk}, {cfg.model.moe_dispatch}; FLOPs and MFU count active)"
        if cfg.model.moe_experts
        else ""
    )
    lines = [
        f"mesh {format_mesh(mesh)} over {prog.mesh.size} {prog.mesh.devices.flat[0].platform} devices",
        f"model {n / 1e6:.2f}M params{active}; per device: params {p_bytes / 2**20:.1f} MiB, "
        f"optimizer {o_bytes / 2**20:.1f} MiB{reducer}; {flops_tok / 1e6:.1f} MFLOP/token",
        f"batch {cfg.train.global_batch} x {cfg.model.seq_len} tokens, {cfg.train.grad_accum_steps} micro-batch(es), "
        f"gradient stage {prog.gradients.name}, compute {compute_dtype(cfg.model)}",
    ]
    if cfg.lora.rank:
        lo, trained = cfg.lora, count_adapter_params(cfg.model, cfg.lora)
        lines.append(
            f"LoRA rank {lo.rank} (alpha {lo.alpha:g}{', rsLoRA' if lo.rslora else ''}) on {', '.join(lo.targets)}: {trained / 1e6:.2f}M trained "
            f"params ({100 * trained / n:.2f}% of the model); the base is frozen, stored as {lo.base_dtype}"
            + (f" in blocks of {lo.block_size}" if lo.base_dtype in ("int8", "nf4") else "")
        )
    cp = int(prog.mesh.shape.get("cp", 1))
    if cp > 1:
        lines.append(
            f"context parallel cp={cp} ({cfg.model.context_impl}): {cfg.model.seq_len // cp} tokens of each "
            f"sequence per device, load-balanced chunks of {cfg.model.seq_len // (2 * cp)}"
        )
    if prog.pipeline is not None:
        d = pipeline.describe(prog.pipeline)
        lines.append(
            f"pipeline {d['schedule']}: {d['stages']} stages x {d['repeats']} repeats, "
            f"{d['microbatches']} micro-batches, {d['iterations']} iterations, "
            f"bubble {d['bubble_fraction']:.1%}"
        )
    line = None
    if cfg.offload != type(cfg.offload)():
        line = offload_line(cfg, offload.host_transfers(prog))
    if line:
        lines.append(line)
    return lines


def offload_line(cfg, moved: dict | None) -> str | None:
    """What lives in host memory and the host<->device bytes per device the step moves (`moved`:
    jaxdist.distributed.offload.host_transfers, counted from the traced step)."""
    o = cfg.offload
    if (o.optimizer, o.params, o.activations) == ("none",) * 3:
        return None
    kinds = ", ".join(f"{kind}={getattr(o, kind)}" for kind in ("optimizer", "params", "activations"))
    if not moved:
        return f"offload: {kinds}"
    return (
        f"offload: {kinds}; per device per step {moved['host_to_device_bytes'] / 2**20:,.1f} MiB host->device, "
        f"{moved['device_to_host_bytes'] / 2**20:,.1f} MiB device->host ("
        + ("" if moved["trips_known"] else "at least: a move sits in a while loop; ")
        + "counted from the step's moves)"
    )
