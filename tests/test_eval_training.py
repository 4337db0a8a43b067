"""`train.eval_tasks`: the harness at each evaluation on the training mesh, weights in place; the task
metrics logged at step N (metrics.jsonl, `eval/TASK/METRIC`) equal `python -m jaxdist.eval` on
checkpoint N (accuracies identical, perplexities to 1e-4 relative: two different compiled programs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("lm_eval", reason='the eval extra: pip install "jaxdist[eval]"')

from conftest import MICRO_MODEL

import jaxdist
from jaxdist import eval as eval_cmd
from jaxdist import plot
from jaxdist.errors import JaxdistError
from jaxdist.evaluation import in_training

REPO = Path(__file__).resolve().parent.parent
TOKENIZER = REPO / "tests" / "fixtures" / "eval_model" / "tokenizer.json"
TASKS_DIR = REPO / "tests" / "fixtures" / "eval_tasks"


def corpus(path: Path) -> Path:
    rows = [json.loads(line) for line in (TASKS_DIR / "ppl.jsonl").read_text().splitlines()]
    path.write_text("\n".join(r["text"] for r in rows * 12))
    return path


@pytest.fixture(scope="module")
def trained(tiny_cfg, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("evaltrain")
    cfg = tiny_cfg.replace(
        model={**MICRO_MODEL, "vocab_size": 512},
        data=dict(source="text", path=str(corpus(tmp / "corpus.txt")), tokenizer=str(TOKENIZER), eval_fraction=0.2),
        train=dict(
            steps=2,
            eval_every=2,
            eval_batches=1,
            eval_tasks=["jx_choice", "jx_ppl"],
            eval_limit=4,
            eval_include_path=str(TASKS_DIR),
            trackers=[],
        ),
        checkpoint=dict(every=2),
    )
    jaxdist.run(cfg, tmp / "run", log=lambda *a, **k: None, tasks=in_training.task_evaluator)
    return cfg, tmp / "run"


def test_logged_task_metrics_equal_jaxdist_eval_on_the_checkpoint(trained, tmp_path, capsys):
    _, run = trained
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    at2 = next(r for r in logged if r.get("step") == 2 and "eval_loss" in r)
    tasks = {k: v for k, v in at2.items() if k.startswith("eval/")}
    assert {"eval/jx_choice/acc", "eval/jx_choice/acc_norm", "eval/jx_ppl/word_perplexity"} <= set(tasks)
    assert tasks["eval/jx_choice/sample_len"] == 4
    rc = eval_cmd.main(
        ["--run-dir", str(run / "checkpoints" / "2"), "--tasks", "jx_choice,jx_ppl", "--limit", "4"]
        + ["--include-path", str(TASKS_DIR), "--output-path", str(tmp_path)]
    )
    assert rc == 0, capsys.readouterr().err
    (written,) = tmp_path.rglob("results_*.json")
    results = json.loads(written.read_text())["results"]
    assert tasks["eval/jx_choice/acc"] == results["jx_choice"]["acc,none"]
    assert tasks["eval/jx_choice/acc_norm"] == results["jx_choice"]["acc_norm,none"]
    for metric in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        assert tasks[f"eval/jx_ppl/{metric}"] == pytest.approx(results["jx_ppl"][f"{metric},none"], rel=1e-4)
    # plot draws a task metric
    assert plot.main([str(run), "--metric", "eval/jx_choice/acc", "--out", str(tmp_path / "acc.png")]) == 0


def test_eval_tasks_refusals_are_one_line(trained, tiny_cfg, tmp_path):
    cfg, _ = trained
    with pytest.raises(JaxdistError, match="is not a folder"):
        jaxdist.run(
            cfg.replace(train=dict(eval_include_path=str(tmp_path / "missing"))),
            tmp_path / "a",
            log=lambda *a, **k: None,
            tasks=in_training.task_evaluator,
        )
    assert not (tmp_path / "a" / "metrics.jsonl").exists()  # refused before anything was written
    with pytest.raises(JaxdistError, match="python -m jaxdist.train passes it"):
        jaxdist.run(cfg, tmp_path / "b", log=lambda *a, **k: None)


@pytest.mark.parametrize(
    "mesh_text, offload, words",
    [("pp=2,fsdp=4", "none", "pp > 1"), ("cp=2,fsdp=4", "none", "cp > 1"), ("fsdp=8", "host", "offload.params=host")],
)
def test_meshes_the_harness_cannot_run_on_are_refused(tiny_cfg, mesh_text, offload, words):
    from jaxdist.distributed.mesh import mesh_from_string

    cfg = tiny_cfg.replace(train=dict(eval_tasks=["jx_choice"]), offload=dict(params=offload))
    with pytest.raises(JaxdistError, match=f"cannot run on this run's {words}.*python -m jaxdist.eval"):
        in_training.check(cfg, mesh_from_string(mesh_text))
    in_training.check(tiny_cfg.replace(train=dict(eval_tasks=["jx_choice"])), mesh_from_string("fsdp=4,tp=2"))
