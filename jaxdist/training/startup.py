"""Set up a run before anything is written: every check on input, then the config resolved on the mesh,
the program and the data loader (`Setup`), so that bad input fails before the run folder is touched."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jaxdist.config import relative
from jaxdist.data import run_tokenizer
from jaxdist.observe import plots, trackers
from jaxdist.training import rundir


def with_resolved_mesh(cfg, num_devices: int):
    """`cfg` with `mesh.shape` as the sizes it resolves to on `num_devices` (fsdp=-1 -> fsdp=8)."""
    # deferred: jax loads on first use, not when python -m jaxdist.train starts
    from jaxdist.distributed import mesh as mesh_mod

    return cfg.replace(mesh=dict(shape=mesh_mod.format_mesh(mesh_mod.parse_mesh(cfg.mesh.shape, num_devices))))


@dataclasses.dataclass
class Setup:
    """What set-up decides before anything is written: the resolved config, the mesh, the program, the data."""

    cfg: Any
    mesh: Any
    prog: Any
    loader: Any
    run_tok: Any  # run_tokenizer.RunTokenizer: what the token ids mean (recorded once writing starts)
    is_main: bool
    log: Callable
    no_eval: str | None  # why evaluation is off, decided now (said below the data line)
    flops_tok: float
    peak: float | None
    peak_source: str


def set_up(cfg, run_dir: Path, log, lock: rundir.RunLock) -> Setup:
    """Every check on input, then the config resolved on the mesh, the program and the data loader."""
    # deferred: flax, grain, jax, optax load on first use, not when python -m jaxdist.train starts
    import jax

    from jaxdist.data import loader as loader_mod
    from jaxdist.distributed import mesh as mesh_mod
    from jaxdist.models import flops
    from jaxdist.observe import metrics
    from jaxdist.training import step

    rundir.check_storable(run_dir)
    cfg = loader_mod.source_of_prepared(cfg, log)
    lock.check()  # another trainer on this run dir: refused before anything is read or written
    trackers.check_installed(cfg.train.trackers)  # a missing extra fails before any work
    run_tok = run_tokenizer.of_config(cfg)  # what the token ids mean, its files checked (recorded below)
    run_tokenizer.check_same(run_tok, run_dir)  # ... and what they meant to this run dir, if it recorded it
    # matplotlib loads now, so a SIGTERM only waits for drawing loss.png, not for imports. Not in a thread
    # beside the main thread's imports: concurrent compiles of modules hit CPython 3.11.7's AST recursion
    # counter race (gh-106905) and fail at random with "maximum recursion depth exceeded".
    plots.pyplot()
    mesh = mesh_mod.mesh_from_string(cfg.mesh.shape, dcn_text=cfg.mesh.dcn)
    cfg = with_resolved_mesh(cfg, mesh.size)  # config.yaml records the sizes used, not -1
    cfg = loader_mod.resolve_token_dtype(cfg)  # ... and the token dtype read (a prepared folder's manifest decides)
    cfg = relative.resolve(cfg)  # ... and the steps that warm-up, eval and checkpoint fractions come to
    prog = step.build_program(cfg, mesh, eos_id=loader_mod.mask_eos(cfg))  # the step reads no files
    loader = loader_mod.Loader(cfg, prog.batch_sharding)
    is_main = jax.process_index() == 0
    log = log if is_main else (lambda *a, **k: None)  # multi-process: only process 0 speaks
    no_eval = loader_mod.no_eval_reason(cfg, loader)
    if no_eval:  # decided now, not at the first evaluation (said below the data line)
        cfg = cfg.replace(train=dict(eval_every=0))
    flops_tok = flops.flops_per_token(cfg.model, cfg.lora)
    peak, peak_source = metrics.peak_flops(
        list(mesh.devices.flat), str(step.compute_dtype(cfg.model)), cfg.train.peak_flops
    )
    return Setup(cfg, mesh, prog, loader, run_tok, is_main, log, no_eval, flops_tok, peak, peak_source)
