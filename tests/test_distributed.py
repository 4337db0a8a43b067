"""Multi-process training: cluster detection (pure), and real local processes talking through
jax.distributed (gloo between CPU processes).

The equivalence runs share one small model and a constant learning-rate schedule, so a run restored
from step 5 must reproduce steps 6..10 of the uninterrupted run."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import MICRO_ARGS, gone

from jaxdist.cluster import launch as launch_mod
from jaxdist.errors import JaxdistError

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = ROOT / "scripts" / "cluster" / "launch_local.sh"
SMALL = [
    *MICRO_ARGS,
    "train.log_every=1",
    "train.eval_every=0",
    "optim.schedule=constant",
    "optim.warmup_steps=2",
    "checkpoint.every=5",
    "checkpoint.async_save=false",
]
RTOL = 1e-5
WAIT = 400  # seconds: a hung run fails the test instead of hanging it


# ---- detection: which source supplies coordinator, count and id --------------------------------------


def test_no_source_means_single_process():
    assert launch_mod.detect(env={}) is None


def test_flags_beat_jax_variables_beat_the_cluster():
    env = {
        "JAX_COORDINATOR_ADDRESS": "envhost:1",
        "JAX_NUM_PROCESSES": "4",
        "JAX_PROCESS_ID": "1",
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_STEP_NODELIST": "node[07-08]",
        "SLURM_JOB_ID": "5",
    }
    assert launch_mod.detect("flaghost:9", None, 2, env=env) == launch_mod.Launch("flaghost:9", 4, 2, "flags+env")
    launch = launch_mod.detect(env={k: v for k, v in env.items() if not k.startswith("JAX_NUM")})
    assert (launch.coordinator, launch.num_processes, launch.process_id) == ("envhost:1", 2, 1)
    assert launch.source == "env+slurm"


def test_slurm():
    env = {
        "SLURM_PROCID": "3",
        "SLURM_NTASKS": "4",
        "SLURM_JOB_ID": "4097",
        "SLURM_LOCALID": "1",
        "SLURM_STEP_NODELIST": "gpu[003-004,9],cpu1",
        "SLURM_STEP_TASKS_PER_NODE": "1(x4)",
    }
    assert launch_mod.detect(env=env) == launch_mod.Launch("gpu003:61441", 4, 3, "slurm")
    # two tasks on a node of 8 GPUs: local rank 1 takes the second half; JAX_COORDINATOR_PORT sets the port
    two = {
        **env,
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
        "JAX_COORDINATOR_PORT": "777",
        "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7",
    }
    shared = launch_mod.detect(env=two)
    assert (shared.coordinator, shared.local_device_ids) == ("gpu003:777", (4, 5, 6, 7))
    assert launch_mod.detect(env={**two, "SLURM_GPUS_PER_TASK": "4"}).local_device_ids is None  # bound by SLURM
    with pytest.raises(JaxdistError, match="3 GPUs do not split evenly over the 2 tasks"):
        launch_mod.detect(env={**two, "CUDA_VISIBLE_DEVICES": "0,1,2"})
    assert launch_mod.tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert launch_mod.first_host("a-1") == "a-1" and launch_mod.first_host("n[10-12]") == "n10"
    # the batch script outside srun is one process, whatever SLURM_NTASKS says
    assert launch_mod.detect(env={k: v for k, v in env.items() if k != "SLURM_STEP_NODELIST"}) is None


def test_openmpi():
    env = {
        "OMPI_COMM_WORLD_RANK": "1",
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "1",
        "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911",
    }
    assert launch_mod.detect(env=env) == launch_mod.Launch(f"10.96.0.1:{launch_mod.DEFAULT_PORT}", 2, 1, "openmpi")
    with pytest.raises(JaxdistError, match="lacks coordinator; pass --coordinator"):  # OpenMPI 5: no URI
        launch_mod.detect(env={k: v for k, v in env.items() if k != "OMPI_MCA_orte_hnp_uri"})


LAUNCH_ENV = ROOT / "tests" / "fixtures" / "launch_env"
RECORDED_COORDINATOR = {"slurm": "vm:61441", "openmpi": f"127.0.0.1:{launch_mod.DEFAULT_PORT}"}


@pytest.mark.parametrize("launcher", ["slurm", "openmpi"])
def test_detection_from_what_the_launchers_really_set(launcher):
    """The variables srun (SLURM 22.05) and mpirun (OpenMPI 4.1) set for 2 tasks on one node, recorded by
    `scripts/cluster/cluster_check.py --record-env`: each process finds its rank, the count and one coordinator,
    and on a host with GPUs takes its own disjoint share of them, never all and never only the first."""
    envs = [json.loads((LAUNCH_ENV / f"{launcher}_{rank}.json").read_text()) for rank in (0, 1)]
    cpu = [launch_mod.detect(env={**e, "CUDA_VISIBLE_DEVICES": ""}) for e in envs]
    assert [(x.process_id, x.num_processes, x.source) for x in cpu] == [(0, 2, launcher), (1, 2, launcher)]
    assert {x.coordinator for x in cpu} == {RECORDED_COORDINATOR[launcher]}
    assert [x.local_device_ids for x in cpu] == [None, None]  # CPU: each process simulates its own devices
    gpus = [launch_mod.detect(env={**e, "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}) for e in envs]
    assert [x.local_device_ids for x in gpus] == [(0, 1, 2, 3), (4, 5, 6, 7)]


def test_kubernetes_jobset():
    env = {
        "JOB_COMPLETION_INDEX": "2",
        "JOBSET_NAME": "llama",
        "REPLICATED_JOB_NAME": "workers",
        "JAX_NUM_PROCESSES": "4",
    }
    launch = launch_mod.detect(env=env)
    assert launch == launch_mod.Launch(f"llama-workers-0-0.llama:{launch_mod.DEFAULT_PORT}", 4, 2, "env+kubernetes")
    with pytest.raises(JaxdistError, match="lacks num_processes; pass --num-processes N"):
        launch_mod.detect(env={k: v for k, v in env.items() if k != "JAX_NUM_PROCESSES"})


@pytest.mark.parametrize(
    "args, env, match",
    [
        (("h:1", 2, 2), {}, r"process id 2 \(flags\) must be in 0..1"),
        (("nohostport", 2, 0), {}, "must be HOST:PORT"),
        ((None, None, None), {"JAX_NUM_PROCESSES": "two"}, "JAX_NUM_PROCESSES='two' is not an integer"),
        ((None, 2, 0), {}, "lacks coordinator"),
    ],
)
def test_bad_input_names_the_problem(args, env, match):
    with pytest.raises(JaxdistError, match=match):
        launch_mod.detect(*args, env=env)


# ---- real processes ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_env(devices: int) -> dict:
    return {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(devices), "PYTHONUNBUFFERED": "1"}


def train_cmd(*args) -> list[str]:
    return [sys.executable, "-m", "jaxdist.train", *args]


def start(cmd, env, log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)


def finish(procs: dict[str, subprocess.Popen], logs: Path) -> None:
    for name, p in procs.items():
        rc = p.wait(timeout=WAIT)
        assert rc == 0, f"{name} failed ({rc}):\n{(logs / f'{name}.log').read_text()[-3000:]}"


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r and not r.get("summary")}


def assert_same_curve(got: dict[int, float], want: dict[int, float], steps) -> None:
    assert sorted(got) == list(steps)
    for s in steps:
        assert got[s] == pytest.approx(want[s], rel=RTOL), f"step {s}: {got[s]} vs {want[s]}"


def one_process(*args) -> None:
    """A 1-process x 8-device run in this process (the test's own 8 CPU devices): the same command
    without a child's ~5 CPU-s of imports."""
    from jaxdist import train

    assert train.main(list(args)) == 0


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """10 steps on 1 process x 8 devices (fsdp=8; this process) and on 2 processes x 4 devices
    (dp=2,fsdp=4: each process one replica), at once; then both directions of restore from step 5: the
    2-process checkpoint into 1 process, and the 1-process one into 2 processes at fsdp=8 (the weights'
    shards across both)."""
    tmp = tmp_path_factory.mktemp("dist")
    common = ["--steps", "10", *SMALL]
    first = {
        "2x4_dp": start(
            [str(LAUNCH), "2", "--mesh", "dp=2,fsdp=4", "--run-dir", str(tmp / "2x4_dp"), *common],
            cpu_env(4),
            tmp / "2x4_dp.log",
        ),
    }
    t0 = time.perf_counter()
    try:
        one_process("--mesh", "fsdp=8", "--run-dir", str(tmp / "1x8"), *common)
    finally:
        finish(first, tmp)
    first_s = time.perf_counter() - t0
    second = {
        "1to2": start(
            [
                str(LAUNCH),
                "2",
                "--mesh",
                "fsdp=8",
                "--run-dir",
                str(tmp / "1to2"),
                "--restore",
                str(tmp / "1x8" / "checkpoints" / "5"),
                *common,
            ],
            cpu_env(4),
            tmp / "1to2.log",
        ),
    }
    try:
        one_process(
            "--mesh",
            "fsdp=8",
            "--run-dir",
            str(tmp / "2to1"),
            "--restore",
            str(tmp / "2x4_dp" / "checkpoints" / "5"),
            *common,
        )
    finally:
        finish(second, tmp)
    return tmp, first_s


def test_two_processes_match_one(runs):
    tmp, _ = runs
    want = losses(tmp / "1x8")
    assert len(want) == 10 and want[10] < want[1]  # it trains
    assert_same_curve(losses(tmp / "2x4_dp"), want, range(1, 11))


def test_only_process_zero_speaks(runs):
    tmp, _ = runs
    log = (tmp / "2x4_dp.log").read_text()
    for i in (0, 1):  # every process reports its place ...
        assert f"[p{i}] process {i}/2 on " in log and f"[p{i}] process {i}/2: joining coordinator" in log
    assert "4 local cpu device(s)" in log and "8 global" in log
    assert "[p0] mesh dp=2,fsdp=4 over 8 cpu devices" in log  # ... but only process 0 the run
    assert "[p1] mesh" not in log and "[p1] done" not in log and "[p0] done: 10 steps" in log
    assert "[Gloo]" not in log  # gloo's chatter: one short line per process (and stream) at most
    assert all(log.count(f"[p{i}] gloo: rank ") <= 2 for i in (0, 1))


def test_clean_runs_leave_no_process_behind(runs):
    """Each multi-process command is a supervisor (jaxdist.cluster.peers) and a training process: after the runs
    ended well, no process of theirs runs, and they said nothing about peers."""
    tmp, _ = runs
    left = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and str(tmp) in (d / "cmdline").read_text() and not gone(int(d.name), 0.5):
                left.append(int(d.name))
        except OSError:
            pass
    assert left == []
    for name in ("2x4_dp", "1to2"):
        assert "stopped answering" not in (log := (tmp / f"{name}.log").read_text()) and "cannot reach" not in log


def test_checkpoint_moves_between_process_counts(runs):
    tmp, _ = runs
    want = losses(tmp / "1x8")
    assert_same_curve(losses(tmp / "2to1"), want, range(6, 11))  # saved by 2 processes, restored in 1
    assert_same_curve(losses(tmp / "1to2"), want, range(6, 11))  # saved by 1 process, restored in 2 (fsdp=8)


def test_launcher_fails_when_a_process_fails(tmp_path):
    r = subprocess.run(
        [str(LAUNCH), "2", "--run-dir", str(tmp_path / "run"), "train.stepz=1"],
        env=cpu_env(4),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=WAIT,
    )
    assert r.returncode == 2
    assert "error: unknown config key 'train.stepz'" in r.stderr and "launch_local: process" in r.stderr


def two_trainers_mid_run(tmp_path, *args) -> list[subprocess.Popen]:
    """Two processes x 4 devices training `args` (fsdp=8, a run of 100000 steps), returned once the run
    has logged two steps."""
    port = free_port()
    common = ["--steps", "100000", "--run-dir", str(tmp_path / "run"), "--mesh", "fsdp=8", *SMALL, *args]
    flags = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id"]
    procs = [start(train_cmd(*flags, str(i), *common), cpu_env(4), tmp_path / f"p{i}.log") for i in (0, 1)]
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + WAIT
    try:
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert procs[0].poll() is None and time.monotonic() < deadline, (tmp_path / "p0.log").read_text()
            time.sleep(0.5)
    except BaseException:
        stop(procs)
        raise
    return procs


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()


def test_sigterm_stops_two_processes_at_one_step_with_a_checkpoint(tmp_path):
    """A scheduler's SIGTERM (SLURM requeue, preemption) reaches jaxdist in a multi-process run: every
    process stops at the same step, saves it and exits 0. jax.distributed.initialize installs XLA's
    preemption notifier, whose C++ handler swallowed the signal until SLURM's SIGKILL 60 s later."""
    procs = two_trainers_mid_run(tmp_path, "checkpoint.every=100000")  # any checkpoint is the signal's
    try:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        rcs = [p.wait(timeout=120) for p in procs]
    finally:
        stop(procs)
    out = (tmp_path / "p0.log").read_text()
    assert rcs == [0, 0], out[-3000:]
    stopped = int(re.search(r"stopped by SIGTERM at step (\d+)", out).group(1))
    assert [q.name for q in (tmp_path / "run" / "checkpoints").iterdir() if q.name.isdigit()] == [str(stopped)]


def children(pid: int) -> list[int]:
    return [int(c) for f in Path(f"/proc/{pid}/task").glob("*/children") for c in f.read_text().split()]


@pytest.mark.parametrize("victim", ["process", "training process"])
def test_a_killed_process_is_named_by_the_survivor(tmp_path, victim):
    """SIGKILL process 1 mid-run (the pid its launcher started, or its training process: the kernel's
    out-of-memory killer picks the big one): process 0 stops in about a second, and its last line names
    process 1 (index, host, pid) as the one that stopped, not the user's code; process 1 says what happened
    where it can. Without jaxdist.cluster.peers, process 0 aborted in C++ at JAX's heartbeat timeout (gloo's
    "collective mismatch in your code?" or "another task died"), naming no pid or host."""
    # JAX's own heartbeat at 30 s, the bound at 20: only jaxdist.cluster.peers can stop process 0 in time,
    # with room for a loaded 2-core machine (about a second when idle)
    procs = two_trainers_mid_run(tmp_path, "--heartbeat-timeout", "30")
    try:
        workers = [(children(p.pid) or [p.pid])[0] for p in procs]  # the training processes
        target = procs[1].pid if victim == "process" else workers[1]
        os.kill(target, signal.SIGKILL)
        t0 = time.monotonic()
        rc = procs[0].wait(timeout=60)
        waited = time.monotonic() - t0
        rc1 = procs[1].wait(timeout=60)
    finally:
        stop(procs)
    out = (tmp_path / "p0.log").read_text()
    host = socket.gethostname()
    line = re.escape(f"error: process 1 (host {host}, pid {procs[1].pid}) stopped answering at ") + r"\d\d:\d\d:\d\d "
    assert rc == 1 and waited < 20, (rc, waited, out[-3000:])
    assert re.search(line, out.splitlines()[-1]), out[-3000:]  # the last word is the named peer
    assert "process 0 cannot continue the collectives it shares with it. Resume with the same command once all 2" in out
    mine = (tmp_path / "p1.log").read_text()
    if victim == "process":  # its training process saw its parent go, said so and told process 0
        assert "(gone: killed or crashed)" in out
        assert f"error: process 1 (host {host}, pid {procs[1].pid}) stopped at " in mine
        assert f": it was killed; its training process (pid {workers[1]}) stops too." in mine
    else:  # its supervisor saw the training process die and says how
        assert "(killed by SIGKILL)" in out and rc1 == 128 + signal.SIGKILL
        assert f"its training process (pid {workers[1]}) was killed by SIGKILL (by hand, or the kernel's" in mine
    assert all(gone(w) for w in workers)  # no training process outlives its run


def test_unreachable_coordinator_is_named(tmp_path):
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    t0 = time.monotonic()
    r = subprocess.run(
        train_cmd(
            "--coordinator",
            address,
            "--num-processes",
            "2",
            "--process-id",
            "1",
            "--init-timeout",
            "3",
            "--run-dir",
            str(tmp_path / "run"),
            *SMALL,
        ),
        env=cpu_env(4),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=WAIT,
    )
    # 180 s: the 3 s timeout plus a start-up on a loaded 2-core machine; a hang would run to WAIT
    assert r.returncode == 2 and time.monotonic() - t0 < 180
    assert f"error: cannot reach the coordinator {address} within 3s (Connection refused)" in r.stderr
    assert not (tmp_path / "run").exists()


def test_mismatched_process_counts_stop_in_bounded_time(tmp_path):
    """Process 0 serves the coordinator, so its count is the run's. A peer told more processes gets our
    error; one told fewer never completes registration, and JAX aborts everyone at the init timeout."""
    cases = {"more": (2, 3), "fewer": (3, 2)}  # (count given to process 0, to process 1)
    procs = {}
    for case, counts in cases.items():
        port = free_port()
        for i, n in enumerate(counts):
            procs[case, i] = start(
                train_cmd(
                    "--coordinator",
                    f"127.0.0.1:{port}",
                    "--num-processes",
                    str(n),
                    "--process-id",
                    str(i),
                    "--init-timeout",
                    "10",
                    "--heartbeat-timeout",
                    "5",
                    "--run-dir",
                    str(tmp_path / case),
                    *SMALL,
                ),
                cpu_env(4),
                tmp_path / f"{case}{i}.log",
            )
    t0 = time.monotonic()
    rcs = {k: p.wait(timeout=WAIT) for k, p in procs.items()}
    # 240 s: the 10 s timeouts plus start-up of 4 processes on a loaded 2-core machine; a hang runs to WAIT
    assert time.monotonic() - t0 < 240 and all(rc != 0 for rc in rcs.values()), rcs
    more = (tmp_path / "more1.log").read_text()
    assert "error: this process was told 3 processes but the coordinator" in more and "runs 2" in more
    fewer = (tmp_path / "fewer0.log").read_text()
    assert "all 3 processes must join within 10s" in fewer and "DEADLINE_EXCEEDED" in fewer
