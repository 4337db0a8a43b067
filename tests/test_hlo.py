"""The HLO collective reader on XLA's replica-group spellings and loop trip counts."""

import pytest

from jaxdist import hlo

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
