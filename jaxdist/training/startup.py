"""Set up a run before anything is written: every check on input, then the config resolved on the mesh,
the program and the data loader (`Run`'s set-up fields), so that bad input fails before the run folder is touched."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax

from jaxdist.config import Config, relative
from jaxdist.data import data_rules, prompt_stream, run_tokenizer
from jaxdist.data import loader as loader_mod
from jaxdist.distributed import mesh as mesh_mod
from jaxdist.errors import JaxdistError
from jaxdist.models import flops
from jaxdist.objectives import registry as objectives
from jaxdist.observe import metrics, plots, trackers
from jaxdist.training import rundir, step

if TYPE_CHECKING:
    from jaxdist.training.state import RunState


def with_resolved_mesh(cfg: Config, num_devices: int) -> Config:
    """`cfg` with `mesh.shape` as the sizes it resolves to on `num_devices` (fsdp=-1 -> fsdp=8)."""

    return cfg.replace(mesh=dict(shape=mesh_mod.format_mesh(mesh_mod.parse_mesh(cfg.mesh.shape, num_devices))))


def on_all_devices(cfg: Config) -> Config:
    """`cfg` with its mesh resolved on every device JAX sees (what --print-config shows)."""
    return with_resolved_mesh(cfg, jax.device_count())


def set_up(run: RunState) -> None:
    """Every check on input, then the config resolved on the mesh, the program and the data loader, and
    train.eval_tasks' evaluator: `run`'s set-up fields."""

    cfg, run_dir, log = run.cfg, run.run_dir, run.log
    rundir.check_storable(run_dir)
    cfg = data_rules.source_of_prepared(cfg, log)
    run.lock.check()  # another trainer on this run dir: refused before anything is read or written
    trackers.check_installed(cfg.train.trackers)  # a missing extra fails before any work
    run_tok = run_tokenizer.of_config(cfg)  # what the token ids mean, its files checked (recorded below)
    run_tokenizer.check_same(run_tok, run_dir)  # ... and what they meant to this run dir, if it recorded it
    # matplotlib loads now, so a SIGTERM only waits for drawing loss.png, not for imports. Not in a thread
    # beside the main thread's imports: concurrent compiles of modules hit CPython 3.11.7's AST recursion
    # counter race (gh-106905) and fail at random with "maximum recursion depth exceeded".
    if cfg.train.plot:
        plots.pyplot()
    run.mesh = mesh = mesh_mod.mesh_from_string(cfg.mesh.shape, dcn_text=cfg.mesh.dcn)
    cfg = with_resolved_mesh(cfg, mesh.size)  # config.yaml records the sizes used, not -1
    cfg = data_rules.resolve_token_dtype(cfg)  # ... and the token dtype read (a prepared folder's manifest decides)
    cfg = relative.resolve(cfg)  # ... and the steps that warm-up, eval and checkpoint fractions come to
    run.prog = step.build_program(cfg, mesh, eos_id=data_rules.mask_eos(cfg))  # the step reads no files
    run.run_tok = run_tok
    run.driver = None
    if objectives.rollouts(cfg):  # GRPO: prompt records, and the driver that samples, scores and trains
        run.loader = prompt_stream.PromptStream(cfg)
        if run.rollouts is None:
            raise JaxdistError(
                "objective.method=grpo needs its rollout driver: python -m jaxdist.train and jaxdist.run pass it; "
                "from jaxdist.training.loop.run, pass rollouts=jaxdist.inference.rollout.for_run"
            )
        run.cfg = cfg
        run.driver = run.rollouts(run)  # reward functions loaded and checked here, before writing
    else:
        run.loader = loader_mod.Loader(cfg, run.prog.batch_sharding)
    run.is_main = jax.process_index() == 0
    if not run.is_main:  # multi-process: only process 0 speaks
        run.log = lambda *a, **k: None
    if run.driver is not None:
        run.no_eval = None
        if cfg.train.eval_every and not run.loader.has_eval():
            run.no_eval = f"{cfg.data.path} holds no held-out prompts (val/); prepare with --val-fraction > 0"
    elif isinstance(run.loader, loader_mod.Loader):  # no driver: the data loader
        run.no_eval = loader_mod.no_eval_reason(cfg, run.loader)
    if run.no_eval:  # decided now, not at the first evaluation (said below the data line)
        cfg = cfg.replace(train=dict(eval_every=0))
    run.cfg = cfg
    run.flops_tok = flops.flops_per_token(cfg.model, cfg.lora)
    run.peak, run.peak_source = metrics.peak_flops(
        list(mesh.devices.flat), str(step.compute_dtype(cfg.model)), cfg.train.peak_flops
    )
    run.task_eval = None
    if cfg.train.eval_tasks and cfg.train.eval_every:  # checked (tasks known, mesh usable) before writing
        if run.tasks is None:
            raise JaxdistError(
                "train.eval_tasks needs the evaluation harness: python -m jaxdist.train passes it; from Python, "
                "pass tasks=jaxdist.evaluation.in_training.task_evaluator to jaxdist.run"
            )
        run.task_eval = run.tasks(run, run_dir)
