"""An elastic run under real SLURM: what the scheduler allows when one task of a job step dies.

    python scripts/cluster/elastic_slurm.py          # needs root (apt-get, daemons); ~2-5 minutes

Starts the one-node SLURM of scripts/cluster/cluster_check.py (munged, slurmctld, slurmd in a temporary
folder, stopped by process id at the end), then runs one job step:

    srun --ntasks=2 --no-kill --kill-on-bad-exit=0 python -m jaxdist.train --elastic 1:2 --mesh fsdp=8 ...

2 tasks x 4 simulated CPU devices, the micro test model, 24 steps (12 until 2026-12-05), checkpoints every 4 (the arguments of
tests/test_elastic.py, so its saved uninterrupted run, tests/fixtures/elastic/reference.npz, is the
reference). Once step 6 is logged, task 1's process (the jaxdist supervisor srun started) is SIGKILLed.
Printed: srun's exit status, the job's state, whether task 0 finished the steps alone (its elastic
line and metrics.jsonl record), the losses and final parameters against the uninterrupted run, how long
it took, and any process of the run left behind. The whole scenario is bounded (WAIT seconds per stage).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cluster_check as cc
import elastic_reference as ref

KILL_AT, WAIT = 6, 600


def run_pids(run: Path) -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, SLURM_PROCID) of every live process whose command line names the run dir."""
    out = {}
    for d in Path("/proc").iterdir():
        try:
            if not d.name.isdigit() or str(run) not in (d / "cmdline").read_text():
                continue
            stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
            if stat[0] == "Z":
                continue
            env = dict(kv.split("=", 1) for kv in (d / "environ").read_text().split("\0") if "=" in kv)
            out[int(d.name)] = (int(stat[1]), env.get("SLURM_PROCID", "?"))
        except (OSError, ValueError):
            pass
    return out


def main() -> None:
    cc.ensure_packages()
    want = np.load(ref.OUT)
    assert json.loads(str(want["args"])) == ref.ARGS
    with tempfile.TemporaryDirectory(prefix="elastic_slurm") as d:
        work = Path(d)
        with cc.Cluster(work / "slurm") as cluster:
            run = work / "run"
            env = {**cc.job_env(4), "JAX_COORDINATOR_PORT": str(cc.free_port())}
            cmd = ["srun", "--nodes=1", "--ntasks=2", "--ntasks-per-node=2", "--cpus-per-task=1", "--no-kill"]
            cmd += ["--kill-on-bad-exit=0", f"--chdir={cc.REPO}", sys.executable, "-m", "jaxdist.train"]
            cmd += ["--elastic", "1:2", "--mesh", "fsdp=8", "--run-dir", str(run), *ref.ARGS]
            log = work / "srun.log"
            t0 = time.monotonic()
            srun = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
            try:
                while not (run / "metrics.jsonl").exists() or max(cc.losses(run), default=0) < KILL_AT:
                    if srun.poll() is not None or time.monotonic() - t0 > WAIT:
                        raise SystemExit(f"srun ended or stalled before step {KILL_AT}:\n{log.read_text()[-3000:]}")
                    time.sleep(0.1)
                procs = run_pids(run)
                (task1,) = [p for p, (pp, rank) in procs.items() if rank == "1" and procs.get(pp, (0, ""))[1] != "1"]
                jobs = cluster.run("squeue", "-h", "-o", "%i %T").split()
                os.kill(task1, signal.SIGKILL)
                killed = time.monotonic()
                rc = srun.wait(timeout=WAIT)
                took = time.monotonic() - killed
            finally:
                if srun.poll() is None:
                    srun.kill()
            job_state = cluster.run("scontrol", "show", "job", "-o", jobs[0]).split("JobState=")[-1].split()[0]
            left = run_pids(run)
            out = log.read_text()
            got = cc.losses(run)
            want_loss = {s: float(v) for s, v in enumerate(want["loss"], 1)}
            steps = max(got, default=0)
            result = {
                "srun_rc": rc,
                "job": jobs[0],
                "job_state": job_state,
                "killed": f"task 1 (pid {task1}, the jaxdist supervisor) after step {KILL_AT}",
                "seconds_kill_to_end": round(took, 1),
                "seconds_total": round(time.monotonic() - t0, 1),
                "regrouped": [line for line in out.splitlines() if "elastic:" in line],
                "record": [
                    r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "elastic" in r
                ],
                "steps_done": sorted(got) == list(range(1, ref.STEPS + 1)),
                "max_rel_loss_diff": cc.max_rel_diff(got, want_loss),
                "left_processes": sorted(left),
            }
            if steps == ref.STEPS and (run / "checkpoints" / str(ref.STEPS)).exists():
                final = cc.final_params(run, ref.STEPS)
                result["max_abs_param_diff"] = max(float(np.abs(v - want[f"param{k}"]).max()) for k, v in final.items())
            print(json.dumps(result, indent=1), flush=True)
            if rc or not result["steps_done"]:
                print(out[-4000:])


if __name__ == "__main__":
    main()
