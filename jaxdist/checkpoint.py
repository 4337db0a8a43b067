"""Checkpoints that never lose work: orbax `CheckpointManager` under `<run_dir>/checkpoints/<step>`.

One checkpoint holds four items:
  params  model parameters (their own item, so fine-tuning can load them alone)
  train   the rest of `TrainState`: step, optimizer state, reducer state (error feedback), skip counter
  data    the grain iterator state, one file per process
  meta    JSON: step, seed (the only randomness: init and data order derive from it), resolved config

Arrays come back on the *current* mesh: orbax is given abstract arrays carrying the target shardings,
so a run saved on fsdp=8 resumes on dp=2,fsdp=4 or on 4 devices.

Integrity, as orbax 0.12.8 implements it (checked in its source and in tests/test_checkpoint.py):
- a save writes `<step>.orbax-checkpoint-tmp` and renames it to `<step>` only after every process has
  committed; a save killed half-way leaves only the tmp folder, never listed as a step, and removed
  (`cleanup_tmp_directories`) when the next run opens the folder for writing;
- steps beyond `checkpoint.keep` are deleted by the same background thread, after that rename;
- `restore` walks back from the newest step when one fails to read, and says so.
"""

from __future__ import annotations

import dataclasses
import math
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from jaxdist.config import Config
from jaxdist.errors import JaxdistError
from jaxdist.parallel import reduce
from jaxdist.step import Program, TrainState

SUBDIR = "checkpoints"


def _handlers() -> dict:
    return {"params": ocp.StandardCheckpointHandler(), "train": ocp.StandardCheckpointHandler(),
            "data": grain.checkpoint.CheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}


def open_manager(directory: Path, keep: int = 1, async_save: bool = True,
                 read_only: bool = False) -> ocp.CheckpointManager:
    if read_only:  # only reads: no deletion, no tmp cleanup, nothing created
        # save_root_metadata=False: even read-only, orbax would enter a cross-process barrier, and the
        # processes that open a manager here need not be all of them (a folder another process just made).
        options = ocp.CheckpointManagerOptions(read_only=True, create=False, save_interval_steps=0,
                                               save_root_metadata=False)
    else:
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                               cleanup_tmp_directories=True)
    return ocp.CheckpointManager(Path(directory).resolve(), item_handlers=_handlers(), options=options)


def all_agree(ok: bool) -> bool:
    """True when `ok` holds on every process (decisions that change what all processes do next)."""
    if jax.process_count() == 1:
        return ok
    return bool(multihost_utils.process_allgather(np.int32(ok)).min())


# ---------------------------------------------------------------------------------------------- saving

def _train_part(state: TrainState) -> dict:
    return {"step": state.step, "opt_state": state.opt_state, "reducer_state": state.reducer_state,
            "skipped": state.skipped}


class Saver:
    """Writes the run's checkpoints: asynchronous (training continues while bytes are written)."""

    def __init__(self, run_dir: Path, cfg: Config, log: Callable = print):
        self.cfg, self.log = cfg, log
        self.directory = Path(run_dir) / SUBDIR
        self.manager = open_manager(self.directory, cfg.checkpoint.keep, cfg.checkpoint.async_save)
        self.pending: tuple[int, float, float] | None = None  # (step, start time, blocking seconds)
        self.timings: list[dict] = []  # per completed save: step, blocking_s, total_s
        self.last_saved: int | None = None

    def due(self, step: int, final: bool = False) -> bool:
        """Every `checkpoint.every` steps and at the end of the run (0 disables both)."""
        return self.cfg.checkpoint.every > 0 and (final or step % self.cfg.checkpoint.every == 0)

    def save(self, state: TrainState, step: int, loader) -> bool:
        """Save `state` (after `step` optimizer steps) with the data iterator positioned at `step`.
        A state whose last step was skipped as non-finite is not saved: the last good one stays."""
        if int(jax.device_get(state.skipped)):
            self.log(f"checkpoint step {step}: not saved (the step was non-finite); keeping the last good one")
            return False
        if step in self.manager.all_steps():  # e.g. the final save right after resuming from that step
            return False
        self.manager.wait_until_finished()  # one save in flight at a time (orbax would wait inside save)
        self.poll()
        start = time.perf_counter()
        meta = {"step": step, "seed": self.cfg.train.seed, "data_state": loader.get_state(),
                "config": self.cfg.to_dict()}
        self.manager.save(step, args=ocp.args.Composite(
            params=ocp.args.StandardSave(state.params), train=ocp.args.StandardSave(_train_part(state)),
            data=grain.checkpoint.CheckpointSave(loader.iterator), meta=ocp.args.JsonSave(meta)))
        blocking = time.perf_counter() - start
        self.pending, self.last_saved = (step, start, blocking), step
        self.log(f"checkpoint step {step}: writing in background ({blocking:.2f}s blocking)")
        return True

    def poll(self) -> None:
        """Report a background save that has completed (cheap: reads a flag)."""
        if self.pending is not None and not self.manager.is_saving_in_progress():
            self.manager.check_for_errors()
            step, start, blocking = self.pending
            total = time.perf_counter() - start
            self.timings.append({"step": step, "blocking_s": blocking, "total_s": total})
            self.log(f"checkpoint step {step} saved to {self.directory / str(step)} "
                     f"({blocking:.2f}s blocking, {total:.2f}s total)")
            self.pending = None

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.poll()
        self.manager.close()


