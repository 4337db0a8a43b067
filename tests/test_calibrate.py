"""`plan --calibrate` (jaxdist/analysis/calibrate.py): the alpha-beta fit, the measured entry written and
read back by `--hardware FILE.json`, bad hardware files, the before/after comparison. One calibration at
the tiny config's shapes (a few seconds; nothing compiled but a matmul, gathers and attention), its seconds
from a steady model machine, since a loaded one's may rightly be refused."""

import dataclasses
import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdist import plan
from jaxdist.analysis import calibrate
from jaxdist.distributed.mesh import AXES
from jaxdist.errors import JaxdistError
from jaxdist.planner import hardware


def test_the_fit_recovers_latency_and_bandwidth_through_noise():
    rng = np.random.default_rng(0)
    latency, bandwidth = 40e-6, 2e9
    points = [(b, (latency + b / bandwidth) * (1 + 0.02 * rng.standard_normal())) for b in (4e3, 3e4, 3e5, 3e6)]
    got_latency, got_bandwidth = calibrate.fit_alpha_beta(points)
    assert got_latency == pytest.approx(latency, rel=0.15) and got_bandwidth == pytest.approx(bandwidth, rel=0.05)
    with pytest.raises(JaxdistError, match="do not grow with their size"):
        calibrate.fit_alpha_beta([(1e3, 2e-3), (1e6, 1e-3)])
    with pytest.raises(JaxdistError, match="two or more sizes"):
        calibrate.fit_alpha_beta([(1e3, 1e-3), (1e3, 2e-3)])


