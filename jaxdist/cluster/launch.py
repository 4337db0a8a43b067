"""Multi-process start-up: find who we are, then `jax.distributed.initialize`.

Each of the three facts (coordinator address, process count, process id) is taken from the first
source that has it, in this order:

1. flags `--coordinator HOST:PORT --num-processes N --process-id I`;
2. the environment variables JAX documents: JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID;
3. the cluster we run in: SLURM (srun), OpenMPI (mpirun), a Kubernetes indexed Job / JobSet.

With none of them, the run is a single process and JAX is not initialised for multi-process at all.
Cluster detection is ours rather than JAX's so it needs no extra packages (JAX's Kubernetes support
needs the `kubernetes` client and API permissions) and gives every process all of its host's GPUs,
or, when the scheduler put several tasks on one host, an equal disjoint share of them by local rank.

A process that cannot reach the coordinator, or whose peers never arrive, fails after
`init_timeout` seconds naming the address. Once running, a process that dies stops the others within
`heartbeat_timeout` seconds: JAX's coordination service notices the missing heartbeats and ends the
survivors with an error.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import time
from collections.abc import Mapping

from jaxdist.errors import JaxdistError

DEFAULT_PORT = 8476  # coordinator port when a cluster gives hosts but no port (JAX_COORDINATOR_PORT overrides)


@dataclasses.dataclass(frozen=True)
class Launch:
    """Where this process sits in a multi-process run."""

    coordinator: str  # HOST:PORT of process 0's coordination service
    num_processes: int
    process_id: int
    source: str  # which sources supplied the facts, e.g. "flags", "slurm", "env+kubernetes"
    local_device_ids: tuple[int, ...] | None = None  # accelerators this process may use; None = all


def _int(value: str | int, what: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise JaxdistError(f"{what}={value!r} is not an integer; give a whole number") from None


def _port(env: Mapping[str, str]) -> int:
    return _int(env.get("JAX_COORDINATOR_PORT", DEFAULT_PORT), "JAX_COORDINATOR_PORT")


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: 'gpu[003-010,012],cpu1' -> 'gpu003'."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise JaxdistError(f"cannot read the SLURM node list {nodelist!r}; set JAX_COORDINATOR_ADDRESS")
    prefix, ranges = m.groups()
    return prefix + (re.split(r"[,-]", ranges)[0] if ranges else "")


def tasks_per_node(text: str) -> list[int]:
    """SLURM_STEP_TASKS_PER_NODE, one count per node of the step: '2(x3),1' -> [2, 2, 2, 1]."""
    counts = []
    for part in filter(None, (text or "").split(",")):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise JaxdistError(f"cannot read SLURM_STEP_TASKS_PER_NODE={text!r}; set JAX_* variables instead")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def visible_gpus(env: Mapping[str, str]) -> int:
    """GPUs this process could use before JAX starts: CUDA_VISIBLE_DEVICES if set, else the host's
    /dev/nvidiaN device files (0 on a CPU-only host)."""
    if "CUDA_VISIBLE_DEVICES" in env:
        return len([d for d in env["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()])
    return sum(1 for f in os.listdir("/dev") if re.fullmatch(r"nvidia\d+", f)) if os.path.isdir("/dev") else 0


def share_of_gpus(local_rank: int, tasks_here: int, gpus: int, where: str) -> tuple[int, ...] | None:
    """The GPUs of one of `tasks_here` tasks on a host with `gpus` of them: an equal, disjoint slice by
    local rank (2 tasks on 8 GPUs: 0-3 and 4-7), never all of them and never only the first. None
    (all visible devices) for one task per host, or a host without GPUs (CPU devices are simulated)."""
    if tasks_here <= 1 or gpus == 0:
        return None
    if gpus % tasks_here:
        raise JaxdistError(
            f"{gpus} GPUs do not split evenly over the {tasks_here} tasks on this host ({where}); "
            f"run {', '.join(str(n) for n in range(1, gpus + 1) if gpus % n == 0)} tasks per host"
        )
    per_task = gpus // tasks_here
    return tuple(range(local_rank * per_task, (local_rank + 1) * per_task))


def from_slurm(env: Mapping[str, str]) -> dict | None:
    # Only inside an `srun` step (which sets the step's node list): the batch script itself also sees
    # SLURM_NTASKS and SLURM_PROCID=0, but it is one process.
    if not all(k in env for k in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_NODELIST")):
        return None
    # Port from the job id (as JAX does) so two jobs sharing a node do not collide.
    port = env.get("JAX_COORDINATOR_PORT") or 61440 + _int(env.get("SLURM_JOB_ID", 0), "SLURM_JOB_ID") % 4096
    found = {
        "num_processes": _int(env["SLURM_NTASKS"], "SLURM_NTASKS"),
        "process_id": _int(env["SLURM_PROCID"], "SLURM_PROCID"),
        "coordinator": f"{first_host(env['SLURM_STEP_NODELIST'])}:{port}",
    }
    # --gpus-per-task: SLURM already gave each task its own GPUs (and CUDA_VISIBLE_DEVICES says which)
    if "SLURM_GPUS_PER_TASK" not in env:
        per_node = tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", ""))
        node = _int(env.get("SLURM_NODEID", 0), "SLURM_NODEID")
        tasks_here = per_node[node] if node < len(per_node) else 1
        local = _int(env.get("SLURM_LOCALID", 0), "SLURM_LOCALID")
        found["local_device_ids"] = share_of_gpus(local, tasks_here, visible_gpus(env), "slurm")
    return {k: v for k, v in found.items() if v is not None}


def from_openmpi(env: Mapping[str, str]) -> dict | None:
    if "OMPI_COMM_WORLD_RANK" not in env or "OMPI_COMM_WORLD_SIZE" not in env:
        return None
    found: dict[str, object] = {
        "num_processes": _int(env["OMPI_COMM_WORLD_SIZE"], "OMPI_COMM_WORLD_SIZE"),
        "process_id": _int(env["OMPI_COMM_WORLD_RANK"], "OMPI_COMM_WORLD_RANK"),
    }
    # OpenMPI 4 publishes the launcher's address (mpirun's host); OpenMPI 5 does not: pass --coordinator.
    m = re.search(r"tcp://([^,:;/]+)", env.get("OMPI_MCA_orte_hnp_uri", ""))
    if m:
        found["coordinator"] = f"{m.group(1)}:{_port(env)}"
    found["local_device_ids"] = share_of_gpus(
        _int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", 0), "OMPI_COMM_WORLD_LOCAL_RANK"),
        _int(env.get("OMPI_COMM_WORLD_LOCAL_SIZE", 1), "OMPI_COMM_WORLD_LOCAL_SIZE"),
        visible_gpus(env),
        "openmpi",
    )
    return {k: v for k, v in found.items() if v is not None}


def from_kubernetes(env: Mapping[str, str]) -> dict | None:
    """Indexed Job: the pod's index is JOB_COMPLETION_INDEX. The process count is not in a pod's
    environment (set JAX_NUM_PROCESSES to the Job's parallelism). A JobSet names its pods
    <jobset>-<replicated job>-<job index>-<pod index>.<subdomain = jobset>, so process 0 is known."""
    if "JOB_COMPLETION_INDEX" not in env:
        return None
    found: dict[str, object] = {"process_id": _int(env["JOB_COMPLETION_INDEX"], "JOB_COMPLETION_INDEX")}
    if env.get("JOBSET_NAME") and env.get("REPLICATED_JOB_NAME"):
        name = env["JOBSET_NAME"]
        found["coordinator"] = f"{name}-{env['REPLICATED_JOB_NAME']}-0-0.{name}:{_port(env)}"
    return found


def from_jax_env(env: Mapping[str, str]) -> dict:
    found = {}
    if env.get("JAX_COORDINATOR_ADDRESS"):
        found["coordinator"] = env["JAX_COORDINATOR_ADDRESS"]
    if env.get("JAX_NUM_PROCESSES"):
        found["num_processes"] = _int(env["JAX_NUM_PROCESSES"], "JAX_NUM_PROCESSES")
    if env.get("JAX_PROCESS_ID"):
        found["process_id"] = _int(env["JAX_PROCESS_ID"], "JAX_PROCESS_ID")
    return found


CLUSTERS = (("slurm", from_slurm), ("openmpi", from_openmpi), ("kubernetes", from_kubernetes))


def detect(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    env: Mapping[str, str] | None = None,
) -> Launch | None:
    """Resolve this process's place from flags, then JAX's variables, then the cluster; None = single process."""
    env = os.environ if env is None else env
    flags = {
        k: v
        for k, v in (("coordinator", coordinator), ("num_processes", num_processes), ("process_id", process_id))
        if v is not None
    }
    sources = [("flags", flags), ("env", from_jax_env(env))]
    cluster = next(((name, found) for name, fn in CLUSTERS if (found := fn(env)) is not None), None)
    if cluster:
        sources.append(cluster)

    facts, used = {}, []
    for name, found in sources:
        new = {k: v for k, v in found.items() if k not in facts}
        if new:
            facts.update(new)
            used.append(name)
    if not facts:
        return None
    where = "+".join(used)
    missing = [k for k in ("coordinator", "num_processes", "process_id") if k not in facts]
    if missing:
        flag = {
            "coordinator": "--coordinator HOST:PORT",
            "num_processes": "--num-processes N",
            "process_id": "--process-id I",
        }
        raise JaxdistError(
            f"multi-process run ({where}) lacks {', '.join(missing)}; pass "
            f"{' '.join(flag[k] for k in missing)} (or the JAX_* environment variables)"
        )
    launch = Launch(
        str(facts["coordinator"]), facts["num_processes"], facts["process_id"], where, facts.get("local_device_ids")
    )
    validate(launch)
    return launch


def validate(launch: Launch) -> None:
    host, _, port = launch.coordinator.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise JaxdistError(
            f"coordinator address {launch.coordinator!r} ({launch.source}) must be HOST:PORT, e.g. 10.0.0.1:8476"
        )
    if launch.num_processes < 1:
        raise JaxdistError(f"process count {launch.num_processes} ({launch.source}) must be at least 1")
    if not 0 <= launch.process_id < launch.num_processes:
        raise JaxdistError(
            f"process id {launch.process_id} ({launch.source}) must be in 0..{launch.num_processes - 1} "
            f"for {launch.num_processes} processes"
        )


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def check_port_free(address: str) -> None:
    """Process 0 serves the coordinator; a busy port would otherwise abort inside JAX without a word."""
    _, port = _split(address)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as e:
            raise JaxdistError(
                f"process 0 cannot serve the coordinator on port {port} ({e.strerror}); "
                f"choose a free port in --coordinator / JAX_COORDINATOR_ADDRESS"
            ) from None


def wait_for_coordinator(address: str, timeout: float) -> None:
    """Retry a TCP connection to the coordinator until it answers or `timeout` passes.

    JAX itself ends the process on a connection timeout (a C++ abort that does not name the address),
    so an unreachable coordinator is caught here first. Retrying covers the coordinator starting later
    than us and cluster DNS names that appear only once the pod runs."""
    host, port = _split(address)
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
                return
        except OSError as e:
            if time.monotonic() + 0.5 >= deadline:
                why = getattr(e, "strerror", None) or str(e) or type(e).__name__
                raise JaxdistError(
                    f"cannot reach the coordinator {address} within {timeout:g}s ({why}); check that process 0 "
                    f"runs on that host and port and that the port is reachable from this host"
                ) from None
            time.sleep(0.5)


def initialize(launch: Launch | None, init_timeout: int = 300, heartbeat_timeout: int = 30) -> None:
    """`jax.distributed.initialize` for `launch` (nothing for a single process). Must run before any JAX work.

    `init_timeout`: seconds to wait for the coordinator and all peers. `heartbeat_timeout`: seconds after
    which a silent process counts as dead and the survivors stop (JAX ends them with an error naming
    the task); it also bounds the wait at shutdown for peers that never finish."""
    if launch is None or launch.num_processes == 1:
        return
    # deferred: jax loads on first use, not when python -m jaxdist.convert, python -m jaxdist.train starts
    import jax

    start = time.monotonic()
    if launch.process_id == 0:
        check_port_free(launch.coordinator)
    else:
        wait_for_coordinator(launch.coordinator, init_timeout)
    # If peers never arrive JAX aborts with DEADLINE_EXCEEDED (RegisterTask); this line says what was expected.
    print(
        f"process {launch.process_id}/{launch.num_processes}: joining coordinator {launch.coordinator} "
        f"({launch.source}); all {launch.num_processes} processes must join within {init_timeout}s",
        flush=True,
    )
    left = max(5, int(init_timeout - (time.monotonic() - start)))
    jax.distributed.initialize(
        coordinator_address=launch.coordinator,
        num_processes=launch.num_processes,
        process_id=launch.process_id,
        local_device_ids=launch.local_device_ids,
        cluster_detection_method="deactivate",  # everything was resolved above
        initialization_timeout=left,
        heartbeat_timeout_seconds=heartbeat_timeout,
        shutdown_timeout_seconds=heartbeat_timeout,
    )
    if jax.process_count() != launch.num_processes:
        raise JaxdistError(
            f"this process was told {launch.num_processes} processes but the coordinator "
            f"{launch.coordinator} runs {jax.process_count()}; give every process the same count"
        )


def topology_line() -> str:
    """One line per process: who it is and which devices it sees (printed by every process at start-up)."""
    # deferred: jax loads on first use, not when python -m jaxdist.convert, python -m jaxdist.train starts
    import jax

    local = jax.local_devices()
    kinds = sorted({d.device_kind for d in local})
    return (
        f"process {jax.process_index()}/{jax.process_count()} on {socket.gethostname()}: "
        f"{len(local)} local {local[0].platform} device(s) ({', '.join(kinds)}) "
        f"ids {[d.id for d in local]}, {jax.device_count()} global"
    )
