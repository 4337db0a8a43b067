"""Run lm-evaluation-harness tasks on jaxdist weights: the work of `python -m jaxdist.eval`, and of
`train.eval_tasks` inside training (weights in place, on the training mesh).

`evaluate` hands lm-eval's `simple_evaluate` a `JaxdistLM` and the task names (lm-eval's own tasks,
and YAMLs under `include_path`); `write` saves what lm-eval's CLI saves (`results_<time>.json`, the
samples when asked) under an output folder; `flat_metrics` turns the results into
`eval/TASK/METRIC` numbers for metrics.jsonl and the trackers. Task data comes through the datasets
cache or local files: a task whose data is not there while offline (`HF_DATASETS_OFFLINE=1`) is one
line naming the dataset and how to fetch it.
"""

from __future__ import annotations

import logging
import math
import os
import re
from pathlib import Path

from lm_eval import evaluator
from lm_eval.loggers import EvaluationTracker
from lm_eval.tasks import TaskManager
from lm_eval.utils import make_table

from jaxdist.errors import JaxdistError
from jaxdist.evaluation.model import JaxdistLM

OFFLINE_VARIABLES = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")


def task_manager(include_path: str | None, tasks: list[str]) -> TaskManager:
    """lm-eval's task index: the YAMLs under `include_path` alone when they hold every task asked for
    (indexing lm-eval's own 14,686 task entries took 56 s on 2 shared cores), else both."""
    if include_path and not Path(include_path).is_dir():
        raise JaxdistError(f"--include-path {include_path} is not a folder; give the folder holding your task YAMLs")
    if include_path:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if set(tasks) <= set(local.all_tasks):
            return local
    return TaskManager(include_path=include_path or None)


def check_tasks(tasks: list[str], manager: TaskManager) -> None:
    known = set(manager.all_tasks)
    missing = [t for t in tasks if t not in known]
    if missing:
        raise JaxdistError(
            f"unknown task {', '.join(missing)}: not one of lm-eval's tasks nor a YAML under --include-path; "
            "list them with lm-eval ls tasks, or point --include-path at your task folder"
        )


def evaluate(
    lm: JaxdistLM,
    tasks: list[str],
    include_path: str | None = None,
    manager: TaskManager | None = None,
    num_fewshot: int | None = None,
    limit: float | None = None,
    apply_chat_template: bool = False,
    log_samples: bool = False,
    seed: int = 0,
) -> dict:
    """lm-eval's results dict (`results`, `configs`, `versions`, ... and `samples` when `log_samples`).
    `manager`: a TaskManager already made (and the tasks checked), else one for `include_path`."""
    if manager is None:
        manager = task_manager(include_path, tasks)
        check_tasks(tasks, manager)
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    try:
        results = evaluator.simple_evaluate(
            model=lm,
            tasks=[*tasks],
            num_fewshot=num_fewshot,
            limit=limit,
            task_manager=manager,
            apply_chat_template=apply_chat_template,
            log_samples=log_samples,
            bootstrap_iters=0,  # no standard errors: they would be a second, sampled computation per metric
            random_seed=seed,
            numpy_random_seed=seed,
            torch_random_seed=seed,
            fewshot_random_seed=seed,
        )
    except JaxdistError:
        raise
    except Exception as e:
        raise offline_error(e, tasks, manager) or e
    if results is None:  # lm-eval returns None on processes other than its rank 0
        raise RuntimeError("lm-eval returned no results; jaxdist evaluates in one process")
    return dict(results)


def offline_error(e: Exception, tasks: list[str], manager: TaskManager) -> JaxdistError | None:
    """A task whose data could not be read (offline, or never fetched): one line naming the dataset and
    how to fetch it. None for any other failure (raised as it is)."""
    text = f"{e}".splitlines()[0] if str(e) else type(e).__name__
    if not isinstance(e, OSError) and "Dataset" not in type(e).__name__:
        return None
    configs = [getattr(manager.task_index.get(t), "cfg", None) or {} for t in tasks]
    paths = [str(c["dataset_path"]) for c in configs if c.get("dataset_path")]
    quoted = re.search(r"'([\w.-]+(?:/[\w.-]+)?)'", text)  # datasets names the repo it could not reach
    dataset = next((d for d in paths if d in text), quoted.group(1) if quoted else ", ".join(paths) or "?")
    names = {n for c in configs if c.get("dataset_path") == dataset and (n := c.get("dataset_name")) is not None}
    call = f"'{dataset}'" + (f", '{sorted(names)[0]}'" if len(names) == 1 else "")
    offline = any(os.environ.get(v, "").lower() in ("1", "true", "yes") for v in OFFLINE_VARIABLES)
    where = "while offline (HF_DATASETS_OFFLINE / HF_HUB_OFFLINE)" if offline else "from the Hub"
    return JaxdistError(
        f"task {', '.join(tasks)}: dataset {dataset} is not in the datasets cache and cannot be fetched {where} "
        f'({type(e).__name__}); fetch it once where the Hub is reachable: python -c "import datasets; '
        f'datasets.load_dataset({call})" (HF_HOME selects the cache), then evaluate with HF_DATASETS_OFFLINE=1'
    )


def write(results: dict, output_path: str, model_name: str) -> Path | None:
    """lm-eval's results_<time>.json (and samples_<task>_<time>.jsonl when logged) under output_path."""
    tracker = EvaluationTracker(output_path=output_path)
    tracker.general_config_tracker.model_name = model_name
    tracker.general_config_tracker.model_name_sanitized = model_name.replace("/", "__")
    samples = results.pop("samples", None)
    tracker.save_results_aggregated(results=results, samples=samples)
    if samples:
        for task, rows in samples.items():
            tracker.save_results_samples(task_name=task, samples=rows)
    if samples is not None:
        results["samples"] = samples
    found = sorted(Path(output_path).rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def table(results: dict) -> str:
    return make_table(results)


def flat_metrics(results: dict) -> dict[str, float]:
    """{'eval/TASK/METRIC': value} for every finite number in results['results'] (standard errors and
    aliases left out; lm-eval's 'acc,none' filter suffix dropped when it is 'none')."""
    out = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            if key == "alias" or "_stderr" in key or not isinstance(value, int | float) or isinstance(value, bool):
                continue
            metric, _, filt = key.partition(",")
            name = metric if filt in ("", "none") else f"{metric}_{filt}"
            if math.isfinite(value):
                out[f"eval/{task}/{name}"] = float(value)
    return out
