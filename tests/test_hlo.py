"""The HLO collective reader on XLA's replica-group spellings and loop trip counts."""

import pytest

from jaxdist.distributed import hlo

PROGRAM = """
HloModule m

%add (x: f32[], y: f32[]) -> f32[] {
  ROOT %s = f32[] add(f32[] %x, f32[] %y)
}

%body (p: (s32[], f32[64])) -> (s32[], f32[64]) {
  %ag = f32[64]{0} all-gather(f32[16]{0} %x), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}
  %rs = f32[16]{0} reduce-scatter(f32[64]{0} %ag), channel_id=2, replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add
}

%cond (p: (s32[], f32[64])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: f32[1024]) -> f32[1024] {
  %w = (s32[], f32[64]) while((s32[], f32[64]) %t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %ar = bf16[1024]{0} all-reduce(bf16[1024]{0} %a), channel_id=3, replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add
  %ag2 = f32[256]{0} all-gather(f32[128]{0} %b), channel_id=4, replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([2,2,2]T(1,0,2)) {'axis_0'}, dimensions={0}
  %cp = f32[32]{0} collective-permute(f32[32]{0} %c), channel_id=5, source_target_pairs={{0,1},{1,0}}
}
"""


def test_kinds_groups_and_counts():
    by_name = {c.kind + str(c.result_bytes): c for c in hlo.collectives(PROGRAM)}
    ag = by_name["all-gather256"]
    assert ag.groups == ((0, 1, 2, 3), (4, 5, 6, 7)) and ag.count == 3
    rs = by_name["reduce-scatter64"]
    assert rs.group_size == 4 and rs.full_bytes == 256 and rs.count == 3
    ar = by_name["all-reduce2048"]
    assert ar.groups == ((0, 4), (1, 5), (2, 6), (3, 7)) and ar.count == 1
    mesh_ag = by_name["all-gather1024"]
    assert mesh_ag.groups == ((0, 2), (1, 3), (4, 6), (5, 7))


def test_ring_model_bytes():
    s = hlo.summarize(hlo.collectives(PROGRAM))
    assert s["all-reduce"] == {"count": 1, "bytes": pytest.approx(2 * 1 / 2 * 2048)}
    assert s["all-gather"]["bytes"] == pytest.approx(3 * 3 / 4 * 256 + 1 / 2 * 1024)
    assert s["reduce-scatter"]["bytes"] == pytest.approx(3 * 3 / 4 * 256)
    assert s["collective-permute"]["bytes"] == 128


def test_spans_axis():
    ar = [c for c in hlo.collectives(PROGRAM) if c.kind == "all-reduce"][0]
    shape = {"dp": 2, "pp": 1, "fsdp": 4, "tp": 1}
    assert hlo.spans_axis(ar, shape, ("dp", "pp", "fsdp", "tp"), "dp")
    assert not hlo.spans_axis(ar, shape, ("dp", "pp", "fsdp", "tp"), "fsdp")


# ---------------------------------------------------------------------------------------------------
# Golden programs in XLA's real text formats (tests/fixtures/hlo/). cpu_sync.txt is jax 0.10.2's own
# compiled output (operands printed without shapes, a combined all-to-all, a scan loop); gpu_async.txt
# uses the GPU compiler's asynchronous spellings as XLA prints them: all-reduce-start/-done over a
# combined tuple, all-gather-start returning (operands, results), collective-permute-start with u32
# contexts, reduce-scatter / all-to-all wrapped in async-start (whose async-done repeats `calls=`),
# replica_groups={} with the device count in the header, and a while loop without a known trip count.
# Expected bytes are worked by hand from the arrays each collective moves.

FIXTURES = __import__("pathlib").Path(__file__).parent / "fixtures" / "hlo"


def by_kind(text):
    out = {}
    for c in hlo.collectives(text):
        out.setdefault(c.kind, []).append(c)
    return out


