"""A run's outputs, opened once its input is valid: the lock taken, the config and tokenizer recorded, the
start-up lines said, the metrics writer; the checkpoint saver; the progress bar (after compiling)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import jax
from jax.sharding import Mesh

from jaxdist import checkpoint
from jaxdist import config as config_mod
from jaxdist.config import relative
from jaxdist.data import run_tokenizer
from jaxdist.observe import metrics, report, trackers
from jaxdist.observe.progress import Progress
from jaxdist.optim import adamw
from jaxdist.training import rundir

if TYPE_CHECKING:
    from jaxdist.training.state import RunState


def _quietly(close):
    def call():
        with contextlib.suppress(OSError):  # e.g. a full disk: the run's own error says so
            close()

    return call


def start_writing(run: RunState) -> None:
    """Take the lock, record the config and tokenizer, say the start-up lines; the metrics writer."""

    cfg, log, is_main, run_dir, restored, start = run.cfg, run.log, run.is_main, run.run_dir, run.restored, run.start
    if not checkpoint.all_agree(not is_main or run.lock.take(log)):
        raise run.lock.refused()
    run_dir.mkdir(parents=True, exist_ok=True)
    changes = restored.changes if restored is not None else {}
    if is_main:
        rundir.record_config(run_dir, config_mod.dump(cfg), start, changes)
        run_tokenizer.record(run.run_tok, run_dir)
        for line in [
            report.run_dir_line(run_dir, run.origin, restored, run.resuming, run.restore, cfg),
            *report.summary_lines(cfg, run.prog, run.flops_tok),
            *report.no_effect_lines(cfg, run.mesh.shape["pp"]),
            report.data_line(cfg, run.loader),
            *([f"warning: {run.no_eval}; evaluation is off"] if run.no_eval else []),
            report.units_line(cfg),
            report.peak_line(run.peak, run.peak_source),
            *report.artefact_lines(cfg, run_dir),
        ]:
            log(line)
        log(relative.cadence_line(cfg))
        for line in adamw.schedule_notes(cfg, start, changes):
            log(line)
    tracked = trackers.Trackers(cfg.train.trackers, run_dir, cfg.to_dict(), config_mod.dump(cfg)) if is_main else None
    resume_step = start if run.resuming else None
    run.writer = metrics.MetricWriter(run_dir, enabled=is_main, resume_step=resume_step, trackers=tracked)
    run.closers.callback(_quietly(run.writer.close))


def saver(run: RunState) -> checkpoint.Saver:
    return checkpoint.Saver(run.run_dir, run.cfg, log=run.log if run.is_main else lambda *a: None)


def local_devices(mesh: Mesh) -> list:

    return [d for d in mesh.devices.flat if d.process_index == jax.process_index()]


def progress(run: RunState) -> None:
    """The progress bar and per-step bookkeeping (carried on from the checkpoint it resumes, if any);
    checkpoint messages go above the bar from now on."""

    local = local_devices(run.mesh)
    resumed = run.restored if run.resuming else None
    bar = Progress(
        run.cfg,
        run.writer,
        run.cfg.train.global_batch * run.cfg.model.seq_len,
        run.flops_tok,
        run.peak,
        start=run.start,
        enabled=run.is_main,
        skipped_in_a_row=int(jax.device_get(run.state.skipped)),
        memory=lambda: metrics.device_memory(local),
        log=run.log,
        carry=resumed.progress if resumed is not None else None,
    )
    run.closers.callback(bar.close)
    run.saver.log = bar.say  # checkpoint messages go above the progress bar, not into it
    run.progress = bar
