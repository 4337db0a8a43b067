"""Growing an elastic run back: a process started later with the same command joins at the next checkpoint.

- The leader's supervisor (index 0 of a membership made by a regroup, generation >= 1) writes its address to
  `<run_dir>/elastic/leader.json` (the run dir is shared, as the checkpoints are) and removes it when it ends.
- A supervisor started with `--elastic` and a `--run-dir` holding that file asks that leader to `join`
  instead of starting a run of its own (a file whose leader does not answer is stale: the command starts as
  launched). Refused in one line, exit 2: a command that differs from the run's (its hash without the flags
  the supervisors manage), more than MAX processes, no mesh for MAX (a count below MAX that no mesh fits is admitted to wait for
  more joiners: 3 x 2 devices cannot split a batch of 8, 4 can), a run that already finished, a run
  regrouping now. Admitted: it waits JOIN_S for its place, else gives up with a line (exit 1).
- The leader, once its training process trains again (the first step after a restore), sends its members
  `grow` (so that their training processes' clean end is not taken for the run's) and SIGTERMs its own
  training process: every process agrees on that step, saves it and ends (the next checkpoint boundary,
  with nothing lost). The leader then places members and joiners (joiners numbered after the members) on a
  mesh re-planned for the larger count, as a regroup does (`regroup.lead`), one line and one metrics.jsonl
  record. Only a membership that a regroup made grows (generation 0 is the command as launched: a process
  started twice with the same index there is a launch error, not a joiner).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from jaxdist.cluster import elastic, peer_wire, regroup

JOIN_S = 300.0  # an admitted joiner waits this long for its place (the leader's next training step), then stops


def config_hash(argv: list[str]) -> str:
    """The command without the flags supervisors manage (the same for every process of a run)."""
    base = elastic.rewrite(argv, 0, 0, "", "", "")[: -len(elastic.MANAGED) * 2]
    return hashlib.sha256(json.dumps(base).encode()).hexdigest()[:16]


def leader_file(run_dir: str | Path) -> Path:
    return Path(run_dir) / "elastic" / "leader.json"


def publish(sup, argv: list[str]) -> None:
    """The leader's address in the run dir, for processes that join later."""
    if not sup.run_dir or sup.span is None:
        return
    path = leader_file(sup.run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    addrs = sup.me.get("addrs") or ["127.0.0.1"]
    rec = {"addrs": addrs, "port": sup.listener.port, "pid": os.getpid(), "gen": sup.gen, "n": sup.n}
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**rec, "config": config_hash(argv)}) + "\n")
    tmp.replace(path)
    sup.published = path


def unpublish(sup) -> None:
    path = getattr(sup, "published", None)
    with contextlib.suppress(OSError, ValueError):
        if path is not None and json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()


def admit(sup, argv: list[str], msg: dict) -> dict:
    """The leader's answer to a `join` (runs in the listener's thread)."""
    if sup.index != 0 or sup.gen < 1 or sup.span is None:
        return {"refuse": f"process {sup.index} (membership {sup.gen}) does not lead a regrouped elastic run"}
    if msg.get("config") != config_hash(argv):
        return {"refuse": "its command differs from the run's (config hash); start it with the run's command"}
    if sup.proc is not None and sup.proc.poll() == 0 and not sup.listener.growing.is_set():
        return {"refuse": "the run already finished"}
    if sup.phase != "running":
        return {"refuse": f"the run is regrouping now ({sup.phase}); start it again in a moment"}
    with sup.join_lock:
        k = sup.n + len(sup.joiners) + 1
        if k > sup.span[1]:
            return {"refuse": f"the run has {k - 1} processes, --elastic's maximum is {sup.span[1]}"}
        result = elastic.plan(sup.run_dir or "", sup.n, k, (k, k), elastic.mesh_of(argv))
        if isinstance(result, str) and k == sup.span[1]:
            return {"refuse": result}
        peer = {key: msg[key] for key in ("port", "token", "host", "pid") if key in msg}
        sup.joiners.append({**peer, "addr": msg.get("seen_from") or "127.0.0.1", "at": time.time()})
        if isinstance(result, str):  # e.g. 3 x 2 devices for a batch of 8: it waits for one more joiner
            return {"admitted": True, "members": k, "waiting": result}
        if not sup.listener.growing.is_set() and not sup.stopping:
            sup.stopping = True
            threading.Thread(target=_stop_at_next_step, args=(sup, sup.gen), daemon=True).start()
    return {"admitted": True, "members": k}


def _stop_at_next_step(sup, gen: int) -> None:
    """Once the training process trains (its regroup's record is written), tell the members and stop it."""
    while sup.recorder is not None and sup.recorder.is_alive() and sup.gen == gen:
        time.sleep(0.2)
    if sup.gen != gen or sup.phase != "running" or sup.proc is None:
        return
    sup.listener.growing.set()
    peer_wire.each(
        sup.peers, lambda p: peer_wire.ask(p["addr"], p["port"], {"op": "grow", "token": p["token"], "gen": gen})
    )
    sup.grow_at = time.time()  # what the grow costs starts here: the steps since are saved, not lost
    with contextlib.suppress(ProcessLookupError):
        sup.proc.send_signal(signal.SIGTERM)