def test_golden_cpu_sync_program():
    """jax program: psum f32[64] over fsdp (4), all_gather bf16[32] over dp (2), psum_scatter f32[64]
    over all 8, all_to_all f32[4,16] over fsdp, ppermute s32[8] over dp, a 3-trip fori_loop psum of
    f32[16] over dp, and one psum of (f32[8], s32[8]) over dp. XLA:CPU gathers the bf16 array as f32
    (its promotion pass converts first): 256 bytes, as compiled."""
    colls = hlo.collectives((FIXTURES / "cpu_sync.txt").read_text())
    got = sorted((c.kind, c.full_bytes, c.group_size, c.count) for c in colls)
    assert got == sorted(
        [
            ("all-reduce", 256, 4, 1),
            ("all-gather", 256, 2, 1),
            ("reduce-scatter", 256, 8, 1),
            ("all-to-all", 256, 4, 1),
            ("collective-permute", 32, 2, 1),
            ("all-reduce", 64, 2, 3),
            ("all-reduce", 32, 2, 1),
            ("all-reduce", 32, 2, 1),
        ]
    )
    assert all(c.trips_known for c in colls)
    # The tuple psum's two 32-byte all-reduces are the f32[8] and the s32[8], not one of them twice.
    small = sorted(c.line.split(" = ")[1].split("{")[0] for c in colls if c.kind == "all-reduce" and c.full_bytes == 32)
    assert small == ["f32[8]", "s32[8]"]
    total = sum(c.count * c.sent_bytes for c in colls)
    assert total == pytest.approx(
        2 * 3 / 4 * 256 + 1 / 2 * 256 + 7 / 8 * 256 + 3 / 4 * 256 + 32 + 3 * 2 * 1 / 2 * 64 + 2 * (2 * 1 / 2 * 32)
    )


def test_golden_gpu_async_program():
    colls = by_kind((FIXTURES / "gpu_async.txt").read_text())
    (ar_loop,) = [c for c in colls["all-reduce"] if c.computation == "body.unknown"]
    (ar,) = [c for c in colls["all-reduce"] if c.computation == "main.1"]
    assert (ar.full_bytes, ar.group_size, ar.count) == (4096 + 64, 8, 1)  # both arrays of the combined start
    ag = sorted(colls["all-gather"], key=lambda c: c.group_size)
    assert [(c.full_bytes, c.group_size) for c in ag] == [(512, 2), (512 + 512, 8)]  # values AND indices
    (rs,) = colls["reduce-scatter"]
    assert (rs.full_bytes, rs.group_size, rs.count) == (4096, 8, 1)  # async-done's calls= not counted again
    (a2a,) = colls["all-to-all"]
    assert a2a.groups == (tuple(range(8)),) and a2a.full_bytes == 512  # replica_groups={}: all 8 devices
    (cp,) = colls["collective-permute"]
    assert (cp.full_bytes, cp.count) == (128, 5)  # the f32[32] result, not the u32 context; 5 trips
    assert ar_loop.trips_known is False and all(
        c.trips_known
        for c in hlo.collectives((FIXTURES / "gpu_async.txt").read_text())
        if c is not ar_loop and c.computation != "body.unknown"
    )
    s = hlo.summarize(hlo.collectives((FIXTURES / "gpu_async.txt").read_text()))
    assert s["all-reduce"]["bytes"] == pytest.approx(2 * 7 / 8 * 4160 + 2 * 1 / 2 * 64)
    assert s["all-gather"]["bytes"] == pytest.approx(7 / 8 * 1024 + 1 / 2 * 512)
    assert s["reduce-scatter"]["bytes"] == pytest.approx(7 / 8 * 4096)
    assert s["all-to-all"]["bytes"] == pytest.approx(7 / 8 * 512)
    assert s["collective-permute"]["bytes"] == 5 * 128


def test_empty_replica_groups_need_the_device_count():
    text = "\n".join(
        line for line in (FIXTURES / "gpu_async.txt").read_text().splitlines() if not line.startswith("HloModule")
    )
    with pytest.raises(ValueError, match="replica_groups=\\{\\} .*header"):
        hlo.collectives(text)


def test_ring_model_is_one_function():
    from jaxdist.planner import tally

    assert tally.ring_bytes is hlo.ring_bytes
    assert hlo.ring_bytes("all-reduce", 8, 800) == 1400 and hlo.ring_bytes("all-gather", 4, 400) == 300
    assert hlo.ring_bytes("collective-permute", 2, 64) == 64 and hlo.ring_bytes("all-reduce", 1, 64) == 0
    assert hlo.dtype_bytes("bf16") == hlo.dtype_bytes("bfloat16") == 2 and hlo.dtype_bytes("float32") == 4


