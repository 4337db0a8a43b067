"""train.profile_steps writes a profiler trace (TensorBoard xplane + Perfetto JSON) of exactly those steps."""

import gzip
import json

import jaxdist
from jaxdist.observe import profiling

SMALL = dict(num_layers=1, d_model=32, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64, seq_len=16)


def test_profile_steps_write_a_trace_of_those_steps(tiny_cfg, tmp_path):
    cfg = tiny_cfg.replace(model=SMALL, train=dict(steps=4, profile_steps="1:3", log_every=2), checkpoint=dict(every=0))
    logs = []
    jaxdist.run(cfg, tmp_path / "run", log=logs.append)
    profile = tmp_path / "run" / "profile" / "plugins" / "profile"
    assert len(list(profile.glob("*/*.xplane.pb"))) == 1  # TensorBoard's profile plugin reads this
    [perfetto] = profile.glob("*/*.trace.json.gz")
    events = json.loads(gzip.decompress(perfetto.read_bytes()))["traceEvents"]
    markers = sorted(
        {int(e["args"]["step_num"]) for e in events if e.get("name") == "train" and "step_num" in e.get("args", {})}
    )
    assert markers == [1, 2]
    assert any("profiler trace of steps 1..2" in line for line in logs)


def test_no_trace_without_profile_steps(tmp_path):
    trace = profiling.StepTrace("", tmp_path / "profile")
    for s in range(3):
        trace.at_step(s)
    trace.close()
    assert not (tmp_path / "profile").exists()
