"""Experiment trackers: TensorBoard (default), Weights & Biases, MLflow — several at once.

`train.trackers=[tensorboard,wandb,mlflow]`. Only process 0 opens them (the caller decides). Each gets
the resolved config once, then the numeric values of every metrics.jsonl record at its step, then the
run's summary. W&B follows its own environment (`WANDB_MODE=offline`, `WANDB_PROJECT`); its files go
under the run dir. MLflow logs to `MLFLOW_TRACKING_URI`, or to a file store in `RUN_DIR/mlruns`.
A resumed run continues the same W&B / MLflow run (its id is kept in the run dir).

A leaf module: imports nothing from jaxdist but the error type and the tracker names (config.checks).
"""

from __future__ import annotations

import errno
import importlib
import os
import sys
import time
import uuid
from pathlib import Path

from jaxdist.config.checks import TRACKERS  # name -> (module to import, the pyproject extra)
from jaxdist.errors import JaxdistError


def import_tracker(module: str):
    """Import a tracker's package. tensorboardX imports torch where it is installed only to accept
    torch tensors, which jaxdist never logs: torch is hidden for that import (3.4 s of every run's
    start-up) and visible again after it."""
    hide = module == "tensorboardX" and "torch" not in sys.modules
    if hide:
        # `import torch` raises ImportError, which tensorboardX expects (typeshed types sys.modules without
        # the None that the import system documents for this)
        sys.modules["torch"] = None  # pyright: ignore[reportArgumentType]
    try:
        return importlib.import_module(module)
    finally:
        if hide:
            del sys.modules["torch"]


def check_installed(names: list[str]) -> None:
    """At start-up: a tracker whose package is missing is a one-line error naming the extra."""
    for name in names:
        module, extra = TRACKERS[name]
        try:
            import_tracker(module)
        except ImportError:
            raise JaxdistError(
                f"train.trackers includes {name} but {module} is not installed; "
                f'pip install -e ".[{extra}]" or remove {name} from train.trackers'
            ) from None


def _numeric(record: dict) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in record.items()
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def _flat(config: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _run_id(run_dir: Path, name: str, new) -> str:
    """The tracker's run id for this run dir: created once, reused when the run resumes."""
    path = run_dir / f".{name}_run_id"
    if path.exists():
        return path.read_text().strip()
    run_id = new()
    path.write_text(run_id)
    return run_id


class TensorBoard:
    """Events written synchronously with tensorboardX's own event-file writer. Its `SummaryWriter` writes
    from a thread: a full disk killed that thread, and the next `queue.put` of the training loop blocked
    forever. Here a failed write raises in the loop, which stops the run in one line."""

    def __init__(self, run_dir: Path, config: dict, config_text: str):
        import_tracker("tensorboardX")
        # deferred: an optional extra, imported only where its feature is used
        from tensorboardX import summary
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto import event_pb2

        (run_dir / "tb").mkdir(parents=True, exist_ok=True)
        self.events = EventsWriter(str(run_dir / "tb" / "events"))
        # generated protobuf module: its message classes are made at import, so no stub names them
        self._event, self._summary = event_pb2.Event, summary  # pyright: ignore[reportAttributeAccessIssue]
        self._write(0, [summary.text("config", "```\n" + config_text + "\n```")])

    def _write(self, step: int, summaries: list) -> None:
        for s in summaries:
            self.events.write_event(self._event(wall_time=time.time(), step=step, summary=s))
        self.events.flush()

    def log(self, step: int, values: dict[str, float]) -> None:
        self._write(step, [self._summary.scalar(key, value) for key, value in values.items()])

    def finish(self, summary: dict[str, float]) -> None:
        text = "\n".join(f"{k}: {v:.6g}" for k, v in summary.items())
        try:
            self._write(0, [self._summary.text("summary", text)])
        finally:
            self.events.close()


class WandB:
    def __init__(self, run_dir: Path, config: dict, config_text: str):
        # deferred: an optional extra, imported only where its feature is used
        import wandb

        run_id = _run_id(run_dir, "wandb", lambda: uuid.uuid4().hex[:12])
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "jaxdist"),
            dir=str(run_dir),
            name=run_dir.name,
            id=run_id,
            resume="allow",
            config=config,
        )

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def finish(self, summary: dict[str, float]) -> None:
        self.run.summary.update(summary)
        self.run.finish()


class MLflow:
    def __init__(self, run_dir: Path, config: dict, config_text: str):
        # deferred: an optional extra, imported only where its feature is used
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{run_dir.resolve() / 'mlflow.db'}"
        self.client = MlflowClient(tracking_uri=uri)
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", "jaxdist")
        found = self.client.get_experiment_by_name(experiment)
        exp_id = found.experiment_id if found else self.client.create_experiment(experiment)
        self.run_id = _run_id(
            run_dir, "mlflow", lambda: self.client.create_run(exp_id, run_name=run_dir.name).info.run_id
        )
        self.client.update_run(self.run_id, status="RUNNING")
        if not self.client.get_run(self.run_id).data.params:  # params are write-once: not again on resume
            params = [Param(k, str(v)[:500]) for k, v in _flat(config).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                self.client.log_batch(self.run_id, params=params[i : i + 100])
        self.client.log_text(self.run_id, config_text, "config.yaml")

    def log(self, step: int, values: dict[str, float]) -> None:
        # deferred: an optional extra, imported only where its feature is used
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def finish(self, summary: dict[str, float]) -> None:
        # deferred: an optional extra, imported only where its feature is used
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(f"summary.{k}", f"{v:.6g}") for k, v in summary.items()])
        self.client.set_terminated(self.run_id)


CLASSES = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow}


class Trackers:
    """All configured trackers behind one `log` / `finish`."""

    def __init__(self, names: list[str], run_dir: Path, config: dict, config_text: str):
        check_installed(names)
        self.names = list(names)
        self.open = []
        for n in names:
            try:
                self.open.append(CLASSES[n](Path(run_dir), config, config_text))
            except Exception as e:  # a tracker that cannot start (a full disk, an unreachable server): one line
                text = (getattr(e, "strerror", None) or str(e).strip() or type(e).__name__).splitlines()[0][:200]
                if getattr(e, "errno", None) == errno.ENOSPC:  # the disk, not the tracker, is what to fix
                    raise JaxdistError(
                        f"train.trackers: {n} could not start in {run_dir} (no space left on device); free space, "
                        "then run the same command"
                    ) from None
                raise JaxdistError(
                    f"train.trackers: {n} could not start ({text}); fix it, or remove {n} from train.trackers"
                ) from None

    def log(self, record: dict) -> None:
        values = _numeric(record)
        if "step" in record and values:
            for t in self.open:
                t.log(int(record["step"]), values)

    def finish(self, summary: dict) -> None:
        values = _numeric({k: v for k, v in summary.items() if k != "summary"})
        for t in self.open:
            t.finish(values)
        self.open = []
