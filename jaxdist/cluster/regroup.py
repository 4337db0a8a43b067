"""The surviving supervisors of an elastic run agree on a new membership (the protocol is in `elastic.py`).

`regroup(sup, argv)` runs in a supervisor whose training process ended because a peer died: it finds
the leader (the lowest index still taking part), which plans and sends every member its new place; it
returns the training process's new command (or None, and the exit status, when this process stops).
"""

from __future__ import annotations

import sys
import threading
import time

from jaxdist.cluster import elastic, peer_lines, peer_wire

TAKING_PART = ("running", "deciding", "waiting")
TRIES = 3  # the leader starts over when a member turned out to be leaving


def lost_line(index: int, n: int, dead: dict) -> str:
    return (
        f"elastic: {peer_lines.who(dead)} stopped answering at {peer_lines.clock(dead['at'])} ({dead['how']}); "
        f"process {index} of {n} regroups with the survivors"
    )


def phases(sup) -> dict[int, str]:
    """Every peer's phase as it answers now ("gone": no answer)."""
    answers = peer_wire.each(sup.peers, lambda p: peer_wire.ask(p["addr"], p["port"], {"op": "status"}))
    return {
        p["index"]: (a.get("phase") or "running") if isinstance(a, dict) else "gone" for p, a in zip(sup.peers, answers)
    }


def regroup(sup, argv: list[str]) -> tuple[list[str] | None, int]:
    deadline = time.monotonic() + elastic.DECIDE_S
    while True:
        now = phases(sup)
        if "deciding" not in now.values() or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    alive = sorted([sup.index] + [i for i, ph in now.items() if ph in TAKING_PART])
    if alive[0] != sup.index:
        return follow(sup, argv, alive[0])
    return lead(sup, argv, now)


def lead(sup, argv: list[str], now: dict[int, str]) -> tuple[list[str] | None, int]:
    by_index = {p["index"]: p for p in sup.peers}
    dead = [i for i in range(sup.n) if i != sup.index and now.get(i) not in TAKING_PART]
    for _ in range(TRIES):
        alive = sorted([sup.index] + [i for i, ph in now.items() if ph in TAKING_PART])
        gen = sup.gen + 1
        result = elastic.plan(sup.run_dir or "", sup.n, len(alive), sup.span, elastic.mesh_of(argv))
        if isinstance(result, str):
            _send(sup, [by_index[i] for i in alive[1:]], {"gen": gen, "stop": result})
            print(f"error: elastic: {result}; the run stops. {peer_lines.resume(sup.n, sup.run_dir)}", file=sys.stderr)
            return None, sup_code(sup)
        k, old_mesh, new_mesh = result
        members, spares = alive[:k], alive[k:]
        host = (sup.me.get("addrs") or ["127.0.0.1"])[0]
        coordinator = f"{host}:{elastic.free_port()}"
        place = {"gen": gen, "n": k, "coordinator": coordinator, "mesh": new_mesh, "run_dir": sup.run_dir}
        answers = _send(sup, [by_index[i] for i in members[1:]], place, ids=True)
        _send(sup, [by_index[i] for i in spares], {"gen": gen, "spare": True})
        left = [i for i, a in zip(members[1:], answers) if not isinstance(a, dict) or a.get("phase") == "leaving"]
        if not left:
            break
        now = {**now, **dict.fromkeys(left, "gone")}
        dead += left
    else:
        print("error: elastic: the survivors kept leaving while regrouping; the run stops", file=sys.stderr)
        return None, sup_code(sup)
    step = elastic.latest_checkpoint(sup.run_dir)
    elastic.trim(sup.run_dir, step)
    print(elastic.change_line(sorted(dead), sup.n, k, old_mesh, new_mesh, step), file=sys.stderr, flush=True)
    rec = {
        "step": step or 0,
        "elastic": {"processes": [sup.n, k], "mesh": [old_mesh, new_mesh], "lost": sorted(dead), "spares": spares},
    }
    since = sup.cause["at"] if sup.cause else time.time()
    sup.recorder = threading.Thread(
        target=elastic.record_when_running, args=(sup.run_dir, rec, since, sup.ended), daemon=True
    )
    sup.recorder.start()
    new_argv = elastic.rewrite(argv, k, 0, coordinator, new_mesh, sup.run_dir)
    _renumber(sup, gen, 0, k)
    return new_argv, 0


def follow(sup, argv: list[str], leader: int) -> tuple[list[str] | None, int]:
    if not sup.listener.regrouped.wait(elastic.REGROUP_S):
        print(
            f"error: elastic: process {sup.index} heard no new membership from process {leader} within "
            f"{elastic.REGROUP_S:g}s; it stops. {peer_lines.resume(sup.n, sup.run_dir)}",
            file=sys.stderr,
        )
        return None, sup_code(sup)
    msg = sup.listener.regroup or {}
    if msg.get("stop"):
        print(f"error: elastic: {msg['stop']}; the run stops (process {sup.index})", file=sys.stderr)
        return None, sup_code(sup)
    if msg.get("spare"):
        print(f"elastic: process {sup.index} is not needed by the new mesh: it stops (a spare)", file=sys.stderr)
        return None, 0
    new_argv = elastic.rewrite(argv, msg["n"], msg["id"], msg["coordinator"], msg["mesh"], msg["run_dir"])
    _renumber(sup, msg["gen"], msg["id"], msg["n"])
    return new_argv, 0


def sup_code(sup) -> int:
    return peer_lines.PEER_DIED


def _send(sup, peers: list[dict], msg: dict, ids: bool = False) -> list:
    """The regroup message to each peer (with its token, and its new id when `ids`); their answers."""

    def one(pj: tuple[int, dict]) -> dict | str | None:
        j, p = pj
        body = {**msg, "op": "regroup", "token": p["token"], **({"id": j} if ids else {})}
        return peer_wire.ask(p["addr"], p["port"], body)

    return peer_wire.each(list(enumerate(peers, 1)), one) if peers else []


def _renumber(sup, gen: int, index: int, n: int) -> None:
    """This supervisor's place in the new membership; what it heard of the old one is forgotten."""
    lst = sup.listener
    sup.gen = lst.gen = gen
    sup.index = lst.index = index
    sup.n, sup.peers, sup.cause, sup.was_stopped = n, [], None, False
    sup.me = {**sup.me, "index": index}
    lst.gone.clear()
    lst.mine, lst.regroup = None, None
    lst.regrouped.clear()
    lst.growing.clear()
    lst.news.clear()
    sup.phase = "running"
