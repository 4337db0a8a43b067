"""The agreement table of docs/evaluation.md: jaxdist's lm-eval model on the committed fixture export
(tests/fixtures/eval_model) against lm-eval's own `hf` backend's answers (reference.json, made by
scripts/fixtures/make_eval_fixture.py), on one device and on an fsdp=4,tp=2 mesh, with the compiled shapes and
the padding they cost. tests/test_eval.py asserts the same bounds; this prints the measured figures.

    python scripts/checks/eval_agreement.py          # ~1 min on 2 cores
"""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "eval_model"
TASKS_DIR = REPO / "tests" / "fixtures" / "eval_tasks"
TASKS = ["jx_choice", "jx_ppl", "jx_gen"]


def resps(samples: list) -> list:
    return [s["resps"] for s in sorted(samples, key=lambda s: s["doc_id"])]


def compare(results: dict, ref: dict) -> dict:
    got, want = results["results"], ref["results"]
    ll = [
        abs(g[0][0] - w[0][0])
        for a, b in zip(resps(results["samples"]["jx_choice"]), resps(ref["samples"]["jx_choice"]))
        for g, w in zip(a, b)
    ]
    greedy = all(
        g[0][1] == w[0][1]
        for a, b in zip(resps(results["samples"]["jx_choice"]), resps(ref["samples"]["jx_choice"]))
        for g, w in zip(a, b)
    )
    rolling = [
        abs(a[0][0] - b[0][0]) for a, b in zip(resps(results["samples"]["jx_ppl"]), resps(ref["samples"]["jx_ppl"]))
    ]
    ppl = max(
        abs(got["jx_ppl"][m] / want["jx_ppl"][m] - 1)
        for m in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none")
    )
    gens = resps(results["samples"]["jx_gen"]) == resps(ref["samples"]["jx_gen"])
    return {
        "acc": (got["jx_choice"]["acc,none"], want["jx_choice"]["acc,none"]),
        "acc_norm": (got["jx_choice"]["acc_norm,none"], want["jx_choice"]["acc_norm,none"]),
        "choice log-likelihoods, max abs diff": max(ll),
        "is_greedy identical": greedy,
        "rolling log-likelihoods, max abs diff": max(rolling),
        "perplexities max relative diff": ppl,
        "generations identical": f"{gens} ({len(resps(results['samples']['jx_gen']))} docs)",
        "exact_match": (got["jx_gen"]["exact_match,none"], want["jx_gen"]["exact_match,none"]),
    }


def main() -> None:
    from jaxdist.distributed.platform import setup_platform

    setup_platform(8)
    import jax

    from jaxdist.distributed.mesh import mesh_from_string
    from jaxdist.evaluation import harness, model, programs

    ref = json.loads((FIXTURE / "reference.json").read_text())
    sharded = model.from_source(None, str(FIXTURE), "fsdp=4,tp=2", batch_size=8)
    p = sharded.programs
    params = jax.device_put(p.params, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    one = programs.Programs(p.cfg, params, p.graphdef, mesh_from_string("fsdp=1", devices=jax.devices()[:1]), p.rules)
    single = model.JaxdistLM(one, sharded.tokens, sharded.max_length, 8)
    rows = {}
    for name, lm in (("one device", single), ("fsdp=4,tp=2", sharded)):
        results = harness.evaluate(lm, TASKS, include_path=str(TASKS_DIR), log_samples=True)
        rows[name] = compare(results, ref)
        print(f"{name}: {lm.programs.stats.line()}")
    print("\n| | " + " | ".join(rows) + " |\n| --- |" + " --- |" * len(rows))
    for key in rows["one device"]:
        cells = []
        for r in rows.values():
            v = r[key]
            cells.append(
                f"{v[0]:.4g} (hf {v[1]:.4g})"
                if isinstance(v, tuple)
                else f"{v:.1e}"
                if isinstance(v, float)
                else str(v)
            )
        print(f"| {key} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
