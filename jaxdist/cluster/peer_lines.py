"""The lines that name a dead peer: how a process ended, who it was, when, and how to resume.

Pure words over the records the supervisors exchange (`{"index", "host", "pid", "how", "at"}`); the
supervisor (`supervisor.py`) and the training process (`peers.py`) print them.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path


def clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


EXITED, ABORTED = "exited with status", "aborted (SIGABRT)"  # ends a death elsewhere can cause (may_follow)


def ending(rc: int) -> str:
    """How a process ended, from its exit status (negative: the signal that killed it)."""
    if rc >= 0:
        return f"{EXITED} {rc}; see its output"
    try:
        name = signal.Signals(-rc).name
    except ValueError:
        name = f"signal {-rc}"
    return ABORTED if name == "SIGABRT" else f"killed by {name}"


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


def stopped_line(me: dict, worker: int, at: float, n: int, run_dir: str | None) -> str:
    return (
        f"error: {who(me)} stopped answering at {clock(at)}: its training process (pid {worker}) was stopped "
        f"(SIGSTOP or a debugger), so the other processes could not continue; it was killed and they stop too. "
        f"{resume(n, run_dir)}"
    )


def root(gone: dict[int, dict], killed: bool = False) -> dict | None:
    """The death that started it: the earliest of those not caused by another. `killed`: this process's own
    training process was killed by a signal, a death of its own that no peer's can have caused; then only a
    peer's death of its own counts (a kill, a crash, silence), never a peer's error exit or abort, which may
    be the consequence of ours (both supervisors asked each other at once and each blamed the other)."""
    if killed:
        gone = {i: r for i, r in gone.items() if r.get("cause") is None and not may_follow(r)}
    first = [r for r in gone.values() if r.get("cause") is None] or list(gone.values())
    return min(first, key=lambda r: r["at"]) if first else None


def may_follow(rec: dict) -> bool:
    """Whether this end can be the consequence of another process's death: an error exit or an abort (a
    collective that failed), not a kill, a crash or silence."""
    return rec["how"].startswith((EXITED, ABORTED))


def public(p: dict) -> dict:
    return {k: p[k] for k in ("index", "host", "pid")}


PEER_DIED = 1  # exit status of a process stopped because another one died

GONE = "gone: killed or crashed"  # how a process ended that no one saw end


def death(p: dict, at: float, how: str = GONE) -> dict:
    """The record of `p`'s end that the supervisors exchange."""
    return {**public(p), "how": how, "at": at}
