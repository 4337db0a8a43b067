"""Recovery times of an elastic run (`--elastic`), per cause: seconds from a death to training again, split
into its parts (docs/multi-host.md, "Elastic runs").

    python scripts/cluster/elastic_times.py                        # every case once
    python scripts/cluster/elastic_times.py --cases coordinator    # one case
    python scripts/cluster/elastic_times.py --processes 4 --steps 20 --kill-at 7 --cases process  # issue 49's
    python scripts/cluster/elastic_times.py --processes 4 --steps 20 --kill-at 7 --cases process --rejoin

Two processes x 4 simulated CPU devices train the micro test model (fsdp=8, --elastic 1:2,
--heartbeat-timeout 10, 40 steps, checkpoints every 5); once step 8 is logged one process is ended:
`process` SIGKILLs process 1 (the pid its launcher started), `coordinator` process 0, `frozen` SIGSTOPs
process 1's training process. The survivor must finish the 40 steps on 1 process x 4 devices.
`--processes 4` runs 4 processes x 2 devices instead (the issue's scenario, without the rejoin): 3 survive,
3 x 2 devices cannot split the global batch of 8, so 2 go on (fsdp=4) and the third stops as a spare.
`--rejoin` then starts the killed process and the spare again with their commands: both join (the first
waits for the second: 3 x 2 does not fit) and the run grows back to 4 x 2 (fsdp=8); printed too: the grow's
record and the final parameters' largest difference from the uninterrupted run's. Each log
line is time-stamped as it appears; printed per case: detect (the kill to the survivor's "regroups"
line), regroup (to its "continuing on" line), start (to the new training process's topology line: Python,
imports, its JAX set-up), restore and compile (the training process's own figures), seconds_lost (its
metrics.jsonl record: the kill to the first step trained again), the steps trained again, and whether the
losses equal an uninterrupted 1 x 8 run's (max relative difference).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODEL = "model.num_layers=1 model.d_model=32 model.num_heads=2 model.num_kv_heads=1 model.head_dim=16 model.mlp_dim=64 model.seq_len=16"
ARGS = [*MODEL.split(), "train.plot=false", "train.log_every=1", "train.eval_every=0", "optim.schedule=constant"]
ARGS += ["optim.warmup_steps=2", "checkpoint.async_save=false", "checkpoint.every=5"]
STEPS, KILL_AT, PROCS, REJOIN = 40, 8, 2, False  # set from the command line
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
MARKS = {
    "regroups": "regroups with the survivors",
    "continuing": "continuing on ",
    "up": re.compile(r"^process 0/\d+ on "),
    "restored": re.compile(r"restored step \d+ from .* in ([\d.]+)s"),
    "compiled": re.compile(r"compiled in ([\d.]+)s"),
}


def losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r and not r.get("summary")}


def follow(proc: subprocess.Popen, seen: list[tuple[float, str]], log: Path) -> None:
    with log.open("w") as f:
        for line in proc.stdout:
            seen.append((time.time(), line.rstrip()))
            f.write(line)


def children(pid: int) -> list[int]:
    return [int(c) for f in Path(f"/proc/{pid}/task").glob("*/children") for c in f.read_text().split()]


def reference(tmp: Path) -> dict[int, float]:
    run = tmp / "ref"
    cmd = [
        sys.executable,
        "-m",
        "jaxdist.train",
        "--mesh",
        "fsdp=8",
        "--run-dir",
        str(run),
        *ARGS,
        "--steps",
        str(STEPS),
    ]
    subprocess.run(cmd, env={**ENV, "JAX_NUM_CPU_DEVICES": "8"}, cwd=ROOT, check=True, capture_output=True)
    return losses(run)


def case(tmp: Path, how: str, ref: dict[int, float]) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = tmp / how / "run"
    run.parent.mkdir(parents=True)
    procs, seen = [], [[] for _ in range(PROCS)]
    cmds = []
    for i in range(PROCS):
        cmd = [sys.executable, "-m", "jaxdist.train", "--coordinator", f"127.0.0.1:{port}", "--num-processes"]
        cmd += [str(PROCS), "--process-id", str(i), "--elastic", f"1:{PROCS}", "--heartbeat-timeout", "10"]
        cmd += ["--mesh", "fsdp=8", "--run-dir", str(run), *ARGS, "--steps", str(STEPS)]
        cmds.append(cmd)
        p = subprocess.Popen(
            cmd,
            env={**ENV, "JAX_NUM_CPU_DEVICES": str(8 // PROCS)},
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        threading.Thread(target=follow, args=(p, seen[i], run.parent / f"p{i}.log"), daemon=True).start()
        procs.append(p)
    try:
        while not (run / "metrics.jsonl").exists() or max(losses(run), default=0) < KILL_AT:
            if any(p.poll() is not None for p in procs):
                raise SystemExit(f"{how}: a process ended before the kill; see {run.parent}")
            time.sleep(0.05)
        victim, survivor = (0, 1) if how == "coordinator" else (1, 0)
        target = children(procs[1].pid)[0] if how == "frozen" else procs[victim].pid
        at = time.time()
        os.kill(target, signal.SIGSTOP if how == "frozen" else signal.SIGKILL)
        rejoin_at = restart_ended(procs, cmds, seen, survivor, run) if REJOIN else None
        rc = procs[survivor].wait(timeout=600)
        others = [p.wait(timeout=60) for p in procs if p is not procs[survivor]]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    first = {}
    for t, line in seen[survivor]:
        for name, mark in MARKS.items():
            hit = mark.search(line) if isinstance(mark, re.Pattern) else (mark in line and mark)
            if hit and name not in first and t >= at:
                first[name] = (t, hit.group(1) if isinstance(hit, re.Match) and hit.groups() else None)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rec = next((r for r in rows if "elastic" in r), {})
    grown = [r for r in rows if "elastic" in r and r["elastic"].get("joined")]
    got = losses(run)
    cut = first["continuing"][0] if "continuing" in first else time.time()  # process 0's old steps: before it
    old = [int(m.group(1)) for t, line in seen[0] if t < cut and (m := re.match(r"step (\d+)/", line))]
    last_logged = max(old, default=0)

    def since(name: str) -> float | None:
        return round(first[name][0] - at, 2) if name in first else None

    return {
        "case": how,
        "processes": PROCS,
        "rc": rc,
        "others_rc": others,
        "record": rec.get("elastic"),
        "detect_s": since("regroups"),
        "regroup_s": since("continuing"),
        "started_s": since("up"),
        "restore_s": float(first["restored"][1]) if "restored" in first else None,
        "compile_s": float(first["compiled"][1]) if "compiled" in first else None,
        "seconds_lost": rec.get("seconds_lost"),
        "resumed_from": rec.get("step"),
        "steps_trained_again": None if not rec else last_logged - rec["step"],
        "steps_ok": sorted(got) == list(range(1, STEPS + 1)),
        "max_rel_loss_diff": max(abs(got[s] - ref[s]) / abs(ref[s]) for s in got if s in ref),
        **(
            {
                "rejoin_started_s": round((rejoin_at or at) - at, 2),
                "grow_record": grown[-1] if grown else None,
                "max_abs_param_diff": param_diff(tmp / "ref", run),
                "wall_s": round(time.time() - at, 1),
            }
            if REJOIN
            else {}
        ),
    }


def restart_ended(procs: list, cmds: list, seen: list, survivor: int, run: Path) -> float:
    """Once the survivors regrouped, start every process that ended (the killed one, spares) again with its
    command (they join the run: grow.py); returns when."""
    while not (hit := [m for _, line in seen[survivor] if (m := re.search(r"continuing on (\d+) of", line))]):
        time.sleep(0.05)
    deadline = time.time() + 60  # the spares end once told, the killed one is gone
    while len(ended := [i for i, p in enumerate(procs) if p.poll() is not None]) < PROCS - int(hit[0].group(1)):
        assert time.time() < deadline, "a spare did not end"
        time.sleep(0.1)
    at = time.time()
    for i in ended:
        p = subprocess.Popen(
            cmds[i],
            env={**ENV, "JAX_NUM_CPU_DEVICES": str(8 // PROCS)},
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        seen.append([])
        threading.Thread(target=follow, args=(p, seen[-1], run.parent / f"p{i}-again.log"), daemon=True).start()
        procs.append(p)
    return at


def param_diff(ref_run: Path, run: Path) -> float:
    """The largest absolute difference of the final parameters (the last checkpoint of each run)."""
    import jax
    import numpy as np

    from jaxdist import checkpoint

    a, b = (checkpoint.load_params(r / "checkpoints" / str(STEPS)) for r in (ref_run, run))
    return float(max(np.abs(np.asarray(x) - np.asarray(y)).max() for x, y in zip(*map(jax.tree.leaves, (a, b)))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="*", default=["process", "coordinator", "frozen"])
    p.add_argument("--processes", type=int, default=2, choices=(2, 4), help="x 8/N CPU devices each")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--kill-at", type=int, default=8, help="the step after which the process is ended")
    p.add_argument("--dir", help="keep the runs and logs here (default: a temporary folder)")
    p.add_argument("--rejoin", action="store_true", help="then start every ended process again: the run grows back")
    args = p.parse_args()
    global STEPS, KILL_AT, PROCS, REJOIN
    STEPS, KILL_AT, PROCS, REJOIN = args.steps, args.kill_at, args.processes, args.rejoin
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(args.dir or d)
        ref = reference(tmp)
        for how in args.cases:
            print(json.dumps(case(tmp, how, ref)), flush=True)


if __name__ == "__main__":
    main()
