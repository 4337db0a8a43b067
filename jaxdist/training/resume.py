"""Where a run starts from: this run dir's latest checkpoint, else another run's (`--restore`), else a
Hugging Face model's weights (`hf:DIR`, a fresh optimizer), else nothing; and, once the run writes, what
restoring leaves behind (newer checkpoints set aside, the Hugging Face source kept) and the line that says it."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from jaxdist import checkpoint
from jaxdist.config import Config
from jaxdist.errors import JaxdistError
from jaxdist.hf import export, tensors
from jaxdist.objectives import registry as objectives
from jaxdist.training.step import Program, TrainState

if TYPE_CHECKING:
    from jaxdist.training.state import RunState


def start_from(run: RunState) -> None:
    """`run`'s restore fields (resuming, from_hf, restored or None, start): this run dir's latest checkpoint,
    else `run.restore` (another run's checkpoint, or hf:DIR for a Hugging Face model's weights with a fresh
    optimizer), else nothing."""
    cfg, run_dir, prog, restore, log = run.cfg, run.run_dir, run.prog, run.restore, run.log
    resuming = checkpoint.has_checkpoints(run_dir / checkpoint.SUBDIR)
    if not resuming:
        checkpoint.check_run_dir_model(run_dir, cfg)
    restored = None
    from_hf = bool(restore and restore.startswith("hf:")) and not resuming
    if from_hf and restore is not None:  # fine-tune a Hugging Face checkpoint: its weights, a fresh optimizer
        restored = tensors.restore_for_training(restore[3:], prog, cfg)
    elif resuming or restore:
        if restore and not resuming and not cfg.checkpoint.params_only and not objectives.is_default(cfg):
            raise JaxdistError(
                f"objective.method={cfg.objective.method} starts from a model's weights with a fresh optimizer: "
                f"add checkpoint.params_only=true to --restore {restore}"
            )
        if resuming and restore and run.is_main:
            log(f"{run_dir} has its own checkpoints: resuming them (--restore {restore} ignored)")
        restored = checkpoint.restore(
            run_dir if resuming or restore is None else Path(restore),  # not resuming: restore is set
            prog,
            run.loader,
            cfg,
            params_only=cfg.checkpoint.params_only and not resuming,
            log=log,
            allowed=run.allowed,
            drift=resuming,
        )
    if restored is not None and not resuming and not from_hf:
        restored.state = with_reference(cfg, prog, restored.state)
    run.resuming, run.from_hf, run.restored = resuming, from_hf, restored
    run.start = restored.step if restored else 0


def with_reference(cfg: Config, prog: Program, state: TrainState) -> TrainState:
    """A restored model's state whose frozen reference (a preference objective without LoRA keeps a copy of
    the parameters in the stage's state) is those parameters, not the fresh initialisation's."""

    if not objectives.keeps_reference_copy(cfg):
        return state
    copy = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=prog.state_shardings.reducer_state)
    with prog.activate():
        return dataclasses.replace(state, reducer_state=copy(state.params))


def after_restore(run: RunState) -> None:
    """Once writing: newer checkpoints set aside, a Hugging Face source kept, the line that says what was
    restored."""
    restored, resuming, from_hf, run_dir = run.restored, run.resuming, run.from_hf, run.run_dir
    assert restored is not None
    if resuming:
        checkpoint.set_aside_newer(run_dir, restored.step, run.log)
    if from_hf and run.is_main:
        export.keep_source(restored.path, run_dir)  # token ids and tokenizer for a later export
    what = "parameters" if (run.cfg.checkpoint.params_only or from_hf) and not resuming else f"step {run.start}"
    run.log(f"restored {what} from {restored.path} in {restored.seconds:.1f}s")
