"""Name a dead peer: in a multi-process run, say which process stopped, where and when, and stop at once.

Why: when one process of a run dies, the others end inside C++ (gloo's "Received data size doesn't
match expected size. Is there a distributed collective mismatch in your code?", or JAX's heartbeat
abort), a SIGABRT after which no Python of theirs runs, with words that blame the user's code or name
no host. So each multi-process command is two processes: a small supervisor (the pid the launcher
started; it never imports JAX) and, as its child, the training process, the same command.

- start: `supervise(argv)` (first thing in `train.main`) runs the command again as its child, in the
  child's own process group, and passes SIGTERM / SIGINT / SIGHUP / SIGUSR1 / SIGUSR2 on to it (Ctrl-C
  arrives once; a SIGTERM still saves a checkpoint). It listens on a TCP port for its peers.
- the table: after `jax.distributed.initialize`, `join` publishes where this process's supervisor
  listens (host, addresses, port, pid) in JAX's key-value store, reads every peer's, and hands the
  table to its supervisor over their socket pair.
- a death: a supervisor whose training process ends abnormally tells every peer's supervisor at once
  (process 1 killed by SIGKILL at 12:01:02); those stop their training processes, which could only
  abort, print one line naming it and exit 1. A supervisor killed outright: its training process sees
  the socket pair close, says so and tells the peers itself. A host that vanished tells no one: the
  survivors' training processes end by gloo or JAX's heartbeat, and their supervisors then ask each
  peer; one that no longer answers is named. A training process killed by a signal (the out-of-memory
  killer) is its supervisor's own death: a peer's error exit, heard meanwhile, is its consequence.

Single-process runs never start it; JAXDIST_WATCH_PEERS=0 turns it off.

This module is the training process's side (`join`, and its end when the supervisor is killed); the
supervisor is `supervisor.py`, what they say to each other `peer_wire.py`, the lines `peer_lines.py`.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

from jaxdist.cluster import launch as launch_mod
from jaxdist.cluster import peer_lines, peer_wire, supervisor

KEY = "jaxdist_peers/{}"
_keep: list = []  # the training process's end of its socket pair: alive as long as the process


def addresses(coordinator: str) -> list[str]:
    """Where peers may reach this host: the address that routes to the coordinator (or to the outside
    world), then the host name's; peers keep the first that answers."""
    host, port = launch_mod._split(coordinator)
    found = []
    for target in ((host, port), ("10.255.255.255", 1)):  # UDP connect sends nothing: it picks a route
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect(target)
                found.append(s.getsockname()[0])
        except OSError:
            pass
    with contextlib.suppress(OSError):
        found += [a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)]
    return list(dict.fromkeys(found)) or ["127.0.0.1"]


def join(launch: launch_mod.Launch | None, run_dir: Path | str, timeout_s: int = 120) -> None:
    """After `jax.distributed.initialize`: publish this process's supervisor, read every peer's, and hand
    the table to the supervisor. Every process of a multi-process run publishes (supervised or not), so
    no one waits for a record that never comes."""
    if launch is None or launch.num_processes < 2:
        return
    # deferred: the supervisor, which imports this module too, never loads JAX
    from jax._src.distributed import global_state  # the key-value store of the coordination service

    spec = os.environ.get(supervisor.CHILD, "").split()
    fd, port, token = spec if len(spec) == 3 else (None, None, None)
    me = {
        "index": launch.process_id,
        "host": socket.gethostname(),
        "pid": os.getppid() if fd else os.getpid(),  # the pid the launcher started
        "worker": os.getpid(),
        "addrs": addresses(launch.coordinator),
        "port": int(port) if port else None,
        "token": token,
    }
    client = global_state.client
    if client is None:
        raise RuntimeError("peers.join runs after jax.distributed.initialize, which makes the coordination client")
    client.key_value_set(KEY.format(launch.process_id), json.dumps(me))
    table = []
    for j in range(launch.num_processes):
        with contextlib.suppress(Exception):  # a peer that never published is not watched
            table.append(json.loads(client.blocking_key_value_get(KEY.format(j), timeout_s * 1000)))
    if fd is None:
        return
    sock = socket.socket(fileno=int(fd))
    sock.set_inheritable(False)  # our own subprocesses must not keep it open
    _keep.append(sock)
    sock.sendall(json.dumps({"peers": table, "run_dir": str(run_dir)}).encode() + b"\n")
    threading.Thread(target=_orphaned, args=(sock, me, table, launch.num_processes, str(run_dir)), daemon=True).start()


def _orphaned(sock: socket.socket, me: dict, table: list[dict], n: int, run_dir: str) -> None:
    """Wait for the supervisor to go; if it does (killed outright), say so, tell the peers, and end."""
    try:
        while sock.recv(1024):
            pass
    except OSError:
        pass
    at = time.time()
    print(
        f"error: {peer_lines.who(me)} stopped at {peer_lines.clock(at)}: it was killed; its training process "
        f"(pid {me['worker']}) stops too. {peer_lines.resume(n, run_dir)}",
        file=sys.stderr,
        flush=True,
    )
    rec = peer_lines.death(me, at)
    gen = int(os.environ.get(supervisor.GEN, "0"))
    peer_wire.tell([p for p in table if p["index"] != me["index"]], [rec], gen)
    os._exit(supervisor.PEER_DIED)
