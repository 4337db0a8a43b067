"""The supervisor of a multi-process command: runs the training process, passes signals on, says who died.

The pid the launcher started (it never imports JAX): `supervise(argv)` runs the same command again as
its child, in the child's own process group, forwards SIGTERM / SIGINT / SIGHUP / SIGUSR1 / SIGUSR2, and
listens for its peers (`peer_wire.Listener`). When its training process ends abnormally it names the
peer whose death caused it (heard of, or asked), or its own end, and tells every peer. The whole
mechanism, and why, is in `peers.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from jaxdist.cluster import elastic, grow, peer_lines, peer_wire, regroup
from jaxdist.cluster import launch as launch_mod
from jaxdist.errors import JaxdistError

SWITCH = "JAXDIST_WATCH_PEERS"  # "0": no supervisor
CHILD = "JAXDIST_SUPERVISOR"  # set in the training process: "FD PORT TOKEN" (its socket pair, its supervisor)
GEN = "JAXDIST_ELASTIC_GEN"  # set in the training process: the membership it belongs to (elastic runs: 0, 1, ...)
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
GRACE_S = 0.5  # a training process told that a peer died may end by itself this long (its own error wins)
PEER_DIED = peer_lines.PEER_DIED  # exit status of a process stopped because another one died


class _Flags(argparse.ArgumentParser):
    def error(self, message):
        raise JaxdistError(message)


def launch_of(argv: list[str]) -> launch_mod.Launch | None:
    """This command's place in the run, as `train` will resolve it (None: one process, or input that
    `train` itself will refuse in its own words)."""
    p = _Flags(add_help=False)
    p.add_argument("--coordinator")
    p.add_argument("--num-processes", type=int)
    p.add_argument("--process-id", type=int)
    p.add_argument("--elastic")
    try:
        args, _ = p.parse_known_args(argv)
        return launch_mod.detect(args.coordinator, args.num_processes, args.process_id)
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
    return Supervisor(launch, elastic_span(argv)).run(argv)


def elastic_span(argv: list[str]) -> tuple[int, int] | None:
    """--elastic MIN:MAX, read as `train` reads it (None: not elastic, or input `train` refuses itself)."""
    p = _Flags(add_help=False)
    p.add_argument("--elastic")
    try:
        text = p.parse_known_args(argv)[0].elastic
        return None if text is None else elastic.parse_span(text)
    except JaxdistError:
        return None


class Supervisor:
    """The pid the launcher started, in a multi-process run: runs the training process, passes signals on,
    hears of and asks about peers, and says who died."""

    def __init__(self, launch: launch_mod.Launch, span: tuple[int, int] | None = None):
        self.index, self.n = launch.process_id, launch.num_processes
        self.span = span  # --elastic MIN:MAX: regroup on the survivors after a death (elastic.py)
        self.gen = 0  # the membership (elastic runs count their regroups)
        self.phase = "running"  # what peers are told (elastic.py): running, deciding, waiting, leaving
        self.cause: dict | None = None  # the peer whose death ended our training process (elastic runs)
        self.proc: subprocess.Popen | None = None  # the training process of this membership
        self.recorder: threading.Thread | None = None  # the leader's metrics.jsonl record of a regroup
        self.ended = threading.Event()  # set as the supervisor leaves: the recorder writes what it waits on
        self.listener = peer_wire.Listener(self.index)
        self.peers: list[dict] = []  # reachable peers' records, once the training process sent the table
        self.me = {"index": self.index, "host": socket.gethostname(), "pid": os.getpid()}
        self.run_dir: str | None = None
        self.was_stopped = False  # the training process was stopped (SIGSTOP) when it was killed
        self.argv: list[str] = []  # the training process's command in this membership
        self.joiners: list[dict] = []  # processes admitted to join at the next step (the leader; grow.py)
        self.join_lock = threading.Lock()
        self.stopping = False  # the leader is stopping its training process to take the joiners in
        self.grow_at: float | None = None  # when it sent that SIGTERM (a grow's seconds_lost count from it)
        self.published = None  # <run_dir>/elastic/leader.json, once this supervisor leads a regrouped run

    def run(self, argv: list[str]) -> int:
        if self.span is not None:
            self.listener.phase = lambda: self.phase
            self.listener.join = lambda msg: grow.admit(self, self.argv, msg)
        previous = {}
        if threading.current_thread() is threading.main_thread():
            for s in FORWARDED:  # the child has its own process group: a terminal's Ctrl-C reaches it once, from here
                previous[s] = signal.signal(s, lambda signum, _: self.proc and self.proc.send_signal(signum))
        rc = None
        try:
            run_dir = run_dir_of(argv) if self.span is not None else None
            if run_dir is not None:  # a live elastic run in this run dir: join it (grow.py)
                again, code = grow.join(self, argv, run_dir)
                if again is None and code:
                    return code
                argv = again or argv
            while True:
                self.argv = argv
                ours, theirs = socket.socketpair()
                env = {**os.environ, CHILD: f"{theirs.fileno()} {self.listener.port} {self.listener.token}"}
                self.proc = proc = subprocess.Popen(
                    [sys.executable, "-m", "jaxdist.train", *argv],
                    env={**env, GEN: str(self.gen)},
                    pass_fds=(theirs.fileno(),),
                    process_group=0,
                )
                theirs.close()
                self.listener.state = lambda: self._stalled(self.proc)  # asked "how are you": a stopped process says so
                self._reader = threading.Thread(target=self._table, args=(ours,), daemon=True)
                self._reader.start()
                try:
                    rc, stopped = self._wait(proc)
                    self.phase = "deciding"
                    code = self._after(rc, stopped, proc.pid)
                finally:
                    ours.close()
                if self.cause is None and not (rc == 0 and self.listener.growing.is_set()):
                    break
                again, code = self._regroup(argv)
                if not again:
                    break
                argv = again
            self.phase = "leaving"
            if self.recorder is not None:
                self.ended.set()
                self.recorder.join(timeout=2)
            return code
        finally:
            self.phase = "leaving"
            grow.unpublish(self)
            for s, h in previous.items():
                signal.signal(s, h)
            self.listener.close(clean=rc in (0, 2, 130))  # the ring watch hears of deaths only

    def _regroup(self, argv: list[str]) -> tuple[list[str] | None, int]:
        """The next membership's command after a peer's death (regroup.py) or after the leader stopped every
        training process to take in joiners (grow.py); None and the exit status when this process stops."""
        self.phase = "waiting"
        if self.cause is None:
            return grow.lead(self, argv) if self.index == 0 else regroup.follow(self, argv, 0)
        again, code = regroup.regroup(self, argv)
        if again and self.index == 0:
            grow.publish(self, again)  # the new leader's address, for a process that joins later
        return again, code

    def _table(self, ours: socket.socket) -> None:
        """The peers' table from the training process, then which of their supervisors we can reach."""
        try:
            msg = json.loads(peer_wire.readline(ours, 1 << 28))  # ~250 bytes a process
        except (OSError, ValueError):
            return
        self.run_dir = msg.get("run_dir")
        self.me.update(next(p for p in msg["peers"] if p["index"] == self.index))

        def reach(p: dict) -> dict | None:
            for addr in p.get("addrs") or []:
                answer = peer_wire.ask(addr, p["port"], {"op": "status"}) if p.get("port") else None
                if isinstance(answer, dict) and answer.get("index") == p["index"]:  # not another one's port
                    return {**p, "addr": addr}
            return None

        others = [p for p in msg["peers"] if p["index"] != self.index]
        found = peer_wire.each(others, reach)
        self.peers = [p for p in found if p]
        if self.peers:  # watch the next one round the ring: each process is watched by one other
            after = [p for p in self.peers if p["index"] > self.index] or self.peers
            threading.Thread(target=self._watch, args=(after[0], self.gen), daemon=True).start()
        lost = [str(p["index"]) for p, f in zip(others, found) if not f]
        if lost and self.index == 0:
            print(
                f"warning: process 0 cannot reach the supervisors of process(es) {', '.join(lost)} (a firewall "
                f"between hosts?); if one of them dies, this run stops without naming it",
                file=sys.stderr,
                flush=True,
            )

    def _watch(self, p: dict, gen: int | None = None) -> None:
        """Hold a connection to a peer's supervisor: if it closes without "clean", that process has
        ended (killed outright, both of its processes): a death heard of at once, not at the heartbeat."""
        gen = self.gen if gen is None else gen  # the membership it watches in (elastic runs regroup)
        data = b""
        try:
            with socket.create_connection((p["addr"], p["port"]), timeout=peer_wire.ASK_S) as s:
                s.sendall(json.dumps({"op": "watch", "token": p["token"]}).encode() + b"\n")
                s.settimeout(None)
                while chunk := s.recv(4096):
                    data += chunk
        except OSError:
            return
        if not data.endswith(b"clean\n") and gen == self.gen:  # a death in an older membership: regrouped already
            self.listener.hear([peer_lines.death(p, time.time())])

    def _stalled(self, proc: subprocess.Popen | None) -> dict | None:
        """This process's record when its training process is stopped (SIGSTOP, a debugger): it answers no
        collective, so its peers' fail, and they must name it, not themselves."""
        if proc is None or proc.poll() is not None or not is_stopped(proc.pid):
            return None
        return peer_lines.death(self.me, time.time(), stopped_how(proc.pid))

    def _wait(self, proc: subprocess.Popen) -> tuple[int, bool]:
        """The child's exit status, and whether we stopped it because a peer died (after GRACE_S)."""
        told = None
        while (rc := proc.poll()) is None:
            if told is None:
                if self.listener.news.wait(0.1):
                    told = time.monotonic()
            elif time.monotonic() - told > GRACE_S:
                self.was_stopped = is_stopped(proc.pid)  # then the others failed because of us
                proc.kill()  # stuck in a collective with the dead peer: it could only abort
                return proc.wait(), True
            else:
                time.sleep(0.05)
        return rc, False

    def _after(self, rc: int, stopped: bool, worker: int) -> int:
        code = rc if rc >= 0 else 128 - rc
        self._reader.join(timeout=2 * peer_wire.ASK_S)  # the table may still be on its way
        if rc == 0 or not self.peers:
            return code
        at = time.time()
        verdict = rc in (2, 130) and not stopped  # bad input, interrupted: the training process's own word
        killed = rc < 0 and rc != -signal.SIGABRT and not stopped  # a death of its own, not a peer's consequence
        if self.span is not None and not verdict and not self.was_stopped:  # elastic: a peer's death regroups
            dead = self._find_dead(tries=1 if killed else 2, killed=killed)
            if dead is None and self.listener.regroup is not None:  # the leader regrouped before we heard why
                self.cause = {"at": time.time()}
                return PEER_DIED
            if dead is not None:
                self.cause = dead
                print(regroup.lost_line(self.index, self.n, dead), file=sys.stderr, flush=True)
                ours = {**peer_lines.death(self.me, at, "regrouping"), "cause": dead["index"]}
                peer_wire.tell(self.peers, [dead, ours], self.gen)  # a frozen peer's supervisor hears it too
                return PEER_DIED
        self.listener.mine = {**peer_lines.death(self.me, at, peer_lines.ending(rc)), "fatal": not verdict}
        if self.was_stopped:  # the peers' failures are ours: name this process, not the one that told us
            self.listener.mine = {**peer_lines.death(self.me, at, stopped_how(worker)), "fatal": True}
            print(peer_lines.stopped_line(self.me, worker, at, self.n, self.run_dir), file=sys.stderr, flush=True)
            peer_wire.tell(self.peers, [self.listener.mine], self.gen)
            return PEER_DIED
        # a peer's death shows here as an abort or an error exit (asked twice), a direct kill as itself (once)
        dead = None if verdict else self._find_dead(tries=1 if killed or stopped else 2, killed=killed)
        if dead is not None:
            print(peer_lines.blame_line(self.index, self.n, dead, self.run_dir), file=sys.stderr, flush=True)
            self.listener.mine["cause"] = dead["index"]
            peer_wire.tell(self.peers, [dead, self.listener.mine], self.gen)
            return PEER_DIED
        if rc < 0:  # a signal: nothing in the training process could say it
            print(peer_lines.own_line(self.me, worker, rc, at, self.n, self.run_dir), file=sys.stderr, flush=True)
        peer_wire.tell(self.peers, [self.listener.mine], self.gen)
        return code

    def _find_dead(self, tries: int = 2, killed: bool = False) -> dict | None:
        """A peer known or found to be dead: heard of, or asked (`tries` times, a moment apart: a peer that
        died with us may not have noticed yet). `killed`: ours was killed by a signal (`peer_lines.root`)."""
        for attempt in range(tries):
            if (dead := peer_lines.root(self.listener.gone, killed)) is not None:
                return dead
            answers = peer_wire.each(self.peers, lambda p: peer_wire.ask(p["addr"], p["port"], {"op": "status"}))
            now = time.time()
            for p, a in zip(self.peers, answers):
                if isinstance(a, dict) and a.get("gone"):
                    self.listener.hear([a["gone"]])
                elif a == "refused":
                    self.listener.hear([peer_lines.death(p, now)])
                elif a is None:
                    how = f"no answer within {peer_wire.ASK_S:g}s: killed, crashed, stopped, or its host is down"
                    self.listener.hear([peer_lines.death(p, now, how)])
            if attempt + 1 < tries and not self.listener.gone:
                time.sleep(0.5)
        return peer_lines.root(self.listener.gone, killed)


def run_dir_of(argv: list[str]) -> str | None:
    p = _Flags(add_help=False)
    p.add_argument("--run-dir")
    try:
        return p.parse_known_args(argv)[0].run_dir
    except JaxdistError:
        return None


def is_stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (state T: SIGSTOP, SIGTSTP; t: held by a debugger), from /proc
    (False where there is no /proc: such a process is then named as one that stopped answering)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def stopped_how(worker: int) -> str:
    return f"its training process (pid {worker}) is stopped (SIGSTOP or a debugger) and answers no collective"