def test_rank_correlation_and_the_comparison_figures():
    assert calibrate.rank_correlation([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert calibrate.rank_correlation([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert calibrate.rank_correlation([1, 1, 2], [1, 2, 3]) == pytest.approx(math.sqrt(3) / 2)  # ties: mean ranks
    assert math.isnan(calibrate.rank_correlation([1.0], [2.0]))
    found = calibrate.Comparison(["a", "b", "c"], [1.0, 2.0, 4.0], [2.0, 1.0, 1.0], [1.1, 2.2, 3.6])
    assert found.error(found.before) == pytest.approx(0.75) and found.error(found.after) == pytest.approx(0.1)
    assert found.correlation(found.before) == pytest.approx(-math.sqrt(3) / 2)
    assert found.correlation(found.after) == pytest.approx(1.0)
    assert found.lines("table", "measured")[-1].startswith(
        "prediction error (median |predicted/measured - 1|): table 75%"
    )


def steady_machine(fn) -> float:
    """calibrate.median_seconds on a machine no load can bend: `fn` runs (each figure's program compiles
    and runs as in a real calibration), and its seconds are 10 us + the bytes it returns at 1 GB/s."""
    out = jax.block_until_ready(fn())
    return 1e-5 + sum(x.nbytes for x in jax.tree.leaves(out)) / 1e9


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """`plan --calibrate FILE.json` on this machine's 8 simulated devices, in-process, timed by
    `steady_machine`: real timings on a loaded machine can make the gathers' times fall with their size,
    which the command rightly refuses (it did here once, two suites of 3 workers each side by side on 2 cores).
    median_seconds' own timing: test_median_seconds_times_each_call."""
    path = tmp_path_factory.mktemp("cal") / "here.json"
    with pytest.MonkeyPatch.context() as m:
        m.setattr(calibrate, "median_seconds", steady_machine)
        assert plan.main(["--calibrate", str(path), "--json"]) == 0
    return path


def test_median_seconds_times_each_call(monkeypatch):
    """One untimed call, then timed calls until MIN_SECONDS has been timed (3 at least, 50 at most); the
    median of those. A 10 ms sleep takes 10 ms or more however loaded the machine is."""
    calls = []

    def nap():
        calls.append(1)
        time.sleep(0.01)
        return jnp.zeros(())

    monkeypatch.setattr(calibrate, "MIN_SECONDS", 0.05)
    assert 0.01 <= calibrate.median_seconds(nap) < 10 and 4 <= len(calls) <= 6  # 5 x 10 ms: 0.05 s timed
    monkeypatch.setattr(calibrate, "MIN_SECONDS", 0.0)
    calls.clear()
    assert calibrate.median_seconds(nap) >= 0.01 and len(calls) == 4  # the untimed call and the 3 timed


def test_calibrate_writes_an_entry_that_plan_reads(measured, capsys):
    capsys.readouterr()  # the fixture's JSON line
    hw = hardware.get(str(measured))
    cpu = hardware.get("cpu")
    assert hw.name == "here" and hw.backend == "cpu" and hw.matmul_efficiency == 1.0 and hw.hop_fast_s == 0.0
    assert set(hw.peak_flops) == {"float32", "bfloat16"} and all(0 < v < 1e13 for v in hw.peak_flops.values())
    assert 0 < hw.fast_bandwidth == hw.slow_bandwidth < 1e12 and 0 <= hw.latency_s < 1.0
    assert hw.hbm_bytes == cpu.hbm_bytes and hw.devices_per_node == cpu.devices_per_node  # not measured: the base's
    # attention at every query length a sequence can have on a device (tiny: seq_len 128 over cp 1..8)
    assert [rows for rows, _ in hw.attention_rates] == [128, 64, 32, 16]
    assert all(0 < rate < 1e13 for _, rate in hw.attention_rates)
    assert plan.main(["--hardware", str(measured), "--mesh", "fsdp=8", "--no-scaling", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["hardware"] == "here" and out["recommended"]["step_s"] > 0


def test_bad_hardware_files_and_flags_are_one_line(measured, tmp_path, capsys):
    good = json.loads(measured.read_text())
    cases = [
        (tmp_path / "missing.json", None, "does not exist; write it with python -m jaxdist.plan --calibrate"),
        (tmp_path / "text.json", "not json", "is not readable JSON"),
        (tmp_path / "short.json", {k: v for k, v in good.items() if k != "latency_s"}, "is not a hardware entry"),
        (tmp_path / "extra.json", dict(good, lantency_s=1.0), "is not a hardware entry"),
        (tmp_path / "negative.json", dict(good, fast_bandwidth=-1.0), "not a non-negative number"),
        (tmp_path / "noflops.json", dict(good, peak_flops={"float32": 1e9}), "positive bfloat16 rate"),
        (tmp_path / "attention.json", dict(good, attention_rates=[[128, 0]]), "attention_rates \\[rows, FLOP/s\\]"),
        (tmp_path / "attention2.json", dict(good, attention_rates=[128, 1e9]), "attention_rates \\[rows, FLOP/s\\]"),
    ]
    for path, content, message in cases:
        if content is not None:
            path.write_text(content if isinstance(content, str) else json.dumps(content))
        with pytest.raises(JaxdistError, match=message):
            hardware.get(str(path))
    assert json.loads(json.dumps(dataclasses.asdict(hardware.load(measured)))) == good  # written whole, read back whole
    for argv, message in [
        (["--calibrate", str(tmp_path / "x.txt")], "give a FILE.json in an existing folder"),
        (["--calibrate", str(tmp_path / "no" / "x.json")], "give a FILE.json in an existing folder"),
        (["--calibrate", str(tmp_path / "x.json"), "--mesh", "dp=8"], "--calibrate measures the devices present"),
        (["--hardware", "h200"], "or a FILE.json from plan --calibrate"),
        (["--calibrate", str(tmp_path / "b.json"), "--mesh-search-budget", "0"], "--mesh-search-budget 0: give a"),
    ]:
        assert plan.main(argv) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "b.json").exists()  # refused before anything was measured or written


def test_query_rows_are_the_context_parallel_tiles():
    """seq_len / c for each power of two c up to the devices that the load-balanced cp layout takes
    (seq_len a multiple of 2 c)."""
    from jaxdist import config

    def rows(seq_len, devices=8):
        return calibrate.query_rows(config.load(None, [f"model.seq_len={seq_len}"]), devices)

    assert rows(1024) == [1024, 512, 256, 128] and rows(1024, 2) == [1024, 512]
    assert rows(12) == [12, 6] and rows(6) == [6]  # 6 is not a multiple of 2 x 2


def test_measured_attention_reorders_the_layouts():
    """Where the entry measured attention faster at short query tiles (as this machine is: docs/planner.md),
    cp=8's seq_len / 8 rows put it ahead of dp=8, which the table's matmul rate ranks first; the rate is
    the measured one nearest the tile (in ratio), and a fused-attention entry ignores the table."""
    from jaxdist import config
    from jaxdist.planner.estimate import estimate
    from jaxdist.planner.layout import Layout

    cfg = config.load(None, ["model.seq_len=1024", "model.num_layers=2"])
    ones = dict.fromkeys(AXES, 1)
    cpu = hardware.get("cpu")
    slow_long = dataclasses.replace(cpu, attention_rates=((1024, 2e9), (512, 2e9), (256, 2e9), (128, 4e9)))
    assert slow_long.attention_rate(1024) == 2e9 and slow_long.attention_rate(100) == 4e9
    assert slow_long.attention_rate(181) == 4e9 and slow_long.attention_rate(182) == 2e9  # nearest in ratio
    assert dataclasses.replace(slow_long, flash_attention=True).attention_rate(128) is None
    assert cpu.attention_rate(128) is None

    def step(mesh, hw):
        return estimate(Layout(cfg, ones | mesh, hw)).step_s

    assert step({"dp": 8}, cpu) < step({"cp": 8}, cpu)
    assert step({"cp": 8}, slow_long) < step({"dp": 8}, slow_long)
    # at 2 GFLOP/s (60x under the entry's matmul rate) attention takes most of dp=8's step
    assert step({"dp": 8}, slow_long) > 5 * step({"dp": 8}, cpu)


def test_calibrate_holds_the_search_to_its_budget(measured, tmp_path, monkeypatch):
    """`plan --calibrate F --mesh-search-steps N --mesh-search-budget S`: the search it runs is held to S."""
    from jaxdist.analysis import mesh_search

    fake = calibrate.Calibration(8, (1, 1, 1), {"float32": 1e9, "bfloat16": 1e9}, ((1e3, 1e-3),), 1e-5, 1e9)
    monkeypatch.setattr(calibrate, "measure", lambda cfg, devices, attention=True: fake)
    calls = []

    def run(cfg, hw, **kwargs):
        calls.append(kwargs)
        raise JaxdistError("stop here")

    monkeypatch.setattr(mesh_search, "run", run)
    argv = ["--calibrate", str(tmp_path / "c.json"), "--mesh-search-steps", "2", "--mesh-search-budget", "7.5"]
    assert plan.main(argv) == 2
    assert calls == [dict(top_k=3, steps=2, timed=3, budget_s=7.5)]


def test_compare_estimates_the_timed_layouts_under_both_entries(measured):
    """The comparison's 'before' column is the planner under the base entry, 'after' under the measured
    one, for the timed rows only (the search's rows carry the measured entry's estimates)."""
    from jaxdist import config
    from jaxdist.planner import search
    from jaxdist.planner.estimate import estimate
    from jaxdist.planner.layout import Layout

    cfg, hw, cpu = config.load(None, []), hardware.get(str(measured)), hardware.get("cpu")
    ones = dict.fromkeys(search.mesh_shapes(8)[0], 1)
    rows = [search.Row(estimate(Layout(cfg, ones | m, hw))) for m in ({"fsdp": 8}, {"dp": 8})]
    rows[0].measured_s = 0.5
    found = calibrate.compare(rows, cpu)
    assert found.names == [rows[0].name] and found.measured == [0.5] and found.after == [rows[0].est.step_s]
    assert found.before == [estimate(Layout(cfg, rows[0].est.layout.mesh, cpu)).step_s] != found.after
    with pytest.raises(JaxdistError, match="give --mesh-search-steps N > 0"):
        calibrate.compare(rows[1:], cpu)


def test_train_mesh_auto_takes_a_measured_entry(measured, tmp_path, monkeypatch, capsys):
    """`train --mesh auto --hardware FILE.json` searches with the measured entry (mesh_auto.hardware_here);
    --hardware without --mesh auto, or a bad file, is one line before anything is written."""
    from jaxdist import train
    from jaxdist.analysis import mesh_auto

    got = mesh_auto.hardware_here(2e6, str(measured))
    assert got == dataclasses.replace(hardware.load(measured), hbm_bytes=got.hbm_bytes) and got.name == "here"
    assert mesh_auto.hardware_here(None, None).name == "cpu"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.json").write_text("{}")
    for argv, message in [
        (["--hardware", str(measured), "--steps", "1"], "--hardware belong to --mesh auto; add it or drop them"),
        (["--mesh", "auto", "--hardware", "bad.json", "--steps", "1"], "bad.json is not a hardware entry"),
    ]:
        assert train.main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json"]  # no run dir
