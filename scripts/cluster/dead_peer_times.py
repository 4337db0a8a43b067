"""How long a 2-process run takes to name a dead peer, and what each side prints (docs/multi-host.md).

    python scripts/cluster/dead_peer_times.py              # each case once; --reps N repeats them
    JAXDIST_WATCH_PEERS=0 python scripts/cluster/dead_peer_times.py --cases training   # the same without jaxdist.cluster.peers

Two processes x 4 simulated CPU devices train the small test model (fsdp=8, --heartbeat-timeout 10); once
two steps are logged, process 1 is ended one way: `process` SIGKILLs the pid the launcher started,
`training` its training process (as the out-of-memory killer would), `both` both of them (a node's
cgroup killed), `frozen` SIGSTOPs both (a hung host: nothing closes, nothing answers). Printed per case:
seconds from the kill to process 0's exit, its exit status, and the last line of each process.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODEL = "model.num_layers=2 model.d_model=64 model.num_heads=4 model.num_kv_heads=2 model.head_dim=16 model.mlp_dim=128 model.seq_len=32"
ARGS = [*MODEL.split(), "train.log_every=1", "train.eval_every=0", "checkpoint.async_save=false", "checkpoint.every=5"]


def start(tmp: Path) -> list[subprocess.Popen]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "4", "PYTHONUNBUFFERED": "1"}
    procs = []
    for i in (0, 1):
        cmd = [sys.executable, "-m", "jaxdist.train", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]
        cmd += ["--process-id", str(i), "--steps", "100000", "--run-dir", str(tmp / "run"), "--mesh", "fsdp=8"]
        cmd += ["--heartbeat-timeout", "10", *ARGS]
        log = (tmp / f"p{i}.log").open("w")
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
    metrics = tmp / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 400
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        if procs[0].poll() is not None or time.monotonic() > deadline:
            raise SystemExit((tmp / "p0.log").read_text()[-2000:])
        time.sleep(0.5)
    return procs


def child(pid: int) -> int | None:
    kids = [int(c) for f in Path(f"/proc/{pid}/task").glob("*/children") for c in f.read_text().split()]
    return kids[0] if kids else None


def case(name: str, tmp: Path) -> None:
    tmp.mkdir(parents=True)
    procs = start(tmp)
    launched, training = procs[1].pid, child(procs[1].pid) or procs[1].pid
    targets = {"process": [launched], "training": [training], "both": [training, launched]}.get(name, [])
    t0 = time.monotonic()
    for pid in targets:
        os.kill(pid, signal.SIGKILL)
    if name == "frozen":
        for pid in (launched, training):
            os.kill(pid, signal.SIGSTOP)
    try:
        rc = procs[0].wait(timeout=120)
        took = time.monotonic() - t0
    finally:
        for pid in (launched, training) if name == "frozen" else ():
            os.kill(pid, signal.SIGCONT)
        for p in procs:
            p.kill()
            p.wait()
    print(f"{name}: process 0 exited {rc} after {took:.2f} s")
    for i in (0, 1):
        lines = (tmp / f"p{i}.log").read_text().splitlines()
        print(f"  [p{i}] {lines[-1] if lines else ''}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="process,training,both,frozen")
    p.add_argument("--reps", type=int, default=1)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        for rep in range(args.reps):
            for name in args.cases.split(","):
                case(name, Path(d) / f"{name}{rep}")


if __name__ == "__main__":
    main()
