"""Gemma 3, gpt-oss and Qwen3-Next (issue 40) trained through `jaxdist.run`: SFT on prepared chat data,
checkpoints and resume. A small model of each (conftest.SHAPES on conftest.MICRO_MODEL,
2 layers), 3 steps on fsdp=8 with checkpoints at steps 2 and 3:

- the run resumed from step 2 (a copy of the run without its step-3 checkpoint) logs step 3's loss and grad norm
  as the uninterrupted run did, and its step-3 checkpoint holds the same bytes (the same program on the same
  restored state and batch);
- a restored train state (parameters, optimizer state, step) saved again and restored is the same bytes;
- Gemma 3 and gpt-oss train on chat data (`prepare --chat`, loss on the assistant's tokens,
  data.document_mask=true): the loss is finite and the held-out evaluation counts exactly the masked-in targets.
  Qwen3-Next cannot take packed conversations yet (its linear-attention state would cross them; refused at
  start-up in one line: tests/test_qwen3next.py::test_refusals_are_one_line): it trains on the default byte corpus.
DeepSeek-V3's checkpoint and resume: tests/test_deepseek3.py::test_bias_is_checkpointed_and_resumes_exactly.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import MICRO_MODEL, SHAPES

import jaxdist
from jaxdist import checkpoint
from jaxdist.data import data_rules, loss_mask, prepare
from jaxdist.data import loader as loader_mod
from jaxdist.distributed.mesh import mesh_from_string
from jaxdist.training import step

CHAT = Path(__file__).parent / "fixtures" / "chat"
STEPS = 3
# family -> trains on the prepared chat data (Qwen3-Next refuses packed documents: module docstring)
FAMILIES = {"gemma3": True, "gpt_oss": True, "qwen3_next": False}


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    """The chat fixture conversations, 4 times each, in windows of 128 tokens (the Qwen-style fixture
    tokenizer, 320 ids), 25% held out."""
    root = tmp_path_factory.mktemp("chat")
    lines = (CHAT / "conversations.jsonl").read_text().splitlines()
    (root / "in.jsonl").write_text("\n".join(lines * 4) + "\n")
    argv = ["prepare", "--chat", "--workers", "1", "--tokenizer", str(CHAT / "qwen"), "--seq-len", "128"]
    assert prepare.main([*argv, "--val-fraction", "0.25", "--out", str(root / "out"), str(root / "in.jsonl")]) == 0
    return root / "out"


def family_cfg(tiny_cfg, family: str, chat_data: Path):
    model = dict(MICRO_MODEL, num_layers=2, family=family, **SHAPES[family])
    if FAMILIES[family]:
        model.update(seq_len=128, vocab_size=320)
        data = dict(source="tokens", path=str(chat_data), document_mask=True)
    else:
        data = {}
    return tiny_cfg.replace(
        model=model,
        data=data,
        train=dict(global_batch=8, steps=STEPS, eval_every=0, log_every=1),
        checkpoint=dict(every=2, keep=5, async_save=False),  # step 2 (resumed from) and the last
    )


def leaves_bytes(state) -> list[bytes]:
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(jax.device_get(state))]


@pytest.mark.parametrize("family", FAMILIES)
def test_trains_checkpoints_and_resumes_exactly(family, tiny_cfg, chat_data, tmp_path):
    cfg = family_cfg(tiny_cfg, family, chat_data)
    jaxdist.run(cfg, tmp_path / "a", log=lambda *a, **k: None)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / str(STEPS))
    jaxdist.run(cfg, tmp_path / "b", log=lambda *a, **k: None)

    a, b = ([json.loads(x) for x in (tmp_path / r / "metrics.jsonl").read_text().splitlines()] for r in "ab")
    (last_a,), (last_b,) = ([r for r in rows if r.get("step") == STEPS and "loss" in r] for rows in (a, b))
    first = next(r for r in a if r.get("step") == 1 and "loss" in r)
    assert math.isfinite(last_a["loss"]) and last_a["loss"] != first["loss"]  # it trained
    for k in ("loss", "grad_norm"):
        assert last_a[k] == last_b[k], (k, last_a[k], last_b[k])  # the same program on the same state and batch

    prog = step.build_program(cfg, mesh_from_string(cfg.mesh.shape), eos_id=data_rules.mask_eos(cfg))
    loader = loader_mod.Loader(cfg, prog.batch_sharding)
    quiet = dict(log=lambda *a, **k: None)
    resolved = dict(quiet, drift=False)  # the run resolved data.token_dtype from the folder; cfg says auto
    ra = checkpoint.restore(tmp_path / "a" / "checkpoints", prog, loader, cfg, **resolved)
    rb = checkpoint.restore(tmp_path / "b" / "checkpoints", prog, loader, cfg, **resolved)
    assert ra.step == rb.step == STEPS and int(ra.state.step) == STEPS
    want = leaves_bytes(ra.state)
    assert leaves_bytes(rb.state) == want  # the resumed run's step 3 is the uninterrupted one, bit for bit
    saver = checkpoint.Saver(tmp_path / "again", cfg, **quiet)
    saver.save(ra.state, STEPS, loader)
    saver.close()
    again = checkpoint.restore(tmp_path / "again", prog, loader, cfg, **resolved).state
    assert leaves_bytes(again) == want
    assert any(np.abs(np.asarray(x)).max() > 0 for x in jax.tree.leaves(jax.device_get(again.opt_state)))
    if FAMILIES[family]:  # the loss counts exactly the assistant targets the chat mask marks, no padding
        batch = next(loader)
        _, weights = loss_mask.split(jax.device_get(batch))
        loss_sum, count = prog.eval_step(again.params, batch)
        assert 0 < float(count) == float(np.asarray(weights)[:, 1:].sum()) < weights[:, 1:].size
        assert math.isfinite(float(loss_sum))