# ------------------------------------------------------------------------------------------ restoring

@dataclasses.dataclass
class Restored:
    state: TrainState
    step: int  # optimizer steps already taken (0 for params_only)
    path: Path  # the step folder it came from
    seconds: float


def checkpoint_dir(path: Path) -> tuple[Path, int | None]:
    """A run dir, its `checkpoints/` folder, or one step folder -> (checkpoints folder, step or None)."""
    path = Path(path)
    if (path / SUBDIR).is_dir():
        return path / SUBDIR, None
    if path.name.isdigit() and (path / "_CHECKPOINT_METADATA").exists():
        return path.parent, int(path.name)
    return path, None


def has_checkpoints(path: Path) -> bool:
    directory, step = checkpoint_dir(path)
    return step is not None or (directory.is_dir() and bool(open_manager(directory, read_only=True).all_steps()))


def _abstract(tree, shardings):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


def _path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def check_model(saved_params, abstract_params, where: Path) -> None:
    """Same tensors with the same shapes, or an error naming the first tensor that differs."""
    saved = {_path_str(p): tuple(m.shape) for p, m in jax.tree_util.tree_flatten_with_path(saved_params)[0]}
    wanted = {_path_str(p): tuple(a.shape) for p, a in jax.tree_util.tree_flatten_with_path(abstract_params)[0]}
    fix = "use the model.* settings it was trained with, or a new --run-dir"
    for name, shape in wanted.items():
        if name not in saved:
            raise JaxdistError(f"checkpoint {where} is of a different model: it has no tensor params/{name}; {fix}")
        if saved[name] != shape and _restaged(saved[name], shape):
            raise JaxdistError(
                f"checkpoint {where} stores the layer stack in another pipeline layout: params/{name} is "
                f"{saved[name]} there but {shape} here; resume with the pp and pipeline.repeats it was saved "
                "with (moving a checkpoint across pipeline layouts is not supported yet)")
        if saved[name] != shape:
            raise JaxdistError(f"checkpoint {where} is of a different model: tensor params/{name} has shape "
                               f"{saved[name]} there but {shape} in this config; {fix}")
    extra = sorted(set(saved) - set(wanted))
    if extra:
        raise JaxdistError(f"checkpoint {where} is of a different model: it has tensor params/{extra[0]} that "
                           f"this config lacks; {fix}")


def _restaged(saved: tuple, wanted: tuple) -> bool:
    """The same layer stack laid out (layers, ...) vs (stage, layers/stage, ...), or staged differently."""
    def stack(shape):  # leading dims that hold layers: one, or two when staged
        return [shape[:1], shape[:2]]
    for a in stack(saved):
        for b in stack(wanted):
            if (a != b and math.prod(a) == math.prod(b) and saved[len(a):] == wanted[len(b):]):
                return True
    return False


def check_resume(meta: dict, cfg: Config, where: Path) -> None:
    """A full resume continues the same run: the same data order and a sequence length the weights support.

    RoPE has no position table, so the architecture accepts any length; the sequence length a model
    supports is the one it was trained at. Training longer sequences from these weights is a fine-tune
    (`checkpoint.params_only=true`), not a resume.
    """
    saved = meta.get("config", {})
    seq = saved.get("model", {}).get("seq_len", cfg.model.seq_len)
    if cfg.model.seq_len > seq:
        raise JaxdistError(
            f"model.seq_len={cfg.model.seq_len} is longer than the {seq} tokens the checkpoint {where} was "
            f"trained on; resume with model.seq_len={seq}, or fine-tune longer sequences with "
            f"--restore {where} checkpoint.params_only=true in a new --run-dir")
    if meta.get("seed", cfg.train.seed) != cfg.train.seed:
        raise JaxdistError(
            f"train.seed={cfg.train.seed} differs from the seed {meta['seed']} of checkpoint {where}, which "
            f"fixes the data order; drop the override (or start a new --run-dir)")


