"""Multi-host jaxdist under the real schedulers, on this one machine: the check to run before a release.

    python scripts/cluster/cluster_check.py                         # everything (about 10 minutes on 2 cores)
    python scripts/cluster/cluster_check.py --record-env tests/fixtures/launch_env   # also save what srun/mpirun set

It installs Debian's slurm-wlm, munge and openmpi-bin if missing (apt-get), starts munged, slurmctld and
slurmd for a one-node cluster in a temporary folder, and runs 2 processes x 4 simulated CPU devices
(dp=2,fsdp=4):
- SLURM: `scripts/cluster/slurm.sbatch` submitted unchanged, through its knobs only (RUN_DIR, MESH in the
  environment; sbatch options on the command line override its #SBATCH lines: one node, 2 tasks, no GPUs);
- requeue: `scontrol requeue` of a running job after a checkpoint; the requeued job resumes and ends with
  the same final parameters as an uninterrupted job, bit for bit;
- a job killed hard (`scancel --signal=KILL`) and submitted again with the same RUN_DIR resumes the same way;
- one of the two tasks SIGKILLed mid-run: the job ends non-zero within the heartbeat timeout and the run
  dir's latest checkpoint still restores;
- OpenMPI: `mpirun -np 2` runs the same training through the OpenMPI detection path.
Losses are compared with one process on 8 devices at the multi-host test's tolerance (rel 1e-5). It prints
a table, stops every daemon it started by process id, and exits non-zero when any row fails. It is not
part of the CI suite (it installs and starts system daemons).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "scripts" / "cluster" / "slurm.sbatch"
RTOL = 1e-5  # tests/test_distributed.py's tolerance for 2 processes against 1
MODEL = [  # tests/conftest.py's SMALL_MODEL
    "model.num_layers=2",
    "model.d_model=64",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.head_dim=16",
    "model.mlp_dim=128",
    "model.seq_len=32",
]
COMMON = [*MODEL, "train.log_every=1", "train.eval_every=0", "optim.schedule=constant", "optim.warmup_steps=2"]
COMMON += ["checkpoint.async_save=false", "--heartbeat-timeout", "20"]
SHORT = ["--steps", "10", *COMMON, "checkpoint.every=5"]
LONG = ["--steps", "150", *COMMON, "checkpoint.every=10"]  # long enough to be interrupted after a checkpoint
PACKAGES = {"slurmctld": "slurm-wlm", "slurmd": "slurm-wlm", "sbatch": "slurm-wlm", "munged": "munge"}
PACKAGES["mpirun"] = "openmpi-bin"
# As root, two ranks on 2 cores; its out-of-band channel (whose address jaxdist takes for the
# coordinator, from OMPI_MCA_orte_hnp_uri) on loopback: this check talks to nothing off the machine.
MPIRUN_FLAGS = ["--allow-run-as-root", "--oversubscribe", "--mca", "oob_tcp_if_include", "lo"]


BITS = {True: "bit-identical", False: "DIFFER"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_packages() -> None:
    missing = sorted({pkg for tool, pkg in PACKAGES.items() if shutil.which(tool) is None})
    if missing:
        print(f"installing {' '.join(missing)} (apt-get)", flush=True)
        subprocess.run(["apt-get", "update", "-q"], check=True, capture_output=True)
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "install", "-y", "-q", *missing], check=True, capture_output=True, env=env)


def job_env(devices: int) -> dict:
    """What every training process gets: this checkout's jaxdist, simulated CPU devices, this Python first."""
    path = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"
    return {
        **os.environ,
        "PATH": path,
        "PYTHONPATH": str(REPO),
        "JAX_PLATFORMS": "cpu",
        "JAX_NUM_CPU_DEVICES": str(devices),
        "PYTHONUNBUFFERED": "1",
        "TQDM_DISABLE": "1",
    }


