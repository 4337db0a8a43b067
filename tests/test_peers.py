"""The supervisors of multi-process runs, without JAX: the lines, who is blamed, the questions and news, the ring watch.
Real processes killed mid-run: tests/test_distributed.py::test_a_killed_process_is_named_by_the_survivor."""

import socket
import threading
import time

import pytest

from jaxdist.distributed import launch as launch_mod
from jaxdist.distributed import peer_lines, peer_wire, peers, supervisor


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
    deadline = time.monotonic() + 5
    while not peer.watchers and time.monotonic() < deadline:
        time.sleep(0.01)
    peer.close(clean=clean)
    watch.join(timeout=5)
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
    assert found["how"] == "no answer within 0.3s: killed, crashed, or its host is down"
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
