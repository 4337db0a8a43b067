import json

import jax

from jaxdist import metrics
from jaxdist.models.llama import count_params


def test_flops_per_token_counts_matmuls_and_attention(tiny_cfg):
    m = tiny_cfg.model
    counts = count_params(m)
    expected = 6 * (counts["total"] - counts["embed"]) + 12 * m.num_layers * m.seq_len * m.num_heads * m.head_dim
    assert metrics.flops_per_token(m) == expected


def test_resumed_run_drops_records_after_its_checkpoint(tmp_path):
    lines = [{"step": 10, "loss": 3.0}, {"step": 20, "loss": 2.5}, {"step": 30, "loss": 2.0},
             {"summary": True, "steps": 30}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    writer = metrics.MetricWriter(tmp_path, resume_step=20)
    writer.write({"step": 30, "loss": 2.1})
    writer.close()
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records == [{"step": 10, "loss": 3.0}, {"step": 20, "loss": 2.5}, {"step": 30, "loss": 2.1}]


def test_cpu_peak_is_measured_once_per_machine_and_cached(tmp_path, monkeypatch):
    """The first call measures and writes the cache; later ones read it back (the probe is not run again)."""
    monkeypatch.setenv("JAXDIST_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(metrics, "_cpu_peak", None)
    monkeypatch.setattr(metrics, "host_load", lambda: 0.5)
    peak, source = metrics.cached_cpu_peak()
    assert 1e8 < peak < 1e13 and "measured now and cached in" in source
    table = json.loads((tmp_path / "cpu_peak.json").read_text())
    assert table[metrics.machine_key()] == {"flops": peak, "load": 0.5}

    def no_probe():
        raise AssertionError("probe ran again")
    monkeypatch.setattr(metrics, "cpu_matmul_peak", no_probe)
    assert metrics.cached_cpu_peak() == (peak, f"CPU matmul probe cached in {tmp_path / 'cpu_peak.json'}")
    total, source, approximate = metrics.peak_flops(jax.devices(), "float32")
    assert total == peak and approximate  # 8 simulated devices share one host: one host's peak
    assert metrics.peak_flops(jax.devices(), "float32", 1e12) == (8e12, "train.peak_flops=1e+12 per device", False)


def test_cpu_peak_taken_on_an_overloaded_host_is_measured_again_when_quieter(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXDIST_CACHE_DIR", str(tmp_path))
    (tmp_path / "cpu_peak.json").write_text(json.dumps({metrics.machine_key(): {"flops": 1e9, "load": 8.0}}))
    monkeypatch.setattr(metrics, "host_load", lambda: 9.0)  # still as busy: the cached figure stands
    assert metrics.cached_cpu_peak()[0] == 1e9
    monkeypatch.setattr(metrics, "host_load", lambda: 0.5)
    monkeypatch.setattr(metrics, "cpu_matmul_peak", lambda: 5e10)
    assert metrics.cached_cpu_peak()[0] == 5e10
    assert json.loads((tmp_path / "cpu_peak.json").read_text())[metrics.machine_key()] == {"flops": 5e10, "load": 0.5}


def test_device_memory_takes_the_most_loaded_local_device():
    """CPU devices report no allocator statistics; a GPU-like device's memory_stats() keys are read
    (the GPU itself is checked by scripts, not here: no accelerator in CI)."""
    assert metrics.device_memory(jax.devices()) is None

    class Device:
        process_index = 0

        def __init__(self, used, peak):
            self.stats = {"bytes_in_use": used, "peak_bytes_in_use": peak, "bytes_limit": 80 << 30}

        def memory_stats(self):
            return self.stats
    got = metrics.device_memory([Device(3 << 30, 5 << 30), Device(4 << 30, 4 << 30)])
    assert got == {"memory_in_use": 4 << 30, "memory_peak": 5 << 30, "memory_limit": 80 << 30}
