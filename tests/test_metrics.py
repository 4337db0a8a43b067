import json

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
