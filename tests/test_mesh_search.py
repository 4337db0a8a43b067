"""The layout search (`plan --search`): enumeration, the compiler's veto, the choice given timings; and
`--mesh auto`'s kept decision (jaxdist/analysis/mesh_auto.py): the recorded layout, the decision cache."""

import dataclasses
import itertools
import json
import math
import types

import jax
import numpy as np
import pytest
from conftest import MICRO_MODEL, SMALL_MODEL

from jaxdist import config, plan
from jaxdist.analysis import calibrate, mesh_auto, mesh_search
from jaxdist.distributed.mesh import AXES, format_mesh, parse_mesh
from jaxdist.errors import JaxdistError
from jaxdist.parallel import schedule_registry
from jaxdist.planner import hardware, memory, search
from jaxdist.planner.estimate import estimate
from jaxdist.planner.layout import Layout

CPU = hardware.get("cpu")
# plan --calibrate's figures, stood in for where a timed search measures the machine first (mesh_auto.measured_here)
FAKE_CALIBRATION = calibrate.Calibration(
    8, (1, 1, 1), {"float32": 1e9, "bfloat16": 1e9}, ((1e3, 1e-3),), 1e-5, 1e9, 1e9, ((16, 2e9),)
)


def test_enumeration_counts_every_axis_combination():
    """Every ordered split of the device count over the six axes, and every setting a mesh allows."""
    for n, want in ((1, 1), (8, math.comb(3 + 5, 5)), (12, math.comb(2 + 5, 5) * math.comb(1 + 5, 5))):
        shapes = search.mesh_shapes(n)
        assert len(shapes) == want and all(math.prod(s.values()) == n and tuple(s) == AXES for s in shapes)
        brute = {t for t in itertools.product(range(1, n + 1), repeat=6) if math.prod(t) == n}
        assert {tuple(s.values()) for s in shapes} == brute
    cfg = config.load(None, [f"model.{k}={v}" for k, v in SMALL_MODEL.items()])  # global_batch 8
    # dp=8: one row per device, so accumulation 1 only: one setting per remat policy
    assert len(search.settings(cfg, parse_mesh("dp=8", 8))) == len(search.REMATS)
    # fsdp=2: 4 rows -> accumulation 1, 2, 4
    assert len(search.settings(cfg, parse_mesh("fsdp=2,tp=4", 8))) == 3 * len(search.REMATS)
    # pp=2,fsdp=2: 4 rows -> accum 1 (M=2, 4), accum 2 (M=2), accum 4 (none): 3 per schedule and remat
    pp = search.settings(cfg, parse_mesh("pp=2,fsdp=2,tp=2", 8))
    assert len(pp) == 3 * len(schedule_registry.SCHEDULES) * len(search.REMATS)
    assert {c.pipeline.schedule for c in pp} == set(schedule_registry.SCHEDULES)
    assert all(c.train.global_batch == 8 for c in pp)


def test_deep_narrow_offers_cp_and_pp_to_the_timing_phase(monkeypatch):
    """A deep narrow model at a long seq_len (scripts/bench/mesh_sweep.py's deep-narrow): the enumeration
    offers cp and pp meshes that fit, and the shortlist of 3 holds one of each beside the dp/fsdp best
    (remat none only: each policy is a trace of its own, and the meshes offered do not depend on it)."""
    monkeypatch.setattr(search, "REMATS", ("none",))
    deep = dict(num_layers=8, d_model=64, num_heads=2, num_kv_heads=1, head_dim=32, mlp_dim=256, seq_len=1024)
    cfg = config.load("tiny", [f"model.{k}={v}" for k, v in deep.items()])
    found = search.enumerate_layouts(cfg, 8, CPU)
    fits = {tuple(a for a in AXES if e.layout.mesh[a] > 1) for e in found.fitting}
    assert {("cp",), ("dp", "cp"), ("pp",), ("dp", "pp"), ("pp", "fsdp")} <= fits
    assert len(found.meshes) == 30 and len(search.per_mesh(found.fitting)) == 87  # measured: a change says so
    assert [search.family(e.layout) for e in search.shortlist(found.fitting, 3)] == [(), ("cp",), ("pp",)]


