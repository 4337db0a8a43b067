import json

import jax
import jax.numpy as jnp
import pytest

from jaxdist import config
from jaxdist.distributed.mesh import make_mesh, parse_mesh
from jaxdist.models import flops
from jaxdist.observe import metrics
from jaxdist.reduce.gradients import token_loss_sums
from jaxdist.training import step


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["model.d_model=128", "model.mlp_dim=512", "model.seq_len=256"],
        ["model.tie_embeddings=true"],
        ["model.vocab_size=4096", "model.seq_len=64", "model.num_kv_heads=4"],
    ],
    ids=["tiny", "narrow-long", "tied", "big-vocab-mha"],
)
def test_flops_per_token_match_the_compiler(overrides):
    """The model's FLOPs per trained token against XLA's own count (`cost_analysis`) of the compiled
    forward + backward on one device. One layer: XLA counts a loop body once, whatever its trip count.
    The formula counts matmuls only, the compiler also elementwise work: 1.0 <= ratio <= 1.02."""
    cfg = config.load(None, [f"{k}={v}" for k, v in [("model.num_layers", 1), ("train.global_batch", 2)]] + overrides)
    mesh = make_mesh(parse_mesh("dp=1", 1), devices=jax.devices()[:1])
    prog = step.build_program(cfg, mesh)
    tokens = jax.ShapeDtypeStruct((2, cfg.model.seq_len + 1), jnp.int32)
    grad = jax.jit(jax.grad(lambda p, t: token_loss_sums(prog.apply_fn, p, t)[0]))
    with prog.activate():
        compiled = grad.lower(prog.abstract_state.params, tokens).compile()
    ratio = compiled.cost_analysis()["flops"] / (flops.flops_per_token(cfg.model) * 2 * cfg.model.seq_len)
    assert 1.0 <= ratio <= 1.02, ratio


def test_resumed_run_drops_records_after_its_checkpoint(tmp_path):
    lines = [
        {"step": 10, "loss": 3.0},
        {"step": 20, "loss": 2.5},
        {"step": 30, "loss": 2.0},
        {"summary": True, "steps": 30},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    writer = metrics.MetricWriter(tmp_path, resume_step=20)
    writer.write({"step": 30, "loss": 2.1})
    writer.close()
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records == [{"step": 10, "loss": 3.0}, {"step": 20, "loss": 2.5}, {"step": 30, "loss": 2.1}]


def test_peak_is_a_datasheet_or_the_users_and_none_on_cpu():
    """CPU has no datasheet peak (a probed matmul rate moved with the load): 0 and no MFU, unless
    train.peak_flops gives one per device."""
    assert metrics.peak_flops(jax.devices(), "float32") == (0.0, "CPU: no datasheet peak")
    assert metrics.peak_flops(jax.devices(), "float32", 1e12) == (8e12, "train.peak_flops=1e+12 per device")


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
