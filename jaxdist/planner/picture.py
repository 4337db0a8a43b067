"""The planner's scaling picture: what each point is, and where strong and weak scaling differ.

Total tokens/s of strong and weak scaling and their linear reference lie almost on top of each other on
log axes, so the picture shows what differs: tokens/s per device (left) and scaling efficiency and MFU
(right), each point labelled with the mesh the planner chose there and its micro-batching.
"""

from __future__ import annotations

import matplotlib
import matplotlib.pyplot as plt

COLORS = {"strong": "tab:blue", "weak": "tab:orange"}


def point_label(p: dict) -> str:
    """'fsdp=8 acc2' / 'pp=2,fsdp=4 acc1 pipe4': the chosen mesh and micro-batching of one point."""
    label = f"{p['mesh']} acc{p.get('grad_accum_steps', 1)}"
    if p.get("pipeline_microbatches"):
        label += f" pipe{p['pipeline_microbatches']}"
    return label


def scaling_png(curves: dict, path: str, title: str) -> list[str]:
    """Write the picture; returns the point labels drawn (strong first, then weak)."""
    matplotlib.use("Agg")

    fig, (tput, eff) = plt.subplots(1, 2, figsize=(13, 5.2))
    labels = []
    for mode, pts in curves.items():
        pts = [p for p in pts if p["fits"]]
        if not pts:
            continue
        n = [p["devices"] for p in pts]
        color = COLORS.get(mode)
        batch = "fixed global batch" if mode == "strong" else "batch grows with devices"
        tput.plot(
            n, [p["tokens_per_s"] / p["devices"] for p in pts], "o-", color=color, label=f"{mode} scaling ({batch})"
        )
        for p in pts:
            text = point_label(p)
            labels.append(text)
            up = mode == "strong"
            tput.annotate(
                f"{text} B={p['global_batch']}",
                (p["devices"], p["tokens_per_s"] / p["devices"]),
                textcoords="offset points",
                xytext=(0, 6 if up else -6),
                ha="center",
                va="bottom" if up else "top",
                rotation=90,
                fontsize=6,
                color=color,
            )
        eff.plot(
            n,
            [p["scaling_efficiency"] for p in pts],
            "o-",
            color=color,
            label=f"{mode}: per-device tokens/s vs {pts[0]['devices']} device(s)",
        )
        eff.plot(n, [p["mfu"] for p in pts], "s--", color=color, alpha=0.6, label=f"{mode}: MFU")
    eff.axhline(1.0, color="grey", ls=":", lw=1, label="linear scaling (100%)")
    for ax in (tput, eff):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("devices")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    tput.set_ylabel("tokens / s per device (predicted)")
    tput.set_ylim(0, tput.get_ylim()[1] * 1.45)  # room above for the vertical labels
    tput.set_title("throughput per device; labels: mesh, accumulation (acc), pipeline micro-batches (pipe)", fontsize=8)
    eff.set_ylabel("fraction")
    eff.set_ylim(0, max(1.1, eff.get_ylim()[1]))
    eff.set_title("scaling efficiency and MFU", fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return labels
