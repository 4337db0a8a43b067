"""Pictures of runs, from their run dirs (metrics.jsonl + config.yaml); no JAX needed (`python -m jaxdist.plot`).

`loss_png` draws one run: train loss (raw and smoothed) and eval loss against steps (bottom axis) and
tokens (top axis), the learning rate on a second y axis, skipped (non-finite) steps as red marks.
Several runs are overlaid on one metric and labelled by the config keys in which they differ. A resumed
run's metrics.jsonl holds all its segments (the resume drops the interrupted attempt's extra records),
and records are joined by step, the later one winning.
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import numpy as np
import yaml

from jaxdist.config.schema import flatten
from jaxdist.errors import JaxdistError

STEP_KEYS = ("loss", "lr")  # every step record of metrics.jsonl has them
METRICS = {
    "loss": "train loss (nats/token)",
    "eval_loss": "eval loss (nats/token)",
    "tokens_per_sec": "tokens / s",
    "mfu": "MFU",
    "flops_per_sec": "achieved model FLOP/s",
}


def read_metrics(run_dir: Path) -> list[dict]:
    """The step records of a run, one per step (the last written wins), in step order."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise JaxdistError(f"{path} not found; pass a run dir written by python -m jaxdist.train")
    by_step = {}
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line cut short by a killed run
        if isinstance(rec, dict) and "step" in rec and not rec.get("summary"):
            if not isinstance(rec["step"], int):
                raise JaxdistError(f"{path} line {n} has a step that is no number; fix or remove the line")
            by_step[rec["step"]] = rec
    return [by_step[s] for s in sorted(by_step)]


def read_config(run_dir: Path) -> dict:
    """config.yaml flattened to {'optim.lr': 0.003, ...} ({} if absent)."""
    path = Path(run_dir) / "config.yaml"
    raw = yaml.safe_load(path.read_text()) if path.is_file() else {}
    return flatten(raw or {})


def differing_labels(configs: list[dict], names: list[str]) -> list[str]:
    """'key=value, ...' of the config keys whose values differ between runs (else the run dirs' names)."""
    keys = sorted({k for c in configs for k in c})
    differ = [k for k in keys if len({json.dumps(c.get(k), sort_keys=True) for c in configs}) > 1]
    if not differ or len(configs) < 2:
        return names
    return [", ".join(f"{k}={c.get(k)}" for k in differ) for c in configs]


def legend_text(label: str, width: int = 48) -> str:
    """A label broken into lines of at most `width` characters after its ', ' separators (a single
    longer 'key=value' keeps its own line), so many differing keys do not push the legend off the plot."""
    return textwrap.fill(label, width, break_long_words=False, break_on_hyphens=False)


def pyplot():
    # deferred: matplotlib loads on first use, not when python -m jaxdist.plot, python -m jaxdist.train starts
    import matplotlib

    matplotlib.use("Agg")
    # deferred: matplotlib loads on first use, not when python -m jaxdist.plot, python -m jaxdist.train starts
    import matplotlib.pyplot as plt

    return plt