class Cluster:
    """munged + slurmctld + slurmd for this host, in `root`; stopped by process id on exit."""

    def __init__(self, root: Path):
        self.root = root
        self.conf = root / "slurm.conf"
        self.pids: dict[str, Path] = {}

    def __enter__(self) -> Cluster:
        r = self.root
        munge = r / "munge"
        munge.mkdir(parents=True)
        for d in (r.parent, r, munge):  # munged runs as the munge user: it must reach its folder
            d.chmod(0o755)
        shutil.chown(munge, "munge", "munge")
        sock = munge / "munge.socket"
        subprocess.run(
            ["runuser", "-u", "munge", "--", "munged", f"--socket={sock}", f"--pid-file={munge}/munged.pid"]
            + [f"--log-file={munge}/munged.log", f"--seed-file={munge}/seed"],
            check=True,
        )
        self.pids["munged"] = munge / "munged.pid"
        host = socket.gethostname()
        for d in ("state", "spool", "log"):
            (r / d).mkdir()
        self.conf.write_text(
            f"""ClusterName=jaxdistcheck
SlurmctldHost={host}(127.0.0.1)
AuthType=auth/munge
AuthInfo=socket={sock}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
MpiDefault=none
KillWait=60
MinJobAge=3600
NodeName={host} NodeAddr=127.0.0.1 CPUs=4 State=UNKNOWN
PartitionName=check Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""
        )
        os.environ["SLURM_CONF"] = str(self.conf)
        for daemon in ("slurmctld", "slurmd"):
            subprocess.run([daemon, "-f", str(self.conf)], check=True)
            self.pids[daemon] = r / f"{daemon}.pid"
        deadline = time.monotonic() + 60
        while "idle" not in self.run("sinfo", "-h", "-o", "%t"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the node never became idle; see {r}/log")
            time.sleep(0.5)
        return self

    def run(self, *cmd: str) -> str:
        return subprocess.run(cmd, capture_output=True, text=True).stdout

    def __exit__(self, *exc) -> None:
        subprocess.run(["scancel", "--full", "--signal=KILL", "--partition=check"], capture_output=True)
        time.sleep(1)
        for name in ("slurmd", "slurmctld", "munged"):
            pidfile = self.pids.get(name)
            if pidfile is None or not pidfile.exists():
                continue
            pid = int(pidfile.read_text().split()[0])
            stop(pid)
            print(f"stopped {name} (pid {pid})", flush=True)

    def submit(self, run_dir: Path, train_args: list[str], wait: bool) -> int:
        env = {**job_env(4), "RUN_DIR": str(run_dir), "MESH": "dp=2,fsdp=4"}
        cmd = ["sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1"]
        cmd += [
            f"--output={run_dir}.%j.out",
            "--open-mode=append",
            f"--chdir={REPO}",
            *(["--wait"] if wait else []),
            str(SBATCH),
        ]
        out = subprocess.run(cmd + train_args, env=env, capture_output=True, text=True)
        if not out.stdout.strip() and out.returncode:
            raise RuntimeError(f"sbatch failed: {out.stderr.strip()}")
        return int(out.stdout.strip().split(";")[0].splitlines()[0])

    def state(self, job: int) -> tuple[str, str, int]:
        """(JobState, ExitCode, Restarts) of a job."""
        text = self.run("scontrol", "show", "job", "-o", str(job))
        field = dict(re.findall(r"(\w+)=(\S+)", text))
        return field.get("JobState", "?"), field.get("ExitCode", "?"), int(field.get("Restarts", 0))

    def wait_done(self, job: int, timeout: float = 900) -> tuple[str, str, int]:
        deadline = time.monotonic() + timeout
        while (st := self.state(job))[0] not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"job {job} still {st[0]} after {timeout:g}s")
            time.sleep(0.5)
        return st


def stop(pid: int, grace: float = 10) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)


def wait_for_checkpoint(run_dir: Path, timeout: float = 600) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        steps = [int(p.name) for p in (run_dir / "checkpoints").glob("[0-9]*") if p.name.isdigit()]
        if steps:
            return max(steps)
        time.sleep(0.1)
    raise RuntimeError(f"no checkpoint appeared in {run_dir} within {timeout:g}s")


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r and not r.get("summary")}


def max_rel_diff(got: dict[int, float], want: dict[int, float]) -> float:
    if sorted(got) != sorted(want):
        return float("inf")
    return max(abs(got[s] - want[s]) / abs(want[s]) for s in want)


def final_params(run_dir: Path, step: int) -> dict:
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import sys; sys.path.insert(0, {str(REPO)!r}); " + PARAMS_SNIPPET,
            str(run_dir),
            str(step),
        ],
        env=job_env(8),
        capture_output=True,
        check=True,
    )
    with np.load(out.stdout.decode().strip()) as f:
        return dict(f)


PARAMS_SNIPPET = """
import sys, tempfile, jax, numpy as np
from pathlib import Path
from jaxdist import checkpoint
params = checkpoint.load_params(Path(sys.argv[1]) / "checkpoints" / sys.argv[2])
flat = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(params)}
path = tempfile.mktemp(suffix=".npz"); np.savez(path, **flat); print(path)
"""


def same_bits(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)


def stopped_step(log: Path) -> int | None:
    """The step at which jaxdist stopped on SIGTERM and saved (None: it did not, e.g. SIGKILL)."""
    found = re.findall(r"stopped by SIGTERM at step (\d+)", log.read_text()) if log.exists() else []
    return int(found[-1]) if found else None


def resumed_step(log: Path) -> int | None:
    found = re.findall(r"restored step (\d+)", log.read_text()) if log.exists() else []
    return int(found[-1]) if found else None


def record_env(cluster: Cluster, work: Path, out_dir: Path) -> None:
    """What srun and mpirun really set, for the detection tests (tests/fixtures/launch_env)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    dump = "import json, os, sys; json.dump({k: v for k, v in sorted(os.environ.items()) if k.startswith(sys.argv[1])}, open(sys.argv[2] % os.environ[sys.argv[3]], 'w'), indent=1)"
    env = job_env(4)
    srun = ["srun", "--nodes=1", "--ntasks=2", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1"]
    subprocess.run(
        [*srun, sys.executable, "-c", dump, "SLURM_", str(out_dir / "slurm_%s.json"), "SLURM_PROCID"],
        env=env,
        check=True,
    )
    mpirun = ["mpirun", "-np", "2", *MPIRUN_FLAGS]
    subprocess.run(
        [*mpirun, sys.executable, "-c", dump, "OMPI_", str(out_dir / "openmpi_%s.json"), "OMPI_COMM_WORLD_RANK"],
        env=env,
        check=True,
    )
    print(f"recorded srun's and mpirun's variables in {out_dir}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--record-env", type=Path, default=None, help="write srun's / mpirun's variables here")
    p.add_argument("--keep", action="store_true", help="keep the work folder (run dirs, logs)")
    args = p.parse_args()
    ensure_packages()
    work = Path(tempfile.mkdtemp(prefix="jaxdist-cluster-"))
    rows: list[tuple[str, str, str, str, str, str, float, bool]] = []

    def row(name, ok, since, loss="-", resume="-", params="-", procs="2", devices="2x4"):
        """One line of the table; `since`: when the check started (time.monotonic())."""
        seconds = time.monotonic() - since
        rows.append((name, procs, devices, loss, resume, params, seconds, ok))
        print(
            f"{'ok  ' if ok else 'FAIL'} {name}: losses {loss}, resume {resume}, params {params}, {seconds:.0f}s",
            flush=True,
        )

    try:
        t = time.monotonic()
        single = work / "single"
        cmd = [sys.executable, "-m", "jaxdist.train", "--mesh", "fsdp=8", "--run-dir", str(single), *SHORT]
        subprocess.run(cmd, env=job_env(8), cwd=REPO, check=True, capture_output=True)
        want = losses(single)
        row("1 process (reference)", len(want) == 10, t, f"{len(want)} steps", procs="1", devices="1x8")

        with Cluster(work / "cluster") as cluster:
            if args.record_env:
                record_env(cluster, work, args.record_env)
            # the sbatch script as shipped, 2 tasks x 4 devices
            t = time.monotonic()
            job = cluster.submit(work / "slurm", SHORT, wait=True)
            st = cluster.state(job)
            d = max_rel_diff(losses(work / "slurm"), want)
            row("slurm sbatch", st[0] == "COMPLETED" and d <= RTOL, t, f"max rel diff {d:.1e}")

            # uninterrupted long job: the final parameters the interrupted ones must reproduce
            t = time.monotonic()
            job = cluster.submit(work / "long", LONG, wait=True)
            ok = cluster.state(job)[0] == "COMPLETED"
            ref = final_params(work / "long", 150) if ok else {}
            row("slurm long (reference)", ok, t, f"{len(losses(work / 'long'))} steps")

            def resubmit(run: Path) -> tuple[str, int | None, bool]:
                """Submit LONG again into RUN and wait: (its state, the step it resumed from, whether its
                final parameters equal the uninterrupted job's bit for bit)."""
                job = cluster.submit(run, LONG, wait=True)
                state = cluster.state(job)[0]
                got = final_params(run, 150) if state == "COMPLETED" else {}
                return state, resumed_step(Path(f"{run}.{job}.out")), bool(ref) and same_bits(got, ref)

            # requeue after a checkpoint: SIGTERM, checkpoint, the same job runs again and resumes
            t = time.monotonic()
            job = cluster.submit(work / "requeue", LONG, wait=False)
            first = wait_for_checkpoint(work / "requeue")
            subprocess.run(["scontrol", "requeue", str(job)], check=True)
            state, code, restarts = cluster.wait_done(job)
            got = final_params(work / "requeue", 150) if state == "COMPLETED" else {}
            log = Path(f"{work / 'requeue'}.{job}.out")
            resume, stopped = resumed_step(log), stopped_step(log)
            d = max_rel_diff(losses(work / "requeue"), losses(work / "long"))
            same = bool(ref) and same_bits(got, ref)
            ok = state == "COMPLETED" and restarts == 1 and resume == stopped and resume >= first and same and d == 0
            row(
                "slurm requeue",
                ok,
                t,
                f"max rel diff {d:.1e} vs long",
                resume=f"SIGTERM saved step {stopped}, resumed step {resume}",
                params=BITS[same],
            )

            # SIGKILL, then the same submission again
            t = time.monotonic()
            job = cluster.submit(work / "killed", LONG, wait=False)
            first = wait_for_checkpoint(work / "killed")
            subprocess.run(["scancel", "--signal=KILL", str(job)], check=True)
            killed_state = cluster.wait_done(job)[0]
            how = "saved on SIGTERM" if stopped_step(Path(f"{work / 'killed'}.{job}.out")) else "killed, nothing saved"
            state, resume, same = resubmit(work / "killed")
            ok = (
                killed_state != "COMPLETED" and state == "COMPLETED" and resume is not None and resume >= first and same
            )
            row(
                "slurm scancel KILL + resubmit",
                ok,
                t,
                f"first job {killed_state} ({how})",
                resume=f"step {resume}",
                params=BITS[same],
            )

            # one task SIGKILLed mid-run (no signal to catch, as on a crashed node): the job ends non-zero,
            # promptly; submitted again with the same RUN_DIR it resumes from the latest periodic checkpoint
            # and ends where the uninterrupted job did (train.steps may change on resume)
            t = time.monotonic()
            job = cluster.submit(work / "failing", ["--steps", "100000", *LONG[2:]], wait=False)
            wait_for_checkpoint(work / "failing")
            victim = task_pid(job, procid=1)
            os.kill(victim, signal.SIGKILL)
            killed_at = time.monotonic()
            state, code, _ = cluster.wait_done(job, timeout=180)
            took = time.monotonic() - killed_at
            steps = sorted(int(q.name) for q in (work / "failing" / "checkpoints").glob("[0-9]*") if q.name.isdigit())
            _, resume, same = resubmit(work / "failing")
            ok = state == "FAILED" and code != "0:0" and took < 20 + 15 and bool(steps) and resume == steps[-1] and same
            row(
                "slurm task SIGKILLed + resubmit",
                ok,
                t,
                f"job {state} exit {code} {took:.1f}s after the kill",
                resume=f"step {resume} (latest checkpoint {steps[-1] if steps else None})",
                params=BITS[same],
            )

        # OpenMPI: mpirun starts both processes; jaxdist reads OMPI_* (coordinator from the HNP URI)
        t = time.monotonic()
        cmd = ["mpirun", "-np", "2", *MPIRUN_FLAGS, sys.executable, "-m", "jaxdist.train"]
        cmd += ["--mesh", "dp=2,fsdp=4", "--run-dir", str(work / "mpi"), *SHORT]
        out = subprocess.run(cmd, env=job_env(4), cwd=REPO, capture_output=True, text=True, timeout=900)
        d = max_rel_diff(losses(work / "mpi"), want) if (work / "mpi" / "metrics.jsonl").exists() else float("inf")
        if out.returncode:
            print(out.stdout[-2000:], out.stderr[-2000:])
        row("openmpi mpirun", out.returncode == 0 and d <= RTOL, t, f"max rel diff {d:.1e}")
        t = time.monotonic()
        ok, what = check_k8s_manifest()
        row("kubernetes manifest", ok, t, what, procs="-", devices="-")
    finally:
        print_table(rows)
        if args.keep:
            print(f"work folder kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0 if rows and all(r[-1] for r in rows) and len(rows) == 8 else 1


def check_k8s_manifest() -> tuple[bool, str]:
    """scripts/cluster/k8s-jobset.yaml: each replicated Job's template validated strictly against Kubernetes' own
    batch/v1 Job schema (kubernetes-validate, pip-installed here if missing: 108 MB of schemas, so not a
    test dependency), and the facts jaxdist.cluster.launch reads from a pod are wired: JOBSET_NAME and
    REPLICATED_JOB_NAME from the JobSet's labels, JAX_NUM_PROCESSES equal to the Job's parallelism. The
    JobSet wrapper itself (a CRD) has no schema here and is not checked."""
    import yaml

    try:
        import kubernetes_validate
    except ImportError:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "kubernetes-validate"], check=True)
        import kubernetes_validate
    doc = yaml.safe_load((REPO / "scripts" / "cluster" / "k8s-jobset.yaml").read_text())
    if (doc.get("apiVersion"), doc.get("kind")) != ("jobset.x-k8s.io/v1alpha2", "JobSet"):
        return False, "not a jobset.x-k8s.io/v1alpha2 JobSet"
    version = kubernetes_validate.latest_version()
    for rj in doc["spec"]["replicatedJobs"]:
        job = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": rj["name"]},
            "spec": rj["template"]["spec"],
        }
        try:
            kubernetes_validate.validate(job, version, strict=True)
        except Exception as e:  # the validator's own error types; any of them is a failed row
            return False, f"{rj['name']}: {str(e).splitlines()[0]}"
        for container in rj["template"]["spec"]["template"]["spec"]["containers"]:
            env = {e["name"]: e for e in container.get("env", [])}
            labels = {
                n: env.get(n, {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath", "")
                for n in ("JOBSET_NAME", "REPLICATED_JOB_NAME")
            }
            if "jobset-name" not in labels["JOBSET_NAME"] or "replicatedjob-name" not in labels["REPLICATED_JOB_NAME"]:
                return (
                    False,
                    f"{container['name']}: JOBSET_NAME / REPLICATED_JOB_NAME not taken from the JobSet's labels",
                )
            if env.get("JAX_NUM_PROCESSES", {}).get("value") != str(rj["template"]["spec"]["parallelism"]):
                return False, f"{container['name']}: JAX_NUM_PROCESSES differs from parallelism"
    return True, f"Job templates valid against Kubernetes {version} (strict)"


def task_pid(job: int, procid: int) -> int:
    """The pid of the training process of `job` with SLURM_PROCID=procid (read from /proc)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                env = dict(x.split("=", 1) for x in (d / "environ").read_text().split("\0") if "=" in x)
                cmdline = (d / "cmdline").read_text()
            except OSError:
                continue
            if (
                env.get("SLURM_JOB_ID") == str(job)
                and env.get("SLURM_PROCID") == str(procid)
                and "jaxdist.train" in cmdline
            ):
                return int(d.name)
        time.sleep(0.5)
    raise RuntimeError(f"no training process with SLURM_PROCID={procid} in job {job}")


def print_table(rows) -> None:
    head = ("check", "procs", "devices", "losses", "resume", "final params", "time", "result")
    table = [head] + [(*r[:6], f"{r[6]:.0f}s", "ok" if r[7] else "FAIL") for r in rows]
    widths = [max(len(str(r[i])) for r in table) for i in range(len(head))]
    print()
    for r in table:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))


if __name__ == "__main__":
    sys.exit(main())