def _row(cfg, mesh, step_s, measured=None, compiled=1000, dropped=""):
    lay = Layout(cfg, parse_mesh(mesh, 8), CPU)
    est = types.SimpleNamespace(layout=lay, step_s=step_s, memory=types.SimpleNamespace(total=900))
    return search.Row(est, compiled_bytes=compiled, measured_s=measured, dropped=dropped)


def test_choice_is_deterministic_given_the_timings():
    cfg = config.load(None, [f"model.{k}={v}" for k, v in SMALL_MODEL.items()])
    rows = [
        _row(cfg, "dp=8", 1.0, measured=0.050, dropped="dropped: the compiler counts more"),
        _row(cfg, "fsdp=8", 1.1, measured=0.040),
        _row(cfg, "dp=2,fsdp=4", 1.2, measured=0.030),
        _row(cfg, "dp=4,fsdp=2", 1.3, measured=0.0305),  # within 3% of the fastest: ranked lower, loses
        _row(cfg, "tp=2,fsdp=4", 1.4),  # compiled, not timed
    ]
    best, reason = search.choose(rows)
    assert best is rows[2] and "chose dp=2,fsdp=4" in reason and "tie" in reason
    assert search.choose(rows) == (best, reason)  # a pure function of its inputs
    rows[3].measured_s = 0.0295  # now the fastest and the other within the tie band: the higher rank wins
    assert search.choose(rows)[0] is rows[2]
    rows[3].measured_s = 0.020
    assert search.choose(rows)[0] is rows[3]
    for r in rows:  # no timings: the planner's best that the compiler let through
        r.measured_s = None
    assert search.choose(rows)[0] is rows[1] and "not timed" in search.choose(rows)[1]
    with pytest.raises(JaxdistError, match="no candidate layout fits by the compiler's count"):
        search.choose([rows[0]])


def test_the_compiler_vetoes_a_layout_the_planner_passed(capsys):
    """A layout compiled for real: its memory_analysis() total is recorded, and under a budget one byte
    short of it the row is dropped with a line naming the planner's miss; the choice skips it."""
    cfg = config.load(None, [f"model.{k}={v}" for k, v in MICRO_MODEL.items()])
    lay = Layout(cfg, parse_mesh("dp=8", 8), CPU)
    est = estimate(lay, "search")
    row = search.Row(est)
    assert mesh_search.compile_row(row, jax.devices(), capacity=float("inf")) is not None
    total = row.compiled_bytes
    assert not row.dropped and 0.5 < est.memory.total / total < 1.5  # the planner's figure, near the compiler's
    vetoed = search.Row(est)
    mesh_search.judge(vetoed, total, capacity=total - 1)
    assert vetoed.dropped.startswith("dropped: the compiler counts") and "the planner's" in vetoed.dropped
    assert f"{est.memory.total / total - 1:+.1%}" in vetoed.dropped
    assert search.choose([vetoed, row])[0] is row
    assert search.with_budget(CPU, 5e6).hbm_bytes * memory.USABLE_FRACTION == pytest.approx(5e6)
    text = search.table([vetoed, row], 5e6)
    found = search.Enumeration([lay.mesh], [est], [est], 0)
    result = mesh_search.Result([vetoed, row], row, "r", found, 5e6, 1.0, 2.0, 0.0)
    doc = json.loads(json.dumps(result.as_dict()))  # plan --search --json
    assert doc["mesh"] == "dp=8" and doc["rows"][0]["dropped"] == vetoed.dropped
    assert doc["rows"][1]["compiled_bytes"] == total and result.cfg.mesh.shape == "dp=8"
    assert "compiled 2, timed 0" in result.summary()
    assert "dropped: the compiler counts" in text and f"{total / 1e6:.2f}" in text


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--search", "--mesh", "dp=8"], "--search chooses the mesh"),
        (["--search", "--memory-budget", "lots"], "--memory-budget 'lots'"),
        (["--search", "--memory-budget=-3MB"], "must be positive"),
    ],
)
def test_search_flags_refused_in_one_line(argv, words, capsys):
    assert plan.main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1


def test_parse_bytes():
    assert hardware.parse_bytes("300MB") == 300e6 and hardware.parse_bytes("2GiB") == 2 * 2**30
    assert hardware.parse_bytes("123") == 123