def test_unknown_trip_count_is_refused_not_undercounted():
    from jaxdist.analysis import measure
    from jaxdist.distributed.mesh import mesh_from_string
    from jaxdist.errors import JaxdistError

    text = (FIXTURES / "gpu_async.txt").read_text()
    with pytest.raises(JaxdistError, match="loop without a known trip count \\(body.unknown\\)"):
        measure.dp_bytes_per_step(text, mesh_from_string("dp=8"))


def test_golden_cpu_conditional_program_counts_the_largest_branch():
    """cpu_switch.txt (scripts/fixtures/make_hlo_switch_fixture.py, jax 0.10.2's compiled XLA:CPU text, 8 devices):
    psum f32[16] outside; lax.switch whose branches send all_to_all f32[8,4] / all_to_all f32[8,16] +
    psum f32[32] / nothing; a 3-trip loop around lax.cond of psum f32[64] / all_gather f32[4] -> f32[32].
    Every branch is listed (tagged with its branch); a step is costed by the largest of each."""
    colls = hlo.collectives((FIXTURES / "cpu_switch.txt").read_text())
    got = sorted((c.kind, c.full_bytes, c.count, len(c.branch)) for c in colls)
    assert got == sorted(
        [
            ("all-reduce", 64, 1, 0),
            ("all-to-all", 128, 1, 1),
            ("all-to-all", 512, 1, 1),
            ("all-reduce", 128, 1, 1),
            ("all-reduce", 256, 3, 1),
            ("all-gather", 128, 3, 1),
        ]
    )
    switch = {c.branch[0][1] for c in colls if c.kind == "all-to-all"}
    assert switch == {0, 1} and len({c.branch[0][0] for c in colls if c.branch}) == 2  # two conditionals
    s = hlo.summarize(colls)
    ring = 7 / 8
    assert s["all-reduce"] == {"count": 5, "bytes": pytest.approx(2 * ring * (64 + 128 + 3 * 256))}
    assert s["all-to-all"] == {"count": 1, "bytes": pytest.approx(ring * 512)}
    assert "all-gather" not in s  # the loop's smaller branch
    every_branch = sum(c.count * c.sent_bytes for c in colls)
    assert every_branch == pytest.approx(2 * ring * (64 + 128 + 3 * 256) + ring * (512 + 128 + 3 * 128))


NESTED = """
HloModule m, num_partitions=4

%add (x: f32[], y: f32[]) -> f32[] {
  ROOT %s = f32[] add(f32[] %x, f32[] %y)
}

%small (p: f32[8]) -> f32[8] {
  ROOT %ar = f32[8]{0} all-reduce(f32[8]{0} %p), replica_groups={}, to_apply=%add
}

%big (p: f32[8]) -> f32[8] {
  ROOT %ar2 = f32[64]{0} all-reduce(f32[64]{0} %p), replica_groups={}, to_apply=%add
}

%outer_true (p: f32[8]) -> f32[8] {
  %ag = f32[16]{0} all-gather(f32[4]{0} %p), replica_groups={}, dimensions={0}
  ROOT %c = f32[8]{0} conditional(s32[] %i, f32[8] %p, f32[8] %p), branch_computations={%small, %big}
}

%outer_false (p: f32[8]) -> f32[8] {
  ROOT %ag3 = f32[128]{0} all-gather(f32[32]{0} %p), replica_groups={}, dimensions={0}
}

ENTRY %main (a: f32[8]) -> f32[8] {
  ROOT %k = f32[8]{0} conditional(pred[] %q, f32[8] %a, f32[8] %a), true_computation=%outer_true, false_computation=%outer_false
}
"""


def test_nested_conditionals_take_the_largest_branch_inside_out():
    """pred conditional (true_/false_computation): true = all-gather f32[16] + (switch: all-reduce of 32 or
    256 bytes), false = all-gather f32[128]. True's largest is 3/4·64 + 2·3/4·256 = 432 > false's 384."""
    colls = hlo.collectives(NESTED)
    assert len(colls) == 4 and all(c.count == 1 for c in colls)
    s = hlo.summarize(colls)
    assert s == {"all-reduce": {"count": 1, "bytes": 2 * 3 / 4 * 256}, "all-gather": {"count": 1, "bytes": 3 / 4 * 64}}
