"""Checkpoints that never lose work: orbax `CheckpointManager` under `<run_dir>/checkpoints/<step>`.

One checkpoint holds four items:
  params  model parameters (their own item, so fine-tuning can load them alone)
  train   the rest of `TrainState`: step, optimizer state, reducer state (error feedback), skip counter
  data    the grain iterator state, one file per process
  meta    JSON: step, seed (the only randomness: init and data order derive from it), resolved config
and `jaxdist-checksums.json`, the size and hash of every file, published together with them.

One module per job:
  storage    the orbax manager and where checkpoints live
  saving     asynchronous saves, reported once published; a failed save stops the run in one line
  integrity  checksums written before a step is published, verified on restore
  restoring  newest intact checkpoint onto the current mesh, falling back to older ones
  compat     which checkpoint may continue which run (model, seed, config drift, state layout)
  setaside   unreadable checkpoints renamed, never deleted
  agree      multi-host agreement on decisions
  run_params a run's parameters alone, read onto a mesh (what export and generation start from)

Integrity, as orbax 0.12.8 implements it (checked in its source and in tests/test_checkpoint.py):
- a save writes `<step>.orbax-checkpoint-tmp` and renames it to `<step>` only after every process has
  committed; a save killed half-way leaves only the tmp folder, never listed as a step, and removed
  (`cleanup_tmp_directories`) when the next run opens the folder for writing;
- steps beyond `checkpoint.keep` are deleted by the same background thread, after that rename.
"""

from jaxdist.checkpoint.agree import all_agree
from jaxdist.checkpoint.compat import (
    FREE_KEYS,
    changed_keys,
    check_allowed_keys,
    check_config_drift,
    check_model,
    check_resume,
    check_run_dir_model,
    check_train_state,
    saved_config,
)
from jaxdist.checkpoint.restoring import Restored, restore
from jaxdist.checkpoint.saving import Saver
from jaxdist.checkpoint.setaside import set_aside_newer
from jaxdist.checkpoint.storage import SUBDIR, checkpoint_dir, has_checkpoints, load_params, open_manager

__all__ = [
    "FREE_KEYS",
    "SUBDIR",
    "Restored",
    "Saver",
    "all_agree",
    "changed_keys",
    "check_allowed_keys",
    "check_config_drift",
    "check_model",
    "check_resume",
    "check_run_dir_model",
    "check_train_state",
    "checkpoint_dir",
    "has_checkpoints",
    "load_params",
    "open_manager",
    "restore",
    "saved_config",
    "set_aside_newer",
]
