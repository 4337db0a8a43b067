"""AdamW vs Muon from scratch: each with its learning rate chosen by a small sweep, on two corpora;
reports the steps each needs to reach AdamW's final eval loss, and overlays the curves (`plot`).

    nice python scripts/studies/optim_study.py --out runs/optim_study            # ~10 min on a loaded 2-core CPU
    python -m jaxdist.plot runs/optim_study/stdlib/adamw_lr* --metric eval_loss --out sweep.png   # any overlay

Sized for a CPU: one device, a 2-layer byte-level model (d_model 64, the suite's SMALL_MODEL shape with
--seq-len 64), global batch 16, --steps 300 with a cosine schedule (warm-up 20), eval on 4 held-out
batches every --eval-every steps. Corpora: `stdlib` (jaxdist's bundled default: the Python standard
library's source) and `licenses` (English prose: /usr/share/common-licenses/*).

One compiled program per optimizer serves every LR and both corpora: each optimizer's step changes
the parameters by lr(t)·direction with the direction independent of the peak LR (AdamW's and Muon's
decoupled decay included, the moments depend on the gradients only), so the program is built at
optim.lr=1 and the jitted wrapper scales the step's parameter change by the swept peak LR, a traced
argument. `--check` (default on) compares 3 steps of that wrapper against a program built at the LR
itself (printed: the largest parameter difference).

Each run writes RUN/metrics.jsonl (step, loss, eval_loss, lr) and RUN/config.yaml, so `python -m
jaxdist.plot` overlays them; OUT/CORPUS_eval_loss.png overlays both optimizers' best runs (and
OUT/CORPUS_sweep.png every run); OUT/summary.json holds the table. Steps to reach a loss are read at
the eval points (a multiple of --eval-every): the first eval at or below AdamW's final eval loss.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import yaml

from jaxdist import config
from jaxdist.data import loader as loader_mod
from jaxdist.distributed import mesh as mesh_mod
from jaxdist.observe.plots import overlay
from jaxdist.training import step

CORPORA = {"stdlib": "", "licenses": "/usr/share/common-licenses/*"}
MODEL = dict(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128, vocab_size=256)


def base_cfg(args, corpus: str, name: str, lr: float):
    path = CORPORA[corpus]
    over = [f"model.{k}={v}" for k, v in MODEL.items()] + [
        f"model.seq_len={args.seq_len}",
        f"data.path={path}",
        f"train.steps={args.steps}",
        f"train.global_batch={args.batch}",
        f"train.eval_every={args.eval_every}",
        "train.eval_batches=4",
        f"optim.warmup_steps={args.warmup}",
        f"optim.name={name}",
        f"optim.lr={lr}",
        "data.prefetch=1",
    ]
    return config.load(None, over)


def scaled_step(prog):
    """(state, tokens, peak_lr) -> (state, metrics): the program (built at peak LR 1) with its
    parameter change scaled by peak_lr."""

    def run(state, tokens, peak):
        new, metrics = prog.train_step.fn(state, tokens)  # the jitted step, inlined
        params = jax.tree.map(lambda o, n: o + peak * (n - o), state.params, new.params)
        return dataclasses.replace(new, params=params), metrics

    fn = jax.jit(run, donate_argnums=0)

    def call(state, tokens, peak):
        with prog.activate():
            return fn(state, tokens, peak)

    return call


def corpus_data(args, corpus: str, prog):
    cfg = base_cfg(args, corpus, "adamw", 1.0)
    loader = loader_mod.Loader(cfg, prog.batch_sharding)
    train = [np.asarray(next(loader)) for _ in range(args.steps)]
    return train, [np.asarray(b) for b in loader.eval_arrays()]


def evaluate(prog, params, evals) -> float:
    total, count = 0.0, 0.0
    for b in evals:
        s, c = prog.eval_step(params, jnp.asarray(b))
        total, count = total + float(s), count + float(c)
    return total / count


def train(args, prog, fn, data, lr: float, run_dir: Path) -> list[dict]:
    train_b, evals = data
    state, recs = prog.init_state(args.seed), []
    for t, b in enumerate(train_b):
        state, m = fn(state, jnp.asarray(b), jnp.float32(lr))
        rec = {"step": t + 1, "loss": float(m["loss"]), "lr": lr * float(prog.lr_schedule(t))}
        if (t + 1) % args.eval_every == 0 or t + 1 == len(train_b):
            rec["eval_loss"] = evaluate(prog, state.params, evals)
        recs.append(rec)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return recs


def steps_to(recs: list[dict], target: float) -> int | None:
    return next((r["step"] for r in recs if "eval_loss" in r and r["eval_loss"] <= target), None)


def check(args, progs, fns, data, corpus: str) -> float:
    """3 steps of the scaled wrapper vs a program built at the LR: the largest parameter difference."""
    worst = 0.0
    for name, lr in (("adamw", args.lrs[1]), ("muon", args.lrs[1])):
        direct = step.build_program(base_cfg(args, corpus, name, lr), progs[name].mesh)
        a, b = direct.init_state(args.seed), progs[name].init_state(args.seed)
        for tok in data[0][:3]:
            a, _ = direct.train_step(a, jnp.asarray(tok))
            b, _ = fns[name](b, jnp.asarray(tok), jnp.float32(lr))
        for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
            worst = max(worst, float(jnp.abs(x - y).max()))
    return worst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/optim_study"))
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--lrs", type=lambda s: [float(x) for x in s.split(",")], default=[1e-3, 3e-3, 1e-2, 3e-2])
    p.add_argument("--corpora", default="stdlib,licenses")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-check", action="store_true")
    args = p.parse_args()
    corpora = args.corpora.split(",")
    if "licenses" in corpora and not glob.glob(CORPORA["licenses"]):
        raise SystemExit("no /usr/share/common-licenses/*: pass --corpora stdlib")
    one = mesh_mod.mesh_from_string("fsdp=1", jax.devices()[:1])
    print("building programs", flush=True)
    progs = {n: step.build_program(base_cfg(args, corpora[0], n, 1.0), one) for n in ("adamw", "muon")}
    fns = {n: scaled_step(progs[n]) for n in progs}
    summary = {"args": {k: str(v) for k, v in vars(args).items()}, "model": MODEL, "corpora": {}}
    for corpus in corpora:
        t0 = time.time()
        data = corpus_data(args, corpus, progs["adamw"])
        if not args.no_check and corpus == corpora[0]:
            summary["check_max_param_diff"] = check(args, progs, fns, data, corpus)
            print(f"check: scaled wrapper vs program built at the LR, 3 steps: {summary['check_max_param_diff']:.2e}")
        runs = {}
        for name in ("adamw", "muon"):
            for lr in args.lrs:
                d = args.out / corpus / f"{name}_lr{lr:g}"
                recs = train(args, progs[name], fns[name], data, lr, d)
                cfg = base_cfg(args, corpus, name, lr)
                (d / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
                runs[(name, lr)] = (d, recs)
                print(f"{corpus} {name} lr={lr:g}: final eval {recs[-1]['eval_loss']:.4f} ({time.time() - t0:.0f} s)")
        best = {
            n: min((lr for (m, lr) in runs if m == n), key=lambda lr: runs[(n, lr)][1][-1]["eval_loss"])
            for n in ("adamw", "muon")
        }
        target = runs[("adamw", best["adamw"])][1][-1]["eval_loss"]
        row = {
            "sweep": {f"{n}@{lr:g}": runs[(n, lr)][1][-1]["eval_loss"] for (n, lr) in runs},
            "best_lr": best,
            "adamw_final_eval": target,
            "muon_final_eval": runs[("muon", best["muon"])][1][-1]["eval_loss"],
            "steps_to_adamw_final": {n: steps_to(runs[(n, best[n])][1], target) for n in best},
        }
        s = row["steps_to_adamw_final"]
        row["ratio_muon_over_adamw"] = s["muon"] / s["adamw"] if s["muon"] else None
        overlay([runs[(n, best[n])][0] for n in best], "eval_loss", args.out / f"{corpus}_eval_loss.png")
        overlay([runs[k][0] for k in runs], "eval_loss", args.out / f"{corpus}_sweep.png")
        summary["corpora"][corpus] = row
        print(json.dumps({corpus: row}, indent=1))
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