def test_mesh_auto_resume_keeps_the_recorded_layout(tmp_path, monkeypatch):
    """A run dir whose config.yaml (or latest config.<n>.yaml) records a layout for the devices present
    resumes with it and searches nothing; recorded for another device count, it searches again, saying so."""
    cfg = config.load(None, [f"model.{k}={v}" for k, v in MICRO_MODEL.items()] + ["mesh.shape=auto"])
    recorded = cfg.replace(
        mesh=dict(shape="pp=1,fsdp=4,tp=2"), model=dict(remat="full"), train=dict(grad_accum_steps=2)
    )
    (tmp_path / "config.yaml").write_text(config.dump(cfg.replace(mesh=dict(shape="fsdp=8"))))
    (tmp_path / "config.1.yaml").write_text("# resumed at step 5\n# changed: none\n" + config.dump(recorded))

    def no_search(*a, **k):
        raise AssertionError("searched although a layout was recorded")

    monkeypatch.setattr(mesh_search, "run", no_search)
    lines = []
    got, changed = mesh_auto.auto_layout(cfg, tmp_path, CPU, log=lines.append)
    assert (got.mesh.shape, got.model.remat, got.train.grad_accum_steps) == ("pp=1,fsdp=4,tp=2", "full", 2)
    assert changed == frozenset() and "kept on resume" in lines[0]
    (tmp_path / "config.2.yaml").write_text(config.dump(recorded.replace(mesh=dict(shape="fsdp=4"))))

    class Searched(Exception):
        pass

    def search_again(*a, **k):
        raise Searched

    monkeypatch.setattr(mesh_search, "run", search_again)
    with pytest.raises(Searched):
        mesh_auto.auto_layout(cfg, tmp_path, CPU, log=lines.append)
    assert "recorded a layout for 4 devices, 8 are present: searching again" in lines[-1]


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--mesh-search-steps", "2"], "belong to --mesh auto"),
        (["--mesh", "auto", "--print-config"], "--mesh auto is decided when training starts"),
        (["--mesh", "auto", "--memory-budget", "x"], "--memory-budget 'x'"),
        (["--mesh-search-budget", "5"], "belong to --mesh auto"),
        (["--mesh", "auto", "--mesh-search-budget", "0"], "--mesh-search-budget 0: give a positive number"),
    ],
)
def test_train_mesh_auto_flags_refused_in_one_line(argv, words, capsys):
    from jaxdist import train

    assert train.main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1


