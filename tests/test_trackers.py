"""Experiment trackers with the real libraries: a short run logs to TensorBoard, W&B (offline, files under
the run dir) and MLflow (a local file store) at once, and each library's own reader gives back the loss
values of metrics.jsonl and the resolved config. wandb and mlflow are optional extras (not in `.[test]`:
they are heavy); their tests skip when the package is missing, and CI installs them (`.[ci]`)."""

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import MICRO_MODEL

import jaxdist

SMALL = MICRO_MODEL
HAVE = {name: importlib.util.find_spec(name) is not None for name in ("tensorboard", "wandb", "mlflow")}


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    """One 6-step run with every installed tracker; (run dir, its metrics.jsonl step records)."""
    run_dir = tmp_path_factory.mktemp("tracked") / "run"
    names = ["tensorboard"] + [n for n in ("wandb", "mlflow") if HAVE[n]]  # tensorboardX is a dependency
    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_MODE", "offline")
    mp.setenv("WANDB_SILENT", "true")
    mp.setenv("MLFLOW_TRACKING_URI", (run_dir.parent / "mlruns").as_uri())
    mp.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow 3 keeps the file store behind this switch
    from jaxdist import config

    cfg = config.load(
        None,
        [
            "train.steps=6",
            "optim.warmup_steps=2",
            "train.eval_every=0",
            "train.log_every=2",
            "checkpoint.every=0",
            "optim.lr=0.002",
            "train.plot=false",  # no test here reads loss.png
            f"train.trackers={json.dumps(names)}",
        ],
    )
    cfg = cfg.replace(model=SMALL)
    try:
        jaxdist.run(cfg, run_dir, log=lambda *a: None)
    finally:
        mp.undo()
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir, [r for r in records if "loss" in r]


@pytest.mark.skipif(
    not HAVE["tensorboard"],
    reason="tensorboard (the reader) not installed: pip install -e '.[tensorboard]' (CI installs .[ci])",
)
def test_tensorboard_events_hold_the_logged_losses(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, steps = tracked_run
    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    got = [(e.step, e.value) for e in acc.Scalars("loss")]
    assert got == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in steps]


@pytest.mark.skipif(not HAVE["wandb"], reason="wandb not installed: pip install -e '.[wandb]' (CI installs .[ci])")
def test_wandb_offline_run_holds_losses_and_config(tracked_run):
    run_dir, steps = tracked_run
    [offline] = (run_dir / "wandb").glob("offline-run-*")  # the files live under the run dir
    wandb_cli = shutil.which("wandb") or str(Path(sys.executable).with_name("wandb"))  # a venv not activated
    out = subprocess.run(
        [wandb_cli, "leet", "inspect", "--json", str(offline)], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    assert [(h["_step"], h["loss"]) for h in history if "loss" in h] == [
        (r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in steps
    ]
    config = next(r["run"]["config"]["update"] for r in records if r["type"] == "run")
    assert config["optim"]["lr"] == 0.002 and config["model"]["d_model"] == 32


@pytest.mark.skipif(not HAVE["mlflow"], reason="mlflow not installed: pip install -e '.[mlflow]' (CI installs .[ci])")
def test_mlflow_file_store_run_holds_losses_and_config(tracked_run):
    from mlflow.tracking import MlflowClient

    run_dir, steps = tracked_run
    client = MlflowClient(tracking_uri=(run_dir.parent / "mlruns").as_uri())
    run_id = (run_dir / ".mlflow_run_id").read_text()
    history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "loss"))
    assert history == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in steps]
    run = client.get_run(run_id)
    assert run.data.params["optim.lr"] == "0.002" and run.info.status == "FINISHED"


def test_missing_tracker_package_is_exit_2_and_one_line(tmp_path, monkeypatch, capsys):
    """A tracker whose package cannot be imported (here: hidden from this interpreter, for this test) is a
    start-up error naming the extra to install; nothing is written. The command's main in-process."""
    from jaxdist import train

    monkeypatch.setitem(sys.modules, "mlflow", None)  # `import mlflow` raises ImportError
    assert train.main(["--run-dir", str(tmp_path / "r"), "train.trackers=[tensorboard,mlflow]"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: train.trackers includes mlflow but mlflow is not installed; "
        'pip install -e ".[mlflow]" or remove mlflow from train.trackers'
    )
    assert not (tmp_path / "r").exists()


def test_unknown_tracker_is_a_config_error():
    from jaxdist import config
    from jaxdist.errors import JaxdistError

    with pytest.raises(JaxdistError, match="train.trackers: 'neptune' is not one of tensorboard, wandb, mlflow"):
        config.load(None, ["train.trackers=[neptune]"])


def test_tensorboard_import_leaves_torch_out_and_importable():
    """tensorboardX would import torch (seconds of every run's start-up) to accept torch tensors; the
    tracker hides it for that import only: torch is not loaded, and a later `import torch` still works."""
    code = (
        "import sys, importlib.util; from jaxdist.observe import trackers; trackers.import_tracker('tensorboardX'); "
        "assert 'torch' not in sys.modules, 'torch was imported'; "
        "assert importlib.util.find_spec('torch') is None or __import__('torch').zeros(1).shape == (1,)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