def loss_png(run_dir: Path, out: Path | None = None) -> Path:
    """RUN_DIR/loss.png (or `out`): losses vs steps and tokens, LR on a second axis, skipped steps."""
    run_dir = Path(run_dir)
    recs, cfg = read_metrics(run_dir), read_config(run_dir)
    if not recs:
        raise JaxdistError(f"{run_dir / 'metrics.jsonl'} has no step records yet; nothing to plot")
    for r in recs:
        missing = [k for k in STEP_KEYS if not isinstance(r.get(k), (int, float))]
        if missing:
            raise JaxdistError(
                f"{run_dir / 'metrics.jsonl'}: the record of step {r['step']} has no numeric {missing[0]!r}; "
                "fix or remove that line"
            )
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.8))
    steps = [r["step"] for r in recs]
    ax.plot(steps, [r["loss"] for r in recs], color="tab:blue", alpha=0.35, lw=1, label="train loss")
    if any("loss_smooth" in r for r in recs):
        sm = [r for r in recs if "loss_smooth" in r]
        ax.plot(
            [r["step"] for r in sm],
            [r["loss_smooth"] for r in sm],
            color="tab:blue",
            lw=2,
            label="train loss, smoothed",
        )
    ev = [r for r in recs if r.get("eval_loss") is not None]
    if ev:
        ax.plot([r["step"] for r in ev], [r["eval_loss"] for r in ev], "o-", color="tab:orange", label="eval loss")
    skipped = sorted({s for r in recs for s in r.get("skipped_at", [])})
    for i, s in enumerate(skipped):
        ax.axvline(s, color="red", lw=0.8, ls=":", label="skipped step (non-finite)" if i == 0 else None)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(True, alpha=0.3)
    lr_ax = ax.twinx()
    lr_ax.plot(steps, [r["lr"] for r in recs], color="grey", ls="--", lw=1, label="learning rate")
    lr_ax.set_ylabel("learning rate")
    tokens_per_step = cfg.get("train.global_batch", 0) * cfg.get("model.seq_len", 0)
    if tokens_per_step:
        top = ax.secondary_xaxis(
            "top",
            functions=(
                lambda s: np.multiply(s, tokens_per_step) / 1e6,
                lambda t: np.multiply(t, 1e6) / tokens_per_step,
            ),
        )
        top.set_xlabel("tokens (millions)")
    handles = ax.get_legend_handles_labels()
    more = lr_ax.get_legend_handles_labels()
    ax.legend(handles[0] + more[0], handles[1] + more[1], loc="upper right", fontsize=8)
    final = next((r["loss_smooth"] for r in reversed(recs) if "loss_smooth" in r), recs[-1]["loss"])
    ax.set_title(
        f"{run_dir.name}: {steps[-1]} steps, smoothed train loss {final:.3f}"
        + (f", eval {ev[-1]['eval_loss']:.3f}" if ev else ""),
        fontsize=10,
    )
    fig.tight_layout()
    return save(fig, Path(out) if out else run_dir / "loss.png")


def check_out(out: Path) -> Path:
    """Where a picture goes: a folder gets none of its own name, only PNG files are (over)written."""
    out = Path(out)
    if out.suffix.lower() != ".png":
        raise JaxdistError(
            f"--out {out}: give a file name ending in .png (e.g. {out.with_suffix('.png').name}); nothing was written"
        )
    if out.exists() and not out.is_file():
        raise JaxdistError(f"--out {out} is a folder; give a .png file name")
    parent = out.parent
    if not parent.is_dir():
        what = "is a file" if parent.exists() else "does not exist"
        raise JaxdistError(f"--out {out}: folder {parent} {what}; create the folder or choose another --out")
    return out


def save(fig, out: Path) -> Path:
    """Write a figure whole or not at all: into a hidden file beside `out`, renamed over it. A failure
    (full disk, read-only folder) is one line and leaves no empty or partial PNG behind."""
    plt = pyplot()
    out = check_out(out)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}.png"
    try:
        fig.savefig(tmp, dpi=110)
        os.replace(tmp, out)
    except OSError as e:
        raise JaxdistError(
            f"cannot write {out} ({(e.strerror or str(e)).lower()}); fix the folder or choose another --out"
        )
    finally:
        plt.close(fig)
        if tmp.exists():  # on a read-only filesystem unlinking a missing file fails too (EROFS, not ENOENT)
            tmp.unlink(missing_ok=True)
    return out


def overlay(run_dirs: list[Path], metric: str, out: Path) -> list[str]:
    """One metric of several runs on one axis; returns the labels used (the differing config keys)."""
    runs = [(Path(d), read_metrics(d), read_config(d)) for d in run_dirs]
    labels = differing_labels([c for _, _, c in runs], [str(d) for d, _, _ in runs])
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for (d, recs, _), label in zip(runs, labels):
        pts = [r for r in recs if r.get(metric) is not None]
        if not pts:
            raise JaxdistError(f"{d / 'metrics.jsonl'} has no {metric!r} values; pick another --metric")
        ax.plot(
            [r["step"] for r in pts],
            [r[metric] for r in pts],
            "o-" if metric.startswith("eval") else "-",
            ms=3,
            label=legend_text(label),
        )
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(METRICS.get(metric, metric))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save(fig, out)
    return labels
