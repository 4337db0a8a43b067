"""A run's outputs, opened once its input is valid: the lock taken, the config and tokenizer recorded, the
start-up lines said, the metrics writer; the checkpoint saver; the progress bar (after compiling)."""

from __future__ import annotations

import contextlib
from pathlib import Path

from jaxdist import checkpoint
from jaxdist import config as config_mod
from jaxdist.config import relative
from jaxdist.data import run_tokenizer
from jaxdist.observe import report, trackers
from jaxdist.training import rundir
from jaxdist.training.startup import Setup


def _quietly(close):
    def call():
        with contextlib.suppress(OSError):  # e.g. a full disk: the run's own error says so
            close()

    return call


def start_writing(
    s: Setup, run_dir: Path, lock: rundir.RunLock, closers, restored, resuming, restore, origin, start: int
):
    """Take the lock, record the config and tokenizer, say the start-up lines; -> the metrics writer."""
    # deferred: jax, optax load on first use, not when python -m jaxdist.train starts
    from jaxdist.observe import metrics
    from jaxdist.optim import adamw

    cfg, log, is_main = s.cfg, s.log, s.is_main
    if not checkpoint.all_agree(not is_main or lock.take(log)):
        raise lock.refused()
    run_dir.mkdir(parents=True, exist_ok=True)
    changes = restored.changes if restored is not None else {}
    if is_main:
        rundir.record_config(run_dir, config_mod.dump(cfg), start, changes)
        run_tokenizer.record(s.run_tok, run_dir)
        for line in [
            report.run_dir_line(run_dir, origin, restored, resuming, restore, cfg),
            *report.summary_lines(cfg, s.prog, s.flops_tok),
            *report.no_effect_lines(cfg, s.mesh.shape["pp"]),
            report.data_line(cfg, s.loader),
            *([f"warning: {s.no_eval}; evaluation is off"] if s.no_eval else []),
            report.units_line(cfg),
            report.peak_line(s.peak, s.peak_source),
            *report.artefact_lines(cfg, run_dir),
        ]:
            log(line)
        log(relative.cadence_line(cfg))
        for line in adamw.schedule_notes(cfg, start, changes):
            log(line)
    tracked = trackers.Trackers(cfg.train.trackers, run_dir, cfg.to_dict(), config_mod.dump(cfg)) if is_main else None
    writer = metrics.MetricWriter(run_dir, enabled=is_main, resume_step=start if resuming else None, trackers=tracked)
    closers.callback(_quietly(writer.close))
    return writer


def saver(s: Setup, run_dir: Path):
    return checkpoint.Saver(run_dir, s.cfg, log=s.log if s.is_main else lambda *a: None)


def local_devices(mesh):
    # deferred: jax loads on first use, not when python -m jaxdist.train starts
    import jax

    return [d for d in mesh.devices.flat if d.process_index == jax.process_index()]


def progress(s: Setup, writer, closers, saver, state, resumed, start: int):
    """The progress bar and per-step bookkeeping (`resumed`: the checkpoint it carries on from, or None);
    checkpoint messages go above the bar from now on."""
    # deferred: jax loads on first use, not when python -m jaxdist.train starts
    import jax

    from jaxdist.observe import metrics
    from jaxdist.observe.progress import Progress  # imports JAX: not before main() has its signal handlers

    local = local_devices(s.mesh)
    bar = Progress(
        s.cfg,
        writer,
        s.cfg.train.global_batch * s.cfg.model.seq_len,
        s.flops_tok,
        s.peak,
        start=start,
        enabled=s.is_main,
        skipped_in_a_row=int(jax.device_get(state.skipped)),
        memory=lambda: metrics.device_memory(local),
        log=s.log,
        carry=resumed.progress if resumed is not None else None,
    )
    closers.callback(bar.close)
    saver.log = bar.say  # checkpoint messages go above the progress bar, not into it
    return bar