class _Clock:
    """mesh_search's clock: each fake compile or timing advances it by its stated seconds (no sleeping,
    so a loaded machine cannot move the result)."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


def _fake_compile(clock, seconds):
    def compile_row(row, devices, capacity):
        clock.now += seconds
        row.compiled_bytes, row.compile_s = 1000, seconds
        return "program", "compiled"

    return compile_row


def test_time_budget_stops_early_and_says_so(monkeypatch):
    """A budget spent by the first compile leaves the rest uncompiled, each with a line; a budget spent
    by the compiles leaves the timing undone; the first candidate is always compiled; no budget: all."""
    cfg = config.load(None, [f"model.{k}={v}" for k, v in MICRO_MODEL.items()])
    clock = _Clock()
    monkeypatch.setattr(mesh_search, "time", clock)
    monkeypatch.setattr(mesh_search, "compile_row", _fake_compile(clock, 2.0))

    def time_steps(prog, compiled, cfg, steps):
        clock.now += 1.0 * steps
        return 0.01 * steps

    monkeypatch.setattr(mesh_search, "time_steps", time_steps)
    meshes = ("dp=8", "fsdp=8", "dp=2,fsdp=4")

    def rows():
        return [_row(cfg, m, 1.0 + i, compiled=None) for i, m in enumerate(meshes)]

    tight = rows()
    compile_s, time_s = mesh_search.measure(tight, [], 1e9, steps=2, timed=3, budget_s=1.0)
    assert [r.compiled_bytes for r in tight] == [1000, None, None]
    assert [r.measured_s for r in tight] == [None] * 3  # the budget was spent before any timing
    assert tight[0].not_reached.startswith("not timed: the 1 s budget")
    assert all(r.not_reached.startswith("not reached: the 1 s budget") for r in tight[1:])
    assert (compile_s, time_s) == (2.0, 0.0)
    assert search.choose(tight)[0] is tight[0] and "not timed" in search.choose(tight)[1]
    found = search.Enumeration([], [], [], 0)
    result = mesh_search.Result(tight, tight[0], "r", found, 1e9, 0.0, compile_s, time_s, 1.0)
    assert "(budget 1 s; 3 candidates not reached)" in result.summary()
    assert result.as_dict()["not_reached"] == [r.name for r in tight]
    assert "not reached: the 1 s budget" in search.table(tight, 1e9)
    middle = rows()  # 3 compiles (6 s) and one timing (2 s) fit 7 s; the second timing is not reached
    assert mesh_search.measure(middle, [], 1e9, steps=2, timed=3, budget_s=7.0) == (6.0, 2.0)
    assert all(r.compiled_bytes == 1000 for r in middle) and middle[0].measured_s == 0.02
    assert all("not timed: the 7 s budget" in r.not_reached for r in middle[1:])
    free = rows()
    assert mesh_search.measure(free, [], 1e9, steps=2, timed=2, budget_s=None) == (6.0, 4.0)
    assert [r.measured_s for r in free] == [0.02, 0.02, None] and not any(r.not_reached for r in free)
    with pytest.raises(JaxdistError, match="--mesh-search-budget 0: give a positive number"):
        mesh_search.run(cfg, CPU, budget_s=0)


def _fake_search(cfg, calls, chosen=0):
    def run(c, hw, **kwargs):
        calls.append(kwargs)
        rows = [_row(cfg, m, 1.0 + i) for i, m in enumerate(("fsdp=4,tp=2", "dp=8"))]
        found = search.Enumeration([], [], [], 0)
        return mesh_search.Result(rows, rows[chosen], f"chose {rows[chosen].name}", found, 1e9, 0.0, 0.0, 0.0)

    return run


def test_second_start_reads_the_cached_decision(tmp_path, monkeypatch):
    """The decision is cached by (config, devices): a second start of the same config in a new run dir
    searches nothing; another config searches; a decision cached for other devices is re-made, saying so."""
    cfg = config.load(None, [f"model.{k}={v}" for k, v in MICRO_MODEL.items()] + ["mesh.shape=auto"])
    calls, lines = [], []
    monkeypatch.setattr(mesh_search, "run", _fake_search(cfg, calls))
    cache = tmp_path / "cache"
    first, _ = mesh_auto.auto_layout(cfg, tmp_path / "a", CPU, log=lines.append, budget_s=5.0, cache=cache)
    assert first.mesh.shape == "fsdp=4,tp=2" and len(calls) == 1 and calls[0]["budget_s"] == 5.0
    assert "ranked with the cpu entry, whose attention runs at its matmul rate" in lines[-1]  # the calibration hint
    again, changed = mesh_auto.auto_layout(
        cfg.replace(train=dict(steps=99)), tmp_path / "b", CPU, log=lines.append, budget_s=5.0, cache=cache
    )
    assert len(calls) == 1 and "cached in" in lines[-1] and "no search" in lines[-1]
    assert (again.mesh.shape, again.model.remat, changed) == ("fsdp=4,tp=2", first.model.remat, frozenset())
    mesh_auto.auto_layout(cfg.replace(model=dict(d_model=48)), tmp_path / "c", CPU, log=lines.append, cache=cache)
    assert len(calls) == 2  # another config: another key
    measured = dataclasses.replace(CPU, attention_rates=((128, 1e9),))  # as plan --calibrate writes it
    mesh_auto.auto_layout(cfg, tmp_path / "m", measured, log=lines.append, cache=cache)
    assert len(calls) == 3 and lines[-1].startswith("--mesh auto: chose fsdp=4,tp=2")  # another entry: no hint
    monkeypatch.setattr(mesh_auto, "devices_here", lambda: "4 x cpu in 1 process(es)")
    mesh_auto.auto_layout(cfg, tmp_path / "d", CPU, log=lines.append, budget_s=5.0, cache=cache)
    assert len(calls) == 4 and any("8 x cpu in 1 process(es), 4 x cpu in 1 process(es) are present" in x for x in lines)
    assert len(list(cache.glob("*.json"))) == 3 and not list(cache.glob("*.tmp"))


def test_timed_search_on_the_cpu_entry_ranks_by_this_machines_figures(tmp_path, monkeypatch):
    """With timed steps, an entry without measured attention (the table's CPU one) is measured first
    (calibrate.measure, here a stand-in) and the search ranks by that; the decision is cached under the
    entry asked for, so the second start neither measures nor searches. Several processes keep the
    table's entry (each would measure its own figures, and the search needs the same candidates on all)."""
    from jaxdist.analysis import calibrate

    cfg = config.load(None, [f"model.{k}={v}" for k, v in MICRO_MODEL.items()] + ["mesh.shape=auto"])
    fake = calibrate.Calibration(
        8, (1, 1, 1), {"float32": 1e9, "bfloat16": 1e9}, ((1e3, 1e-3),), 1e-5, 1e9, 1e9, ((16, 2e9),)
    )
    measured, ranked, lines = [], [], []
    monkeypatch.setattr(calibrate, "measure", lambda c, devices: measured.append(c) or fake)
    search_run = _fake_search(cfg, [])
    monkeypatch.setattr(mesh_search, "run", lambda c, hw, **kw: ranked.append(hw) or search_run(c, hw, **kw))
    cache = tmp_path / "cache"
    for run_dir in ("a", "b"):
        mesh_auto.auto_layout(cfg, tmp_path / run_dir, CPU, steps=1, log=lines.append, cache=cache)
    assert len(measured) == len(ranked) == 1 and ranked[0].attention_rates == ((16, 2e9),)
    assert ranked[0].hbm_bytes == CPU.hbm_bytes and ranked[0].name == "cpu, measured here"
    assert any("measured this machine for the ranking" in x for x in lines) and "no search" in lines[-1]
    assert not any("whose attention runs at its matmul rate" in x for x in lines)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    assert mesh_auto.measured_here(cfg, CPU, lines.append) is CPU and len(measured) == 1


def test_two_processes_take_process_zeros_choice(tmp_path, monkeypatch):
    """Several processes: the index process 0 broadcasts is the layout every process trains (whatever its
    own timings chose), and no process reads or writes the decision cache."""
    from jax.experimental import multihost_utils

    cfg = config.load(None, [f"model.{k}={v}" for k, v in MICRO_MODEL.items()] + ["mesh.shape=auto"])
    calls, sent = [], []
    monkeypatch.setattr(mesh_search, "run", _fake_search(cfg, calls, chosen=0))
    monkeypatch.setattr(jax, "process_count", lambda: 2)

    def broadcast(x):
        sent.append(int(x))
        return np.int32(1)  # process 0 chose row 1

    monkeypatch.setattr(multihost_utils, "broadcast_one_to_all", broadcast)
    got, _ = mesh_auto.auto_layout(cfg, tmp_path, CPU, log=lambda line: None, cache=mesh_auto.cache_dir())
    assert sent == [0] and got.mesh.shape == "dp=8" and mesh_auto.cache_dir() is None
    monkeypatch.setattr(jax, "process_count", lambda: 1)
    assert mesh_auto.auto_layout(cfg, tmp_path / "one", CPU, log=lambda line: None)[0].mesh.shape == "fsdp=4,tp=2"


def test_bench_mesh_auto_measures_the_choice(monkeypatch, capsys):
    """`bench --mesh auto` measures the layout the search chose and names it in the record; its search
    flags without --mesh auto are one line."""
    from jaxdist import bench
    from jaxdist.analysis import bench as measuring

    cfg = config.load(None, [f"model.{k}={v}" for k, v in MICRO_MODEL.items()])
    calls, measured = [], []
    monkeypatch.setattr(mesh_search, "run", _fake_search(cfg, calls, chosen=1))
    monkeypatch.setattr(measuring, "measure", lambda c, m, w, s: measured.append((m, w, s)) or dict(mesh=m))
    monkeypatch.setattr(calibrate, "measure", lambda c, devices: FAKE_CALIBRATION)  # timed: ranked by measured figures
    assert bench.main(["--mesh", "auto", "--steps", "2", "--warmup", "1", "--mesh-search-steps", "3"]) == 0
    out, err = capsys.readouterr()
    record = json.loads(out.splitlines()[0])
    assert measured == [("dp=8", 1, 2)] and calls[0]["steps"] == 3
    assert record["mesh"] == "dp=8" and record["auto"]["chosen"].startswith("dp=8") and "--mesh auto: chose" in err
    assert "measured this machine for the ranking" in err
    assert bench.main(["--mesh", "dp=8", "--mesh-search-steps", "2"]) == 2
    assert "belong to --mesh auto" in capsys.readouterr().err


def _est(cfg, mesh, step_s):
    lay = Layout(cfg, parse_mesh(mesh, 8), CPU)
    memory = types.SimpleNamespace(total=900, fits=True, capacity=1e9)
    return types.SimpleNamespace(layout=lay, step_s=step_s, memory=memory)


# A too-big-like ranking (docs/planner.md's sweep): the pure dp/fsdp layouts predicted fastest and within
# a few percent of the tp ones, a pp layout well outside PREDICTION_SPREAD.
_RANKING = (
    ("dp=2,fsdp=4", 1.00),
    ("fsdp=8", 1.001),
    ("dp=4,fsdp=2", 1.002),
    ("fsdp=4,cp=2", 1.01),
    ("dp=4,tp=2", 1.03),
    ("fsdp=4,tp=2", 1.04),
    ("dp=2,fsdp=2,tp=2", 1.05),
    ("pp=2,fsdp=4", 2.5),
)


def test_search_times_a_family_outside_the_predicted_top_k(monkeypatch):
    """Predictions the planner cannot order (within PREDICTION_SPREAD): the shortlist holds the best of each
    axis family, not the K nearest; the timed winner's family is searched deeper (refine), so the layout
    measured fastest, ranked 6th by predicted time, is timed and chosen; the choice is a function of the
    timings, and with several processes the family refined is process 0's."""
    cfg = config.load(None, [f"model.{k}={v}" for k, v in MICRO_MODEL.items()])
    fitting = [_est(cfg, m, s) for m, s in _RANKING]
    names = [format_mesh(e.layout.mesh) for e in search.shortlist(fitting, 3)]
    assert names == ["dp=2,fsdp=4", "fsdp=4,cp=2", "dp=4,tp=2"]  # the K nearest were dp/fsdp only
    assert search.family(fitting[3].layout) == ("cp",) and search.family(fitting[-1].layout) == ("pp",)
    five = [format_mesh(e.layout.mesh) for e in search.shortlist(fitting, 5)]  # the families, then by rank
    assert five == ["dp=2,fsdp=4", "fsdp=8", "dp=4,fsdp=2", "fsdp=4,cp=2", "dp=4,tp=2"]
    measured = {"dp=2,fsdp=4": 0.030, "fsdp=8": 0.031, "dp=4,fsdp=2": 0.033, "fsdp=4,cp=2": 0.05}
    measured.update({"dp=4,tp=2": 0.020, "fsdp=4,tp=2": 0.012, "dp=2,fsdp=2,tp=2": 0.016, "pp=2,fsdp=4": 0.01})
    compiled = []

    def compile_row(row, devices, capacity):
        compiled.append(format_mesh(row.est.layout.mesh))
        row.compiled_bytes, row.compile_s = 1000, 1.0
        return compiled[-1], "compiled"

    monkeypatch.setattr(mesh_search, "compile_row", compile_row)
    monkeypatch.setattr(mesh_search, "time_steps", lambda prog, c, cfg, steps: measured[prog])
    monkeypatch.setattr(search, "enumerate_layouts", lambda c, n, hw: search.Enumeration([], fitting, fitting, 0))
    result = mesh_search.run(cfg, CPU, top_k=3, steps=1, devices=[None] * 8)
    assert compiled == ["dp=2,fsdp=4", "fsdp=4,cp=2", "dp=4,tp=2", "fsdp=4,tp=2", "dp=2,fsdp=2,tp=2"]
    assert result.chosen.name.startswith("fsdp=4,tp=2") and "planner ranked it #4" in result.reason
    assert [format_mesh(r.est.layout.mesh) for r in result.rows] == compiled  # rank order, as choose reads it
    again = mesh_search.run(cfg, CPU, top_k=3, steps=1, devices=[None] * 8)
    assert (again.chosen.name, again.reason) == (result.chosen.name, result.reason)
    from jax.experimental import multihost_utils

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(multihost_utils, "broadcast_one_to_all", lambda x: np.int32(0))  # process 0: dp/fsdp won
    compiled.clear()
    mesh_search.run(cfg, CPU, top_k=3, steps=1, devices=[None] * 8)
    assert compiled[3:] == ["fsdp=8", "dp=4,fsdp=2"]  # process 0's winner's family, whatever ours timed
