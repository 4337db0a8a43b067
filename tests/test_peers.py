"""The supervisors of multi-process runs, without JAX: the lines, who is blamed, the questions and news, the ring watch.
Real processes killed mid-run: tests/test_distributed.py::test_a_killed_process_is_named_by_the_survivor."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import gone

from jaxdist.cluster import launch as launch_mod
from jaxdist.cluster import peer_lines, peer_wire, peers, supervisor


def test_how_a_process_ended():
    assert peer_lines.ending(-9) == "killed by SIGKILL"
    assert peer_lines.ending(-6) == "aborted (SIGABRT)"
    assert peer_lines.ending(3) == "exited with status 3; see its output"


def test_the_line_names_the_peer_and_the_checkpoint_to_resume_from(tmp_path):
    for d in ("5", "10", "15.orbax-checkpoint-tmp-1"):  # a save in progress is not a checkpoint
        (tmp_path / "checkpoints" / d).mkdir(parents=True)
    dead = {"index": 1, "host": "node2", "pid": 4242, "how": "killed by SIGKILL", "at": time.time()}
    line = peer_lines.blame_line(0, 2, dead, str(tmp_path))
    assert line.startswith("error: process 1 (host node2, pid 4242) stopped answering at ")
    assert line.endswith(
        "(killed by SIGKILL); process 0 cannot continue the collectives it shares with it. Resume with the same "
        "command once all 2 processes can run (the latest checkpoint is step 10)."
    )
    assert "(no checkpoint yet: it starts again from step 0)" in peer_lines.blame_line(0, 2, dead, str(tmp_path / "x"))


def test_the_first_death_is_blamed_not_those_it_caused():
    gone = {
        2: {"index": 2, "at": 5.0, "cause": 1},  # stopped because of process 1, before anyone heard of 1
        1: {"index": 1, "at": 7.0},
        3: {"index": 3, "at": 9.0},
    }
    assert peer_lines.root(gone)["index"] == 1
    assert peer_lines.root({}) is None
    # this process's own training process was killed: only a peer's own death (kill, crash, silence) is blamed
    ends = {2: peer_lines.ending(1), 3: peer_lines.ending(-6), 4: peer_lines.ending(-9), 5: peer_lines.GONE}
    heard = {i: {"index": i, "at": 10.0 - i, "how": how} for i, how in ends.items()}
    assert peer_lines.root(heard)["index"] == 5 and peer_lines.root(heard, killed=True)["index"] == 5
    del heard[5]
    assert peer_lines.root(heard)["index"] == 4 and peer_lines.root(heard, killed=True)["index"] == 4
    del heard[4]
    assert peer_lines.root(heard)["index"] == 3 and peer_lines.root(heard, killed=True) is None


def test_a_listener_answers_and_takes_news_only_with_its_token():
    lis = peer_wire.Listener(0)
    try:
        assert peer_wire.ask("127.0.0.1", lis.port, {"op": "status"}) == {"index": 0, "gone": None}
        news = [{"index": 1, "host": "h", "pid": 7, "how": "killed by SIGKILL", "at": 2.0}]
        peer_wire.ask("127.0.0.1", lis.port, {"op": "gone", "token": "wrong", "records": news})
        assert lis.gone == {} and not lis.news.is_set()  # a stray connection stops nothing
        peer_wire.ask("127.0.0.1", lis.port, {"op": "gone", "token": lis.token, "records": news})
        later = {**news[0], "how": "gone: killed or crashed", "at": 3.0}
        peer_wire.ask("127.0.0.1", lis.port, {"op": "gone", "token": lis.token, "records": [later]})
        assert lis.news.is_set() and lis.gone[1]["how"] == "killed by SIGKILL"  # the earliest word kept
    finally:
        lis.close(clean=False)
    assert peer_wire.ask("127.0.0.1", lis.port, {"op": "status"}) == "refused"


def test_a_peers_own_error_exit_does_not_stop_this_one_a_death_does():
    """A peer that exited 2 (bad input on its host) or 130 said so itself: ours may end by itself (its
    own error, or the collective failing), and then names it; a death stops ours at once."""
    lis = peer_wire.Listener(0)
    lis.hear(
        [{"index": 1, "host": "h", "pid": 7, "how": "exited with status 2; see its output", "at": 1.0, "fatal": False}]
    )
    assert 1 in lis.gone and not lis.news.is_set()
    lis.hear(
        [{"index": 1, "host": "h", "pid": 7, "how": "gone: killed or crashed", "at": 2.0}]
    )  # its ring watch, later
    assert not lis.news.is_set()  # the first word about process 1 stands
    lis.hear([{"index": 2, "host": "h", "pid": 8, "how": "killed by SIGKILL", "at": 3.0}])
    assert lis.news.is_set()
    lis.close(clean=True)


def new_supervisor() -> supervisor.Supervisor:
    return supervisor.Supervisor(launch_mod.Launch("127.0.0.1:1", 2, 0, "flags"))


def record(lis: peer_wire.Listener, index: int = 1) -> dict:
    return {"index": index, "host": "h", "pid": 99, "addr": "127.0.0.1", "port": lis.port, "token": lis.token}


@pytest.mark.parametrize("clean", [True, False])
def test_the_ring_watch_hears_an_end_at_once_unless_it_was_clean(clean):
    sup, peer = new_supervisor(), peer_wire.Listener(1)
    watch = threading.Thread(target=sup._watch, args=(record(peer),))
    watch.start()
    deadline = time.monotonic() + 60  # generous: a loaded CI machine; the loop ends as soon as it is heard
    while not peer.watchers and time.monotonic() < deadline:
        time.sleep(0.01)
    peer.close(clean=clean)
    watch.join(timeout=60)
    assert not watch.is_alive()
    assert (1 in sup.listener.gone) is not clean
    if not clean:
        assert sup.listener.gone[1]["how"] == "gone: killed or crashed"
    sup.listener.close(clean=True)


def test_a_peer_that_no_longer_listens_is_found_dead_and_a_live_one_is_not():
    sup, alive, dead = new_supervisor(), peer_wire.Listener(1), peer_wire.Listener(2)
    dead.close(clean=False)
    try:
        sup.peers = [record(alive, 1)]
        t0 = time.monotonic()
        # asked twice, 0.5 s apart (the bound of 10 s: a loaded CI machine)
        assert sup._find_dead() is None and time.monotonic() - t0 < 10
        sup.peers.append(record(dead, 2))
        found = sup._find_dead()
        assert (found["index"], found["pid"], found["how"]) == (2, 99, "gone: killed or crashed")
    finally:
        alive.close(clean=True)
        sup.listener.close(clean=True)


def test_a_peer_that_accepts_but_never_answers_is_named_after_the_timeout(monkeypatch):
    """A hung process or host: the connection may open (the kernel's backlog) but no answer comes."""
    monkeypatch.setattr(peer_wire, "ASK_S", 0.3)
    sup = new_supervisor()
    with socket.create_server(("127.0.0.1", 0)) as mute:  # listens, never accepts
        sup.peers = [{"index": 1, "host": "h", "pid": 99, "addr": "127.0.0.1", "port": mute.getsockname()[1]}]
        t0 = time.monotonic()
        found = sup._find_dead(tries=1)
        assert 0.3 <= time.monotonic() - t0 < 10  # the timeout, then an answer (10: a loaded CI machine)
    assert found["how"] == "no answer within 0.3s: killed, crashed, stopped, or its host is down"
    sup.listener.close(clean=True)


def test_single_process_commands_are_not_supervised(monkeypatch):
    for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.delenv("JOB_COMPLETION_INDEX", raising=False)
    assert supervisor.supervise(["--steps", "1"]) is None
    assert supervisor.supervise(["--coordinator", "h:1", "--num-processes", "1", "--process-id", "0"]) is None
    assert supervisor.launch_of(["--num-processes", "two"]) is None  # train itself refuses it, in its own words
    two = ["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "0"]
    assert supervisor.launch_of(two).num_processes == 2
    monkeypatch.setenv(supervisor.SWITCH, "0")
    assert supervisor.supervise(two) is None  # switched off
    monkeypatch.delenv(supervisor.SWITCH)
    monkeypatch.setenv(supervisor.CHILD, "3 4 t")
    assert supervisor.supervise(two) is None  # the training process itself


def test_addresses_start_with_the_route_to_the_coordinator():
    assert peers.addresses("127.0.0.1:1")[0] == "127.0.0.1"
    assert all(socket.inet_aton(a) for a in peers.addresses("127.0.0.1:1"))


# ---- a stopped process: the launcher kills it after a grace period, and it is the one named ----------

ROOT = Path(__file__).resolve().parent.parent
FAKE_HOST = """
import os, signal, subprocess, sys, time
if sys.argv[1] == "-c":  # the launcher's free-port one-liner
    exec(sys.argv[2])
    sys.exit()
i = int(sys.argv[sys.argv.index("--process-id") + 1])
if i == 0:  # process 0 fails (its peer stopped answering), once process 1 is stopped
    while not os.path.exists(os.environ["PIDS_FILE"]):
        time.sleep(0.05)
    time.sleep(0.5)
    sys.exit(3)
# process 1: a supervisor that passes SIGTERM on, and its training process in its own process group, which
# (stuck in a collective with the gone process 0) never ends by itself; both are stopped (SIGSTOP)
ready = os.environ["PIDS_FILE"] + ".ready"
hang = "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); open(sys.argv[1], 'w'); time.sleep(300)"
child = subprocess.Popen([sys.executable, "-c", hang, ready], process_group=0)
signal.signal(signal.SIGTERM, lambda *_: child.send_signal(signal.SIGTERM))
while not os.path.exists(ready):  # its SIGTERM is ignored from here on
    time.sleep(0.02)
open(os.environ["PIDS_FILE"] + ".tmp", "w").write(f"{os.getpid()} {child.pid}")
os.rename(os.environ["PIDS_FILE"] + ".tmp", os.environ["PIDS_FILE"])
os.kill(child.pid, signal.SIGSTOP)
os.kill(os.getpid(), signal.SIGSTOP)
child.wait()
"""


def test_the_launcher_kills_a_stopped_process_after_the_grace_period(tmp_path):
    """`launch_local.sh 2` when one host's processes are SIGSTOPped: process 0 exits, and the launcher's
    SIGTERM is never acted on by a stopped process (it waited 1,115 s). Now SIGKILL after STOP_GRACE, the
    training process's group too. The processes are stand-ins (PYTHON): what is tested is the launcher."""
    (tmp_path / "fake.py").write_text(FAKE_HOST)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} {tmp_path / "fake.py"} "$@"\n')
    python.chmod(0o755)
    env = {**os.environ, "PYTHON": str(python), "STOP_GRACE": "1", "PIDS_FILE": str(tmp_path / "pids")}
    t0 = time.monotonic()
    r = subprocess.run(
        [str(ROOT / "scripts/cluster/launch_local.sh"), "2"], env=env, capture_output=True, text=True, timeout=300
    )
    # 90 s: generous on a loaded machine, and far below the 1,115 s the SIGTERM-only launcher waited
    assert r.returncode == 3 and time.monotonic() - t0 < 90, r.stderr
    assert "launch_local: process 0 exited with status 3; stopping the others" in r.stderr
    assert (
        "launch_local: process 1 did not stop within 1s of SIGTERM (stopped or hung); killing it (SIGKILL)" in r.stderr
    )
    for pid in map(int, (tmp_path / "pids").read_text().split()):  # the supervisor and its training process
        assert gone(pid), pid


def test_a_stopped_training_process_is_the_one_named(capsys):
    """Host 1's training process SIGSTOPped, its supervisor running: process 0's collectives fail, and both
    processes blamed the healthy process 0. Now process 1's supervisor answers "stopped" when asked (so
    process 0 names process 1), and, told of process 0's end, names itself."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 60
        while not supervisor.is_stopped(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        host1, host0 = supervisor.Supervisor(launch_mod.Launch("127.0.0.1:1", 2, 1, "flags")), new_supervisor()
        host1.listener.state = lambda: host1._stalled(proc)
        # process 0's training process aborted: its supervisor asks process 1's, which says it is stopped
        host0.peers = [record(host1.listener, 1)]
        dead = host0._find_dead(tries=1)
        assert dead["index"] == 1 and "is stopped (SIGSTOP or a debugger)" in dead["how"], dead
        assert f"its training process (pid {proc.pid})" in dead["how"]
        # process 1's supervisor hears process 0's end (caused by 1), kills its stopped training process
        host1.peers = [record(host0.listener, 0)]
        host1.listener.hear([{**peer_lines.death(host0.me, time.time()), "cause": 1}])
        rc, stopped = host1._wait(proc)
        assert stopped and host1.was_stopped
        host1._reader = threading.Thread(target=lambda: None)
        host1._reader.start()
        assert host1._after(rc, stopped, proc.pid) == supervisor.PEER_DIED
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert (
            line.startswith("error: process 1 (host ") and f"its training process (pid {proc.pid}) was stopped" in line
        )
        assert "process 0" not in line
        assert host0.listener.gone[1]["how"] == supervisor.stopped_how(proc.pid)  # told process 0 too
    finally:
        proc.kill()
        proc.wait()
        for sup in ("host0", "host1"):
            if sup in locals():
                locals()[sup].listener.close(clean=True)


def test_a_killed_training_process_is_its_own_death_while_its_peer_decides(capsys):
    """Process 1's training process SIGKILLed; process 0's failed its collective and exited 1. Both supervisors
    asked each other at once: process 1 heard process 0's error exit (cause not yet known) and blamed it, exit 1
    instead of 137 (CI, test_a_killed_process_is_named_by_the_survivor). A kill is a death of its own: process 1
    names itself whatever its peer says, and process 0, asking, names process 1."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    proc.kill()
    rc = proc.wait()
    host1, host0 = supervisor.Supervisor(launch_mod.Launch("127.0.0.1:1", 2, 1, "flags")), new_supervisor()
    try:
        # process 0 is deciding: its own end is known, not yet why
        host0.listener.mine = {**peer_lines.death(host0.me, time.time(), peer_lines.ending(1)), "fatal": True}
        host1.peers, host0.peers = [record(host0.listener, 0)], [record(host1.listener, 1)]
        host1._reader = threading.Thread(target=lambda: None)
        host1._reader.start()
        assert host1._after(rc, False, proc.pid) == 128 + signal.SIGKILL
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert line.startswith("error: process 1 (host ") and "was killed by SIGKILL" in line, line
        assert host1.listener.gone[0]["how"] == "exited with status 1; see its output"  # heard, not blamed
        dead = host0._find_dead(tries=1)
        assert (dead["index"], dead["how"]) == (1, "killed by SIGKILL")
        # an error exit or abort still finds the peer that ended first, deciding or not
        assert peer_lines.root(host1.listener.gone)["index"] == 0
        assert peer_lines.root(host1.listener.gone, killed=True) is None
    finally:
        host0.listener.close(clean=True)
        host1.listener.close(clean=True)