def _restore_step(manager, directory: Path, step: int, prog: Program, loader, cfg: Config,
                  params_only: bool) -> TrainState:
    where = directory / str(step)
    metadata = manager.item_metadata(step)
    check_model(metadata["params"], prog.abstract_state.params, where)
    if not params_only and metadata.get("train") is None:
        raise JaxdistError(f"checkpoint {where} holds parameters only (e.g. imported from Hugging Face); start "
                           f"from it with --restore {where} checkpoint.params_only=true and a new --run-dir")
    meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    if not params_only:
        check_resume(meta, cfg, where)
        reduce.check_replica_count(metadata, prog.abstract_state.reducer_state, cfg, where)
    abstract = _abstract(prog.abstract_state, prog.state_shardings)
    items = {"params": ocp.args.StandardRestore(abstract.params)}
    if not params_only:
        items["train"] = ocp.args.StandardRestore(_train_part(abstract))
    restored = manager.restore(step, args=ocp.args.Composite(**items))
    if params_only:
        fresh = prog.init_state(cfg.train.seed)  # new optimizer, step 0: fine-tuning starts here
        return dataclasses.replace(fresh, params=restored["params"])
    try:  # this process's iterator file; absent when the process count changed
        manager.restore(step, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(loader.iterator)))
    except ValueError:
        loader.set_state(meta["data_state"])  # batches are step-indexed: the same for every process
    return TrainState(params=restored["params"], **restored["train"])


def restore(path: Path, prog: Program, loader, cfg: Config, params_only: bool = False,
            log: Callable = print) -> Restored:
    """Restore the newest readable checkpoint under `path` onto `prog`'s mesh (and `loader`'s position).

    An unreadable newest checkpoint is reported and the previous one used; a different model is an error.
    """
    directory, only_step = checkpoint_dir(path)
    if not directory.is_dir():
        raise JaxdistError(f"checkpoint path {path} does not exist; pass a run dir or its checkpoints/<step>")
    manager = open_manager(directory, read_only=True)
    steps = [only_step] if only_step is not None else sorted(manager.all_steps(), reverse=True)
    if not steps:
        raise JaxdistError(f"{path} holds no checkpoint; pass a run dir (or checkpoints/<step>) written by "
                           "jaxdist.train")
    failures = []
    for step in steps:
        start = time.perf_counter()
        try:
            state, error = _restore_step(manager, directory, step, prog, loader, cfg, params_only), None
        except JaxdistError:
            raise
        except Exception as e:  # noqa: BLE001 — any read failure means "try the previous checkpoint"
            state, error = None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        if all_agree(error is None):
            return Restored(state, 0 if params_only else step, directory / str(step), time.perf_counter() - start)
        error = error or "failed on another process"
        failures.append(f"step {step}: {error}")
        log(f"warning: checkpoint {directory / str(step)} could not be restored ({error}); "
            "trying the previous one")
    raise JaxdistError(f"no checkpoint under {directory} could be restored ({failures[0]}); "
                       "pass a checkpoint written by jaxdist.train, or move the unreadable ones away")


def load_params(step_dir: Path) -> dict:
    """The parameters of one checkpoint (`<run>/checkpoints/<step>`) as host numpy arrays, any device count."""
    step_dir = Path(step_dir)
    manager = open_manager(step_dir.parent, read_only=True)
    step = int(step_dir.name)
    target = jax.tree.map(lambda m: np.zeros(m.shape, m.dtype), manager.item_metadata(step)["params"])
    return manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(target)))["params"]


def set_aside_newer(run_dir: Path, step: int, log: Callable = print) -> None:
    """Newer steps than the one resumed from were unreadable: rename them (never delete) so the resumed
    run can save those step numbers again."""
    directory = Path(run_dir) / SUBDIR
    if jax.process_index() == 0:
        for newer in open_manager(directory, read_only=True).all_steps():
            if newer > step:
                target = directory / f"unreadable-{newer}-{time.strftime('%Y%m%d-%H%M%S')}"
                (directory / str(newer)).rename(target)
                log(f"moved unreadable checkpoint {directory / str(newer)} to {target}")
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("jaxdist:set_aside_newer")


def saved_config(run_dir: Path) -> dict | None:
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        return None
    import yaml
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError:
        return None


def check_run_dir_model(run_dir: Path, cfg: Config) -> None:
    """A run dir without checkpoints but with another model's config.yaml is not ours to overwrite."""
    saved = (saved_config(run_dir) or {}).get("model")
    if not isinstance(saved, dict):
        return
    now = cfg.to_dict()["model"]
    shape_keys = ("num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim", "mlp_dim", "vocab_size",
                  "tie_embeddings")
    for key in shape_keys:
        if key in saved and saved[key] != now[key]:
            raise JaxdistError(f"run dir {run_dir} holds a run of a different model (model.{key}={saved[key]} "
                               f"there, {now[key]} here); choose a new --run-dir")


# ----------------------------------------------------------------------------------------- preemption

class StopSignal:
    """SIGTERM / SIGINT: finish the current step, save, exit 0. A second SIGINT aborts at once.

    `requested()` is what the loop checks after each step; with several processes it is agreed on
    (one tiny all-gather), so every process saves at the same step.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: str | None = None
        self._previous: dict = {}

    def __enter__(self) -> "StopSignal":
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _handle(self, signum, frame) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # second Ctrl-C: abort without saving
        self.received = signal.Signals(signum).name
        print(f"{self.received} received: finishing the current step and saving a checkpoint "
              "(Ctrl-C again aborts)", file=sys.stderr, flush=True)

    def requested(self) -> bool:
        flag = self.received is not None
        if jax.process_count() > 1:
            flag = not all_agree(not flag)
        return flag