def lead(sup, argv: list[str]) -> tuple[list[str] | None, int]:
    """The leader, its training process ended at the agreed step: place the members and the joiners."""
    with sup.join_lock:
        joiners, sup.joiners, sup.stopping = sup.joiners, [], False
    followers = sorted(sup.peers, key=lambda p: p["index"])
    deadline = time.monotonic() + elastic.DECIDE_S  # the members' training processes end at the same step
    while time.monotonic() < deadline and "running" in regroup.phases(sup).values():
        time.sleep(0.2)
    answers = peer_wire.each(joiners, lambda j: peer_wire.ask(j["addr"], j["port"], {"op": "status"}))
    joiners = [j for j, a in zip(joiners, answers) if isinstance(a, dict)]  # one that gave up waiting is gone
    gen = sup.gen + 1
    for m in range(len(joiners), -1, -1):  # the most joiners a mesh fits (all of them but for a late one)
        k = sup.n + m
        result = elastic.plan(sup.run_dir or "", sup.n, k, (k, k), elastic.mesh_of(argv))
        if not isinstance(result, str):
            break
    else:
        print(f"error: elastic: {result}; the run stops", file=sys.stderr)
        return None, regroup.sup_code(sup)
    if joiners[m:]:
        regroup._send(sup, joiners[m:], {"gen": gen, "stop": f"no mesh fits {sup.n + len(joiners)} processes"})
    joiners = joiners[:m]
    _, old_mesh, new_mesh = result
    host = (sup.me.get("addrs") or ["127.0.0.1"])[0]
    coordinator = f"{host}:{elastic.free_port()}"
    place = {"gen": gen, "n": k, "coordinator": coordinator, "mesh": new_mesh, "run_dir": sup.run_dir}
    answers = regroup._send(sup, followers + joiners, place, ids=True)
    missed = [j for j, a in enumerate(answers, 1) if not isinstance(a, dict) or a.get("phase") == "leaving"]
    if missed:
        print(f"warning: elastic: new process(es) {missed} did not take their place while growing", file=sys.stderr)
    step = elastic.latest_checkpoint(sup.run_dir)
    elastic.trim(sup.run_dir, step)
    where = f"from checkpoint step {step}" if step is not None else "from step 0 (no checkpoint yet)"
    print(
        f"elastic: {len(joiners)} process(es) joined; continuing on {k} processes (was {sup.n}), "
        f"mesh {old_mesh} -> {new_mesh}, {where}",
        file=sys.stderr,
        flush=True,
    )
    rec = {
        "step": step or 0,
        "elastic": {"processes": [sup.n, k], "mesh": [old_mesh, new_mesh], "lost": [], "joined": len(joiners)},
    }
    since = sup.grow_at or time.time()
    sup.recorder = threading.Thread(
        target=elastic.record_when_running, args=(sup.run_dir, rec, since, sup.ended), daemon=True
    )
    sup.recorder.start()
    regroup._renumber(sup, gen, 0, k)
    publish(sup, argv)
    return elastic.rewrite(argv, k, 0, coordinator, new_mesh, sup.run_dir), 0


def join(sup, argv: list[str], run_dir: str) -> tuple[list[str] | None, int]:
    """A supervisor started later: (None, 0) when there is no live run to join (start as launched); else
    its place's command, or (None, exit status) when refused or never placed."""
    try:
        rec = json.loads(leader_file(run_dir).read_text())
    except (OSError, ValueError):
        return None, 0
    ask = {"op": "join", "config": config_hash(argv), "port": sup.listener.port, "token": sup.listener.token}
    ask |= {"host": sup.me["host"], "pid": os.getpid()}
    answer = None
    for addr in rec.get("addrs") or []:
        answer = peer_wire.ask(addr, rec["port"], ask)
        if isinstance(answer, dict):
            break
    where = f"the elastic run in {run_dir}"
    if not isinstance(answer, dict):
        print(f"elastic: {leader_file(run_dir)} names no live leader; starting as launched", file=sys.stderr)
        return None, 0
    if "refuse" in answer:
        print(f"error: elastic: cannot join {where}: {answer['refuse']}", file=sys.stderr, flush=True)
        return None, 2
    wait = f"waiting for more processes ({answer['waiting']})" if answer.get("waiting") else "waiting for its next step"
    print(f"elastic: joining {where} as its process {answer['members'] - 1}; {wait}", file=sys.stderr, flush=True)
    if not sup.listener.regrouped.wait(JOIN_S):
        print(f"error: elastic: not placed within {JOIN_S:g}s by {where}; this process stops", file=sys.stderr)
        return None, 1
    msg = sup.listener.regroup or {}
    if msg.get("stop") or msg.get("spare"):
        print(f"error: elastic: {where} did not take this process: {msg.get('stop') or 'a spare'}", file=sys.stderr)
        return None, 1
    regroup._renumber(sup, msg["gen"], msg["id"], msg["n"])
    return elastic.rewrite(argv, msg["n"], msg["id"], msg["coordinator"], msg["mesh"], msg["run_dir"]), 0
