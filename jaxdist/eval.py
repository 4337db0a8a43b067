"""`python -m jaxdist.eval`: lm-evaluation-harness tasks on a jaxdist run, one of its checkpoints, or a
Hugging Face model, with the weights sharded over a mesh.

    python -m jaxdist.eval --run-dir runs/X --tasks hellaswag,arc_easy --limit 100
    python -m jaxdist.eval --run-dir runs/X/checkpoints/200 --tasks my_task --include-path my_tasks/
    python -m jaxdist.eval --hf hf:ORG/NAME --tasks lambada_openai --mesh fsdp=4,tp=2 --output-path out/

lm-eval does the task logic; jaxdist answers its loglikelihood, loglikelihood_rolling and
generate_until requests on the sharded model (jaxdist.evaluation). Results are written as lm-eval
writes them (`results_<time>.json` under --output-path) and a table is printed. Needs the `eval`
extra: pip install "jaxdist[eval]". Offline: task data comes from the datasets cache or local files
(HF_DATASETS_OFFLINE=1); see docs/evaluation.md.
"""

from __future__ import annotations

import argparse
import sys

from jaxdist.distributed.platform import setup_platform
from jaxdist.errors import ArgumentParser, JaxdistError, command


def parse_args(argv):
    p = ArgumentParser(
        prog="python -m jaxdist.eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run-dir", help="a jaxdist run dir (its latest checkpoint) or RUN/checkpoints/STEP")
    src.add_argument("--hf", help="a Hugging Face model: a directory or hf:ORG/NAME[@REV]")
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    p.add_argument("--include-path", help="a folder of your own task YAMLs (lm-eval's --include_path)")
    p.add_argument("--num-fewshot", type=int, help="few-shot examples per prompt (default: the task's)")
    p.add_argument("--limit", type=float, help="examples per task (< 1: that fraction of them)")
    p.add_argument("--batch-size", type=int, default=8, help="requests per compiled batch (default 8)")
    p.add_argument("--output-path", help="folder for lm-eval's results_<time>.json (and samples)")
    p.add_argument("--log-samples", action="store_true", help="also write each request and answer (--output-path)")
    p.add_argument("--apply-chat-template", action="store_true", help="prompts in the model's chat template")
    p.add_argument("--mesh", default="fsdp=-1", help="mesh for the weights, e.g. fsdp=4,tp=2")
    p.add_argument("--seed", type=int, default=0, help="few-shot sampling and do_sample tasks")
    p.add_argument("--cpu-devices", type=int, default=8)
    args = p.parse_args(argv)
    args.tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not args.tasks:
        raise JaxdistError("--tasks is empty; give comma-separated task names, e.g. --tasks hellaswag,arc_easy")
    if args.batch_size < 1:
        raise JaxdistError(f"--batch-size {args.batch_size} must be >= 1")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise JaxdistError(f"--num-fewshot {args.num_fewshot} must be >= 0")
    if args.limit is not None and not args.limit > 0:  # NaN fails too
        raise JaxdistError(f"--limit {args.limit} must be > 0 (a count, or a fraction below 1)")
    if args.log_samples and not args.output_path:
        raise JaxdistError("--log-samples writes under --output-path; give one")
    return args


def _lm_eval_installed() -> None:
    try:
        # deferred: lm-eval is an optional extra; a missing one is a one-line error, not a traceback
        import lm_eval  # noqa: F401
    except ImportError:
        raise JaxdistError('python -m jaxdist.eval needs lm-eval: pip install "jaxdist[eval]"') from None


@command
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _lm_eval_installed()
    setup_platform(args.cpu_devices)
    # deferred: flax, jax, lm_eval load on first use, not when python -m jaxdist.eval starts
    from jaxdist.evaluation import harness, model

    lm = model.from_source(args.run_dir, args.hf, args.mesh, args.batch_size, args.seed)
    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    results = harness.evaluate(
        lm,
        args.tasks,
        include_path=args.include_path,
        num_fewshot=args.num_fewshot,
        limit=limit,
        apply_chat_template=args.apply_chat_template,
        log_samples=args.log_samples,
        seed=args.seed,
    )
    if args.output_path:
        path = harness.write(results, args.output_path, args.run_dir or args.hf)
        print(f"wrote {path}", file=sys.stderr)
    print(harness.table(results))
    print(lm.programs.stats.line(), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
