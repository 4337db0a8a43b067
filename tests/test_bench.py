import json
import os

import pytest
from conftest import SMALL_ARGS

from jaxdist import bench

SMALL = SMALL_ARGS


def test_bench_prints_one_json_line_per_mesh(capsys):
    assert (
        bench.main(
            [
                "--mesh",
                "fsdp=1",
                "--mesh",
                "pp=2,fsdp=4",
                "--warmup",
                "1",
                "--steps",
                "2",
                *SMALL,
                "pipeline.microbatches=2",
                "--table",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    lines = [json.loads(x) for x in out.strip().splitlines() if x.startswith("{")]
    assert [r["devices"] for r in lines] == [1, 8]
    assert [r["mesh"] for r in lines] == ["fsdp=1", "pp=2,fsdp=4"]  # the mesh asked for, not 'dp=1'
    for r in lines:
        for key in (
            "tokens_per_sec",
            "step_time_s",
            "mfu",
            "flops_per_sec",
            "flops_per_token",
            "compile_s",
            "bytes_per_device",
            "collectives",
        ):
            assert key in r, key
        assert r["tokens_per_sec"] > 0 and r["bytes_per_device"]["arguments"] > 0
    one, eight = lines
    assert one["collectives"] == {}  # one device communicates nothing
    assert one["pipeline"]["schedule"] == "none"
    assert "all-gather" in eight["collectives"]  # fsdp gathers parameters
    assert eight["collectives"]["collective-permute"]["bytes"] > 0  # stages pass activations
    # per mesh axes: the stages' permutes cross pp only, the weight gathers fsdp only; the split adds up
    by_axis = eight["collectives_by_axis"]
    assert set(by_axis["pp"]) >= {"collective-permute"} and set(by_axis["fsdp"]) >= {"all-gather"}
    assert "collective-permute" not in by_axis["fsdp"] and "all-gather" not in by_axis["pp"]
    for kind, total in eight["collectives"].items():
        parts = [kinds[kind] for kinds in by_axis.values() if kind in kinds]
        assert sum(p["count"] for p in parts) == total["count"]
        assert sum(p["bytes"] for p in parts) == pytest.approx(total["bytes"])
    assert one["collectives_by_axis"] == {}
    assert eight["pipeline"] == {
        "schedule": "gpipe",
        "stages": 2,
        "microbatches": 2,
        "repeats": 1,
        "iterations": 3,
        "bubble_fraction": 1 / 3,
    }
    assert eight["bytes_per_device"]["arguments"] < one["bytes_per_device"]["arguments"] / 4
    # --table: one row per mesh after the JSON lines, then the legend and the CPU all-reduce note
    rows = out.split("\n\n", 1)[1].splitlines()
    assert rows[2].startswith("fsdp=1 ") and rows[2].endswith("none")
    permutes = eight["collectives"]["collective-permute"]["count"]
    assert rows[3].startswith("pp=2,fsdp=4 ") and f"CP {permutes}x " in rows[3] and " AG " in rows[3]
    assert f"{eight['tokens_per_sec']:,.0f}" in rows[3]
    assert rows[-1].startswith("note: on CPU, XLA's partitioner reduces FSDP gradients with an all-reduce")


def test_compile_only_allocates_nothing_and_prints_no_timings(capsys, monkeypatch):
    """--compile-only: the same JSON line from abstract inputs; running or placing anything is an error.
    With --hardware: a verdict against that device's usable memory, the planner's bytes beside the
    compiler's, and (on CPU) the parts of the CPU program a GPU's does not have; the verdict turns when
    the budget is below the planner's figure."""
    import dataclasses

    import jax

    from jaxdist import config
    from jaxdist.analysis import bench as bench_mod
    from jaxdist.distributed import mesh as mesh_mod
    from jaxdist.planner import hardware

    monkeypatch.setattr(jax, "device_put", lambda *a, **k: (_ for _ in ()).throw(AssertionError("allocated")))
    argv = ["--compile-only", "--mesh", "fsdp=8", *SMALL, "model.compute_dtype=bfloat16"]
    assert bench.main([*argv, "--hardware", "h100-80gb"]) == 0
    out, err = capsys.readouterr()
    (r,) = [json.loads(x) for x in out.strip().splitlines()]
    assert not {"tokens_per_sec", "step_time_s", "mfu", "loss"} & set(r)
    assert r["devices"] == 8 and r["bytes_per_device"]["arguments"] > 0 and r["bytes_per_device"]["temp"] > 0
    assert r["bytes_per_device"]["host_arguments"] == r["bytes_per_device"]["host_outputs"] == 0
    assert "all-gather" in r["collectives"] and r["pipeline"]["schedule"] == "none"
    h100 = hardware.get("h100-80gb")
    assert r["hardware"] == "h100-80gb" and r["verdict"] == "fits" and r["verdict_from"] == "planner"
    assert 0.5 * h100.hbm_bytes < r["budget_bytes"] <= h100.hbm_bytes
    assert r["bytes_per_device"]["arguments"] <= r["planner_bytes"] < 10 * r["compiled_bytes"]  # same order
    assert r["compiled_bytes"] == r["bytes_per_device"]["total"]
    assert "attention scores materialised" in r["not_representative"] and "bfloat16" in r["not_representative"]
    assert err.startswith("fsdp=8 on h100-80gb: FITS (planner's figure") and "the CPU program is not a GPU's" in err
    small = dataclasses.replace(h100, name="small-gpu", hbm_bytes=r["planner_bytes"] / 2)
    monkeypatch.setitem(hardware.HARDWARE, "small-gpu", small)
    cfg = config.load(None, [*SMALL, "model.compute_dtype=bfloat16"])
    got = bench_mod.fit(cfg, mesh_mod.mesh_from_string("fsdp=8"), r["compiled_bytes"], "cpu", "small-gpu")
    assert got["verdict"] == "does not fit" and got["planner_bytes"] == r["planner_bytes"]
    assert bench.main(["--hardware", "h100-80gb", *SMALL]) == 2  # a verdict needs --compile-only
    assert bench.main(["--compile-only", "--hardware", "h100-90gb", *SMALL]) == 2
    assert "unknown hardware 'h100-90gb'" in capsys.readouterr().err


def test_bench_raises_the_cpu_collective_abort_unless_the_user_set_it(monkeypatch):
    flag = "--xla_cpu_collective_call_terminate_timeout_seconds"
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
    bench._patient_cpu_collectives()
    assert os.environ["XLA_FLAGS"] == f"--xla_backend_optimization_level=0 {flag}={bench.CPU_COLLECTIVE_TIMEOUT_S}"
    monkeypatch.setenv("XLA_FLAGS", f"{flag}=60")
    bench._patient_cpu_collectives()
    assert os.environ["XLA_FLAGS"] == f"{flag}=60"
