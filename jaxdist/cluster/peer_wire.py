"""Talking to peers' supervisors: one JSON line each way (`ask`, `tell`), and the port that answers (`Listener`).

A supervisor listens on a TCP port: it answers "how are you" with its process's end (if known), takes
news of deaths that carry its token, and holds open the connection of a peer that watches it (closed
without "clean" when this process ends, however it ends).
"""

from __future__ import annotations

import contextlib
import json
import secrets
import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

ASK_S = 2.0  # one question to a peer: connect, ask, answer


def readline(conn: socket.socket, limit: int = 1 << 16) -> bytes:
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
            return json.loads(readline(s))
    except ConnectionRefusedError:
        return "refused"
    except (OSError, ValueError):
        return None


def each(peers: list, fn) -> list:
    if not peers:
        return []
    with ThreadPoolExecutor(min(32, len(peers))) as pool:
        return list(pool.map(fn, peers))


def tell(peers: list[dict], records: list[dict], gen: int = 0) -> None:
    """Tell every peer's supervisor about these deaths (at its known address, else at each it published,
    ASK_S per try; the unreachable are skipped). `gen`: the membership they happened in (elastic runs)."""

    def one(p: dict) -> None:
        msg = {"op": "gone", "token": p["token"], "records": records, "gen": gen}
        for addr in [p["addr"]] if "addr" in p else p.get("addrs") or []:
            if isinstance(ask(addr, p["port"], msg), dict):
                return

    each([p for p in peers if p.get("port")], one)


class Listener:
    """A supervisor's port: answers "how are you" and takes peers' news of deaths (with its token)."""

    def __init__(self, index: int):
        self.index = index
        self.token = secrets.token_hex(16)  # news of a death must carry it: a stray connection stops nothing
        self.gone: dict[int, dict] = {}  # deaths heard of, by process index
        self.mine: dict | None = None  # this process's own end, once known
        self.state: Callable[[], dict | None] | None = (
            None  # () -> this process's record while it cannot take part (stopped), else None
        )
        self.news = threading.Event()
        self.gen = 0  # the membership this process is in (elastic runs regroup into 1, 2, ...)
        self.phase: Callable[[], str] | None = None  # elastic runs: running, deciding, waiting or leaving (elastic.py)
        self.regroup: dict | None = None  # the leader's message of a new membership (elastic.py)
        self.regrouped = threading.Event()
        self.growing = threading.Event()  # the leader stops the training processes to grow the run (grow.py)
        self.join: Callable[[dict], dict] | None = None  # the leader's answer to a process that joins (grow.py)
        self.watchers: list[socket.socket] = []  # peers' connections held open to see this process end
        self._lock = threading.Lock()
        self.sock = socket.create_server(("", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True, name="jaxdist-peers").start()

    def _serve(self) -> None:
        while True:
            try:
                conn, remote = self.sock.accept()
            except OSError:
                return  # closed
            try:
                conn.settimeout(ASK_S)
                msg = json.loads(readline(conn))
                if msg.get("op") == "join":
                    msg["seen_from"] = remote[0]  # the joiner's address as this host reaches it
                conn.sendall(json.dumps(self._answer(msg)).encode() + b"\n")
                if msg.get("op") == "watch" and msg.get("token") == self.token:
                    self.watchers.append(conn)  # held open: it closes when this process ends, however
                    continue
            except (OSError, ValueError, AttributeError, TypeError):
                pass
            conn.close()

    def _answer(self, msg: dict) -> dict:
        if msg.get("op") == "join":  # no token: the joiner does not know one; the leader checks its command
            return self.join(msg) if self.join else {"refuse": f"process {self.index} takes no joiners"}
        ours = msg.get("token") == self.token and msg.get("gen", 0) == self.gen  # news of an older membership: none
        if msg.get("op") == "gone" and ours:
            self.hear(msg["records"])
        gone = self.mine or (self.state() if self.state else None)
        if self.phase is None:  # not an elastic run
            return {"index": self.index, "gone": gone}
        phase = "leaving" if gone else self.phase()
        newer = msg.get("gen", 0) > self.gen and phase != "leaving"
        if msg.get("op") == "grow" and ours and phase == "running":
            self.growing.set()  # the training process's clean end is the run growing, not its end
        if msg.get("op") == "regroup" and msg.get("token") == self.token and newer:
            self.regroup = msg
            self.regrouped.set()
            self.news.set()  # a training process still running stops: the run regroups
        return {"index": self.index, "gone": gone, "phase": phase}

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
