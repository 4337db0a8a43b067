"""The layout search (`plan --search`): enumeration, the compiler's veto, the choice given timings."""

import itertools
import json
import math
import types

import jax
import pytest
from conftest import MICRO_MODEL, SMALL_MODEL

from jaxdist import config, plan
from jaxdist.analysis import mesh_search
from jaxdist.distributed.mesh import AXES, parse_mesh
from jaxdist.errors import JaxdistError
from jaxdist.parallel import schedule_registry
from jaxdist.planner import hardware, memory, search
from jaxdist.planner.estimate import estimate
from jaxdist.planner.layout import Layout

CPU = hardware.get("cpu")


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
    got, changed = mesh_search.auto_layout(cfg, tmp_path, CPU, log=lines.append)
    assert (got.mesh.shape, got.model.remat, got.train.grad_accum_steps) == ("pp=1,fsdp=4,tp=2", "full", 2)
    assert changed == frozenset() and "kept on resume" in lines[0]
    (tmp_path / "config.2.yaml").write_text(config.dump(recorded.replace(mesh=dict(shape="fsdp=4"))))

    class Searched(Exception):
        pass

    def search_again(*a, **k):
        raise Searched

    monkeypatch.setattr(mesh_search, "run", search_again)
    with pytest.raises(Searched):
        mesh_search.auto_layout(cfg, tmp_path, CPU, log=lines.append)
    assert "recorded a layout for 4 devices, 8 are present: searching again" in lines[-1]


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--mesh-search-steps", "2"], "belong to --mesh auto"),
        (["--mesh", "auto", "--print-config"], "--mesh auto is decided when training starts"),
        (["--mesh", "auto", "--memory-budget", "x"], "--memory-budget 'x'"),
    ],
)
def test_train_mesh_auto_flags_refused_in_one_line(argv, words, capsys):
    from jaxdist import train

    assert train.main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1
