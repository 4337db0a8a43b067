"""Elastic runs (`--elastic MIN:MAX`): after a peer's death the surviving supervisors agree on a new
membership and restart their training processes on it, with a mesh re-planned for the new device count.

Why restart the training processes: `jax.distributed.initialize` fixes the process count for the life of a
process (it raises once the XLA backend exists, and `jax.distributed.shutdown` does not rebuild the backend
or its device list), so a run can change membership only by starting new training processes. The
supervisors (JAX-free, `supervisor.py`) survive and do it:

- phases: each supervisor answers "how are you" with its phase: `running` (its training process is alive),
  `deciding` (it ended, the cause is being found), `waiting` (ended by a peer's death: ready to regroup),
  `leaving` (it ended by itself, or was stopped: it is the dead one).
- the leader: the lowest index whose supervisor is running, deciding or waiting (a dead process 0, the
  coordinator, is simply not among them). It keeps asking until no one is deciding, picks the most
  processes in MIN..MAX for which a mesh fits (`plan`), numbers them 0..k-1 in the old order, chooses
  the new coordinator (its own address, a fresh port), and sends each its place (`regroup`). Survivors
  beyond k stop as spares (exit 0); a member that answers it is leaving makes the leader start over.
- the followers wait for that message (REGROUP_S), then restart their training process with the new
  `--num-processes/--process-id/--coordinator/--mesh` and `--run-dir` (the same run dir): it resumes the
  latest checkpoint onto the new mesh, and the loader gives step s the same windows whatever the mesh.

The mesh (`plan`): the model axes (pp, cp, tp) stay if their product divides the new device count; the
rest goes to the batch axes (fsdp if the old mesh had fsdp > 1, else dp; ep kept where it divides). The
global batch is unchanged; a mesh whose batch shards do not divide global_batch / grad_accum_steps does
not fit (more accumulation shrinks the micro-batch, so it cannot make one fit; it only saves memory).
"""

from __future__ import annotations

import json
import math
import socket
import threading
import time
from pathlib import Path

import yaml

from jaxdist.config.axes import AXES
from jaxdist.errors import JaxdistError

REGROUP_S = 30.0  # a follower waits this long for the leader's new membership, then stops
DECIDE_S = 15.0  # the leader waits this long for peers still finding out why their training process ended
MODEL_AXES = ("pp", "cp", "tp")
MANAGED = ("--coordinator", "--num-processes", "--process-id", "--mesh", "--run-dir")


def parse_span(text: str) -> tuple[int, int]:
    """'2:4' -> (2, 4): the fewest and most processes the run may continue on."""
    lo, sep, hi = text.partition(":")
    try:
        span = (int(lo), int(hi)) if sep else (int(lo), int(lo))
    except ValueError:
        raise JaxdistError(f"--elastic {text!r} must be MIN:MAX process counts, e.g. --elastic 2:4") from None
    if not 1 <= span[0] <= span[1]:
        raise JaxdistError(f"--elastic {text!r} needs 1 <= MIN <= MAX, e.g. --elastic 2:4")
    return span


def parse_shape(text: str) -> dict[str, int]:
    """A resolved mesh string ('dp=2,fsdp=4', as config.yaml records it) -> every axis's size."""
    shape = {a: 1 for a in AXES}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        shape[name.strip()] = int(value)
    return shape


