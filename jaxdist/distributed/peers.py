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
  peer; one that no longer answers is named.

Single-process runs never start it; JAXDIST_WATCH_PEERS=0 turns it off.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from jaxdist.distributed import launch as distributed
from jaxdist.errors import JaxdistError

SWITCH = "JAXDIST_WATCH_PEERS"  # "0": no supervisor
CHILD = "JAXDIST_SUPERVISOR"  # set in the training process: "FD PORT TOKEN" (its socket pair, its supervisor)
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
ASK_S = 2.0  # one question to a peer: connect, ask, answer
GRACE_S = 0.5  # a training process told that a peer died may end by itself this long (its own error wins)
PEER_DIED = 1  # exit status of a process stopped because another one died
KEY = "jaxdist_peers/{}"
_keep: list = []  # the training process's end of its socket pair: alive as long as the process


# ---- the words ----------------------------------------------------------------------------------------


def clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


def ending(rc: int) -> str:
    """How a process ended, from its exit status (negative: the signal that killed it)."""
    if rc >= 0:
        return f"exited with status {rc}; see its output"
    try:
        name = signal.Signals(-rc).name
    except ValueError:
        name = f"signal {-rc}"
    return "aborted (SIGABRT)" if name == "SIGABRT" else f"killed by {name}"


def who(rec: dict) -> str:
    return f"process {rec['index']} (host {rec['host']}, pid {rec['pid']})"


def resume(n: int, run_dir: str | None) -> str:
    steps = []
    if run_dir:
        ckpts = Path(run_dir) / "checkpoints"
        steps = sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit()) if ckpts.is_dir() else []
    latest = f"the latest checkpoint is step {steps[-1]}" if steps else "no checkpoint yet: it starts again from step 0"
    return f"Resume with the same command once all {n} processes can run ({latest})."


def blame_line(me: int, n: int, dead: dict, run_dir: str | None) -> str:
    return (
        f"error: {who(dead)} stopped answering at {clock(dead['at'])} ({dead['how']}); process {me} cannot "
        f"continue the collectives it shares with it. {resume(n, run_dir)}"
    )


def own_line(me: dict, worker: int, rc: int, at: float, n: int, run_dir: str | None) -> str:
    why = " (by hand, or the kernel's out-of-memory killer: see dmesg)" if rc == -signal.SIGKILL else ""
    return (
        f"error: {who(me)} stopped at {clock(at)}: its training process (pid {worker}) was {ending(rc)}{why}; "
        f"the other processes stop too. {resume(n, run_dir)}"
    )


def root(gone: dict[int, dict]) -> dict | None:
    """The death that started it: the earliest of those not caused by another."""
    first = [r for r in gone.values() if r.get("cause") is None] or list(gone.values())
    return min(first, key=lambda r: r["at"]) if first else None


# ---- talking to peers: one JSON line each way ---------------------------------------------------------


