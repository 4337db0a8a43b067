"""`train.eval_tasks`: lm-eval tasks at each evaluation of a training run, on the training mesh with the
weights in place (the state's own parameter arrays: no export, no second copy).

`task_evaluator(setup, run_dir)` runs at start-up, before the run folder is written: it refuses what
the harness cannot run on (a pipelined or context-parallel mesh, parameters offloaded to the host),
checks the task names, and returns `evaluate(params) -> {"eval/TASK/METRIC": value}`, which the loop
logs beside `eval_loss` to metrics.jsonl and every tracker. The tokenizer, window and prefix token are
the ones `python -m jaxdist.eval --run-dir RUN/checkpoints/N` reads from the run dir, so the logged
scores at step N are what that command gives on checkpoint N (tests/test_eval_training.py).
"""

from __future__ import annotations

from pathlib import Path

from jaxdist.errors import JaxdistError
from jaxdist.evaluation import harness
from jaxdist.evaluation.model import JaxdistLM, tokens_of
from jaxdist.evaluation.programs import Programs
from jaxdist.inference import decode


def check(cfg, mesh) -> None:
    t = cfg.train
    why = (
        "pp > 1 (the harness runs the unpipelined model)"
        if mesh.shape["pp"] > 1
        else "cp > 1 (the harness runs whole sequences on each device)"
        if mesh.shape["cp"] > 1
        else "offload.params=host"
        if cfg.offload.params == "host"
        else None
    )
    if why:
        raise JaxdistError(
            f"train.eval_tasks={t.eval_tasks} cannot run on this run's {why}; drop train.eval_tasks and "
            "evaluate checkpoints with python -m jaxdist.eval --mesh fsdp=-1"
        )


def task_evaluator(s, run_dir: Path):
    """-> evaluate(params) -> {"eval/TASK/METRIC": value} for `s` (a set-up `jaxdist.training.run.Run`)."""
    cfg, t = s.cfg, s.cfg.train
    check(cfg, s.mesh)
    manager = harness.task_manager(t.eval_include_path or None, t.eval_tasks)
    harness.check_tasks(t.eval_tasks, manager)
    source = Path(run_dir) / "hf_source"  # what an imported model left: its config, tokenizer
    tokens = tokens_of(cfg, source, s.run_tok)
    programs = Programs(cfg, None, s.prog.graphdef, s.mesh, decode.generation_rules(cfg))
    lm = JaxdistLM(programs, tokens, decode.window(cfg, source, False), t.eval_batch_size, t.seed)

    def evaluate(params) -> dict[str, float]:
        programs.params = params
        try:
            results = harness.evaluate(lm, t.eval_tasks, manager=manager, limit=t.eval_limit or None, seed=t.seed)
        finally:
            programs.params = None  # the state's arrays are donated to the next step: hold no reference
        return harness.flat_metrics(results)

    return evaluate