def fit(old: dict[str, int], devices: int, micro_batch: int) -> str | None:
    """The mesh for `devices` devices re-planned from `old` (see the module's docstring), None if none fits."""
    kept: dict[str, int] = {a: old.get(a, 1) for a in MODEL_AXES}
    if devices % math.prod(kept.values()):
        kept = {a: 1 for a in MODEL_AXES}  # the model axes no longer divide: all data parallel
    rest = devices // math.prod(kept.values())
    ep = old.get("ep", 1) if rest % old.get("ep", 1) == 0 else 1
    batch_axis = "fsdp" if old.get("fsdp", 1) > 1 else "dp"
    shape = {**dict.fromkeys(AXES, 1), **kept, "ep": ep, batch_axis: rest // ep}
    if micro_batch % (shape["dp"] * shape["fsdp"] * shape["ep"]):
        return None
    return ",".join(f"{a}={shape[a]}" for a in AXES if shape[a] > 1) or "dp=1"


def plan(
    run_dir: str | Path, old_n: int, survivors: int, span: tuple[int, int], mesh: str | None = None
) -> tuple[int, str, str] | str:
    """(processes, old mesh, new mesh) for the most processes in MIN..MAX that `survivors` allow and a mesh
    fits, from the run's config.yaml (`mesh`: the old mesh when it is known better, as while a restarted
    training process has not yet written its config.yaml); else the one-line reason why the run cannot
    continue."""
    try:
        cfg = yaml.safe_load((Path(run_dir) / "config.yaml").read_text())
        old_text = mesh or cfg["mesh"]["shape"]
        micro = cfg["train"]["global_batch"] // cfg["train"]["grad_accum_steps"]
    except (OSError, KeyError, TypeError, ValueError, yaml.YAMLError) as e:
        return f"cannot read the run's mesh from {run_dir}/config.yaml ({type(e).__name__})"
    old = parse_shape(old_text)
    per_process = math.prod(old.values()) // old_n
    lo, hi = span
    for k in range(min(hi, survivors), lo - 1, -1):
        new = fit(old, k * per_process, micro)
        if new is not None:
            return k, old_text, new
    if survivors < lo:
        return f"{survivors} process(es) survive, fewer than --elastic's minimum {lo}"
    return (
        f"no mesh of {lo}..{min(hi, survivors)} process(es) x {per_process} device(s) shards the micro-batch of "
        f"{micro} sequences (global_batch / grad_accum_steps); choose a global batch they divide"
    )


def rewrite(argv: list[str], n: int, pid: int, coordinator: str, mesh: str, run_dir: str) -> list[str]:
    """The training process's command for its new place: the managed flags replaced, the rest kept."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in MANAGED:
            skip = "=" not in a
            continue
        if name.strip() == "mesh.shape":
            continue
        out.append(a)
    return [*out, "--num-processes", str(n), "--process-id", str(pid), "--coordinator", coordinator] + [
        "--mesh",
        mesh,
        "--run-dir",
        run_dir,
    ]


def mesh_of(argv: list[str]) -> str | None:
    """The --mesh a rewritten command ends with (`rewrite`), None for a command as launched."""
    found = None
    for a, b in zip(argv, argv[1:]):
        if a == "--mesh":
            found = b
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def latest_checkpoint(run_dir: str | Path) -> int | None:
    ckpts = Path(run_dir) / "checkpoints"
    steps = sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit()) if ckpts.is_dir() else []
    return steps[-1] if steps else None


def change_line(dead: list[int], old_n: int, k: int, old_mesh: str, new_mesh: str, step: int | None) -> str:
    where = f"from checkpoint step {step}" if step is not None else "from step 0 (no checkpoint yet)"
    return (
        f"elastic: process(es) {', '.join(map(str, dead)) or '-'} gone; continuing on {k} of {old_n} processes, "
        f"mesh {old_mesh} -> {new_mesh}, {where}"
    )


# The leader supervisor's threads that rewrite or append to metrics.jsonl: `trim` (a regroup or a grow) and
# `record_when_running` (the previous change's record, which may still be waiting when the next change trims).
METRICS_LOCK = threading.Lock()


def trim(run_dir: str | Path, step: int | None) -> None:
    """Drop metrics.jsonl's records after `step` (the resume will redo them), as the resume itself does;
    done before the restart so that any later step record is the restarted run's."""
    path = Path(run_dir) / "metrics.jsonl"
    with METRICS_LOCK:  # a recorder thread's append between this read and write would be lost
        try:
            lines = path.read_text().splitlines()
        except OSError:
            return
        kept = []
        for line in lines:
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if isinstance(r, dict) and not r.get("summary") and r.get("step", 0) <= (step or 0):
                kept.append(line + "\n")
        path.write_text("".join(kept))


def record_when_running(
    run_dir: str | Path, rec: dict, since: float, ended: threading.Event | None = None, timeout_s: float = 600.0
) -> None:
    """Append `rec` to metrics.jsonl with `seconds_lost` (the death to the first step trained again) once the
    restarted run logs a step past `rec['step']` (`trim` ran before the restart), or once `ended` is set:
    the supervisor leaves, its run over, and a change at the last checkpoint (a joiner arriving as the run
    ends) left the restarted run nothing to train, so no step would ever come."""
    path = Path(run_dir) / "metrics.jsonl"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _trained_past(path, rec["step"] or 0) or (ended is not None and ended.is_set()):
            out = {**rec, "seconds_lost": round(time.time() - since, 2)}
            with METRICS_LOCK, open(path, "a") as f:
                f.write(json.dumps(out) + "\n")
            return
        time.sleep(0.2)


def _trained_past(path: Path, step: int) -> bool:
    """metrics.jsonl holds a step record past `step`."""
    try:
        for line in path.read_text().splitlines()[::-1]:
            r = json.loads(line) if line.startswith("{") else {}
            if "loss" in r and r.get("step", 0) > step:
                return True
    except (OSError, ValueError):
        pass
    return False