def _readline(conn: socket.socket, limit: int = 1 << 16) -> bytes:
    data = b""
    while not data.endswith(b"\n") and len(data) < limit:
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def ask(addr: str, port: int, msg: dict, timeout: float | None = None) -> dict | str | None:
    """A peer's answer; "refused" when its host answers but nothing listens (gone); None: no answer
    within `timeout` (ASK_S)."""
    timeout = ASK_S if timeout is None else timeout
    try:
        with socket.create_connection((addr, port), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(json.dumps(msg).encode() + b"\n")
            return json.loads(_readline(s))
    except ConnectionRefusedError:
        return "refused"
    except (OSError, ValueError):
        return None


def _each(peers: list[dict], fn) -> list:
    if not peers:
        return []
    with ThreadPoolExecutor(min(32, len(peers))) as pool:
        return list(pool.map(fn, peers))


def tell(peers: list[dict], records: list[dict]) -> None:
    """Tell every peer's supervisor about these deaths (at its known address, else at each it published,
    ASK_S per try; the unreachable are skipped)."""

    def one(p: dict) -> None:
        for addr in [p["addr"]] if "addr" in p else p.get("addrs") or []:
            if isinstance(ask(addr, p["port"], {"op": "gone", "token": p["token"], "records": records}), dict):
                return

    _each([p for p in peers if p.get("port")], one)


class Listener:
    """A supervisor's port: answers "how are you" and takes peers' news of deaths (with its token)."""

    def __init__(self, index: int):
        self.index = index
        self.token = secrets.token_hex(16)  # news of a death must carry it: a stray connection stops nothing
        self.gone: dict[int, dict] = {}  # deaths heard of, by process index
        self.mine: dict | None = None  # this process's own end, once known
        self.news = threading.Event()
        self.watchers: list[socket.socket] = []  # peers' connections held open to see this process end
        self._lock = threading.Lock()
        self.sock = socket.create_server(("", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True, name="jaxdist-peers").start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            try:
                conn.settimeout(ASK_S)
                msg = json.loads(_readline(conn))
                conn.sendall(json.dumps(self._answer(msg)).encode() + b"\n")
                if msg.get("op") == "watch" and msg.get("token") == self.token:
                    self.watchers.append(conn)  # held open: it closes when this process ends, however
                    continue
            except (OSError, ValueError, AttributeError, TypeError):
                pass
            conn.close()

    def _answer(self, msg: dict) -> dict:
        if msg.get("op") == "gone" and msg.get("token") == self.token:
            self.hear(msg["records"])
        return {"index": self.index, "gone": self.mine}

    def hear(self, records: list[dict]) -> None:
        with self._lock:
            for r in records:
                i = r["index"]
                if i != self.index and (i not in self.gone or r["at"] < self.gone[i]["at"]):
                    self.gone[i] = r
            if any(r.get("fatal", True) for r in self.gone.values()):
                self.news.set()  # a death; a peer's own error exit (2, 130) lets ours end by itself

    def close(self, clean: bool) -> None:
        """Stop listening; a watching peer reads "clean" first when the run ended well here."""
        for conn in self.watchers:
            with contextlib.suppress(OSError):
                if clean:
                    conn.sendall(b"clean\n")
                conn.close()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() of the serving thread (close alone does not)
        self.sock.close()


# ---- the supervisor -----------------------------------------------------------------------------------


class _Flags(argparse.ArgumentParser):
    def error(self, message):
        raise JaxdistError(message)


def launch_of(argv: list[str]) -> distributed.Launch | None:
    """This command's place in the run, as `train` will resolve it (None: one process, or input that
    `train` itself will refuse in its own words)."""
    p = _Flags(add_help=False)
    p.add_argument("--coordinator")
    p.add_argument("--num-processes", type=int)
    p.add_argument("--process-id", type=int)
    try:
        args, _ = p.parse_known_args(argv)
        return distributed.detect(args.coordinator, args.num_processes, args.process_id)
    except JaxdistError:
        return None


def supervise(argv: list[str]) -> int | None:
    """Run this multi-process command as a supervised child and return its exit status; None (do
    nothing) in the training process itself, for a single process, or with JAXDIST_WATCH_PEERS=0."""
    if CHILD in os.environ or os.environ.get(SWITCH, "1") == "0":
        return None
    launch = launch_of(argv)
    if launch is None or launch.num_processes < 2:
        return None
    return Supervisor(launch).run(argv)


class Supervisor:
    """The pid the launcher started, in a multi-process run: runs the training process, passes signals on,
    hears of and asks about peers, and says who died."""

    def __init__(self, launch: distributed.Launch):
        self.index, self.n = launch.process_id, launch.num_processes
        self.listener = Listener(self.index)
        self.peers: list[dict] = []  # reachable peers' records, once the training process sent the table
        self.me = {"index": self.index, "host": socket.gethostname(), "pid": os.getpid()}
        self.run_dir: str | None = None

    def run(self, argv: list[str]) -> int:
        ours, theirs = socket.socketpair()
        env = {**os.environ, CHILD: f"{theirs.fileno()} {self.listener.port} {self.listener.token}"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "jaxdist.train", *argv], env=env, pass_fds=(theirs.fileno(),), process_group=0
        )
        theirs.close()
        previous = {}
        if threading.current_thread() is threading.main_thread():
            for s in FORWARDED:  # the child has its own process group: a terminal's Ctrl-C reaches it once, from here
                previous[s] = signal.signal(s, lambda signum, _: proc.send_signal(signum))
        self._reader = threading.Thread(target=self._table, args=(ours,), daemon=True)
        self._reader.start()
        rc = None
        try:
            rc, stopped = self._wait(proc)
            return self._after(rc, stopped, proc.pid)
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
            self.listener.close(clean=rc in (0, 2, 130))  # the ring watch hears of deaths only
            ours.close()

    def _table(self, ours: socket.socket) -> None:
        """The peers' table from the training process, then which of their supervisors we can reach."""
        try:
            msg = json.loads(_readline(ours, 1 << 28))  # ~250 bytes a process
        except (OSError, ValueError):
            return
        self.run_dir = msg.get("run_dir")
        self.me.update(next(p for p in msg["peers"] if p["index"] == self.index))

        def reach(p: dict) -> dict | None:
            for addr in p.get("addrs") or []:
                answer = ask(addr, p["port"], {"op": "status"}) if p.get("port") else None
                if isinstance(answer, dict) and answer.get("index") == p["index"]:  # not another one's port
                    return {**p, "addr": addr}
            return None

        others = [p for p in msg["peers"] if p["index"] != self.index]
        found = _each(others, reach)
        self.peers = [p for p in found if p]
        if self.peers:  # watch the next one round the ring: each process is watched by one other
            after = [p for p in self.peers if p["index"] > self.index] or self.peers
            threading.Thread(target=self._watch, args=(after[0],), daemon=True).start()
        lost = [str(p["index"]) for p, f in zip(others, found) if not f]
        if lost and self.index == 0:
            print(
                f"warning: process 0 cannot reach the supervisors of process(es) {', '.join(lost)} (a firewall "
                f"between hosts?); if one of them dies, this run stops without naming it",
                file=sys.stderr,
                flush=True,
            )

    def _watch(self, p: dict) -> None:
        """Hold a connection to a peer's supervisor: if it closes without "clean", that process has
        ended (killed outright, both of its processes): a death heard of at once, not at the heartbeat."""
        data = b""
        try:
            with socket.create_connection((p["addr"], p["port"]), timeout=ASK_S) as s:
                s.sendall(json.dumps({"op": "watch", "token": p["token"]}).encode() + b"\n")
                s.settimeout(None)
                while chunk := s.recv(4096):
                    data += chunk
        except OSError:
            return
        if not data.endswith(b"clean\n"):
            self.listener.hear([{**_public(p), "how": "gone: killed or crashed", "at": time.time()}])

    def _wait(self, proc: subprocess.Popen) -> tuple[int, bool]:
        """The child's exit status, and whether we stopped it because a peer died (after GRACE_S)."""
        told = None
        while (rc := proc.poll()) is None:
            if told is None:
                if self.listener.news.wait(0.1):
                    told = time.monotonic()
            elif time.monotonic() - told > GRACE_S:
                proc.kill()  # stuck in a collective with the dead peer: it could only abort
                return proc.wait(), True
            else:
                time.sleep(0.05)
        return rc, False

    def _after(self, rc: int, stopped: bool, worker: int) -> int:
        code = rc if rc >= 0 else 128 - rc
        self._reader.join(timeout=2 * ASK_S)  # the table may still be on its way
        if rc == 0 or not self.peers:
            return code
        at = time.time()
        verdict = rc in (2, 130) and not stopped  # bad input, interrupted: the training process's own word
        self.listener.mine = {**_public(self.me), "how": ending(rc), "at": at, "fatal": not verdict}
        # a peer's death shows here as an abort or an error exit (asked twice), a direct kill as itself (once)
        dead = None if verdict else self._find_dead(tries=2 if rc > 0 or rc == -signal.SIGABRT else 1)
        if dead is not None:
            print(blame_line(self.index, self.n, dead, self.run_dir), file=sys.stderr, flush=True)
            self.listener.mine["cause"] = dead["index"]
            tell(self.peers, [dead, self.listener.mine])
            return PEER_DIED
        if rc < 0:  # a signal: nothing in the training process could say it
            print(own_line(self.me, worker, rc, at, self.n, self.run_dir), file=sys.stderr, flush=True)
        tell(self.peers, [self.listener.mine])
        return code

    def _find_dead(self, tries: int = 2) -> dict | None:
        """A peer known or found to be dead: heard of, or asked (`tries` times, a moment apart: a peer that
        died with us may not have noticed yet)."""
        for attempt in range(tries):
            if (dead := root(self.listener.gone)) is not None:
                return dead
            answers = _each(self.peers, lambda p: ask(p["addr"], p["port"], {"op": "status"}))
            now = time.time()
            for p, a in zip(self.peers, answers):
                if isinstance(a, dict) and a.get("gone"):
                    self.listener.hear([a["gone"]])
                elif a == "refused":
                    self.listener.hear([{**_public(p), "how": "gone: killed or crashed", "at": now}])
                elif a is None:
                    how = f"no answer within {ASK_S:g}s: killed, crashed, or its host is down"
                    self.listener.hear([{**_public(p), "how": how, "at": now}])
            if attempt + 1 < tries and not self.listener.gone:
                time.sleep(0.5)
        return root(self.listener.gone)


def _public(p: dict) -> dict:
    return {k: p[k] for k in ("index", "host", "pid")}


# ---- the training process -----------------------------------------------------------------------------


def addresses(coordinator: str) -> list[str]:
    """Where peers may reach this host: the address that routes to the coordinator (or to the outside
    world), then the host name's; peers keep the first that answers."""
    host, port = distributed._split(coordinator)
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


def join(launch: distributed.Launch | None, run_dir: Path | str, timeout_s: int = 120) -> None:
    """After `jax.distributed.initialize`: publish this process's supervisor, read every peer's, and hand
    the table to the supervisor. Every process of a multi-process run publishes (supervised or not), so
    no one waits for a record that never comes."""
    if launch is None or launch.num_processes < 2:
        return
    # deferred: the supervisor, which imports this module too, never loads JAX
    from jax._src.distributed import global_state  # the key-value store of the coordination service

    spec = os.environ.get(CHILD, "").split()
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
        f"error: {who(me)} stopped at {clock(at)}: it was killed; its training process (pid {me['worker']}) "
        f"stops too. {resume(n, run_dir)}",
        file=sys.stderr,
        flush=True,
    )
    rec = {**_public(me), "how": "gone: killed or crashed", "at": at}
    tell([p for p in table if p["index"] != me["index"]], [rec])
    os._exit(PEER_DIED)
