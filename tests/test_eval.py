"""`python -m jaxdist.eval` against lm-eval's own `hf` backend (an implementation nobody here wrote) on the
committed local tasks: a multiple-choice task (acc, acc_norm identical), a perplexity task (rolling
log-likelihoods and perplexities to 1e-4, one document longer than the window) and a generation task
with a stop sequence (the same text under greedy decoding), on one device and on an fsdp=4,tp=2 mesh.
The reference answers are scripts/fixtures/make_eval_fixture.py's (lm-eval 0.4.13, transformers, torch CPU on
that script's `convert to-hf` export of a small jaxdist run); no torch here."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

pytest.importorskip("lm_eval", reason='the eval extra: pip install "jaxdist[eval]"')

from jaxdist import eval as eval_cmd
from jaxdist.errors import JaxdistError
from jaxdist.evaluation import harness, model, programs

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "fixtures" / "eval_model"
TASKS_DIR = REPO / "tests" / "fixtures" / "eval_tasks"
TASKS = ["jx_choice", "jx_ppl", "jx_gen"]
REF = json.loads((FIXTURE / "reference.json").read_text())


def one_device(lm: model.JaxdistLM) -> model.JaxdistLM:
    """The same weights and tokens on a one-device mesh."""
    # deferred: the mesh helpers load jax's sharding on first use
    from jaxdist.distributed.mesh import mesh_from_string

    p = lm.programs
    mesh = mesh_from_string("fsdp=1", devices=jax.devices()[:1])
    params = jax.device_put(p.params, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    return model.JaxdistLM(programs.Programs(p.cfg, params, p.graphdef, mesh, p.rules), lm.tokens, lm.max_length, 8)


@pytest.fixture(scope="module")
def sharded():
    lm = model.from_source(None, str(FIXTURE), "fsdp=4,tp=2", batch_size=8)
    return lm, harness.evaluate(lm, TASKS, include_path=str(TASKS_DIR), log_samples=True)


@pytest.fixture(scope="module")
def single(sharded):
    lm = one_device(sharded[0])
    return lm, harness.evaluate(lm, TASKS, include_path=str(TASKS_DIR), log_samples=True)


def answers(results: dict, task: str) -> list:
    return [s["resps"] for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def check_against_reference(results: dict) -> None:
    ref = REF["results"]
    for metric in ("acc,none", "acc_norm,none"):  # identical
        assert results["results"]["jx_choice"][metric] == ref["jx_choice"][metric]
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert results["results"]["jx_ppl"][metric] == pytest.approx(ref["jx_ppl"][metric], rel=1e-4)
    assert results["results"]["jx_gen"]["exact_match,none"] == ref["jx_gen"]["exact_match,none"]
    # Each document's raw answers: log-likelihoods to 1e-4, is_greedy and generations identical.
    for got, want in zip(answers(results, "jx_choice"), [s["resps"] for s in REF["samples"]["jx_choice"]]):
        assert np.abs(np.array([r[0][0] for r in got]) - [r[0][0] for r in want]).max() <= 1e-4
        assert [r[0][1] for r in got] == [r[0][1] for r in want]
    got = np.array([r[0][0] for r in answers(results, "jx_ppl")])
    want = np.array([r[0][0] for r in (s["resps"] for s in REF["samples"]["jx_ppl"])])
    # 1e-4, relative for the long documents' sums (-100 nats and more; measured 7.6e-5 abs at most)
    assert (np.abs(got - want) <= 1e-4 * np.maximum(1, np.abs(want))).all()
    assert answers(results, "jx_gen") == [s["resps"] for s in REF["samples"]["jx_gen"]]


def test_sharded_mesh_agrees_with_the_hf_backend(sharded):
    lm, results = sharded
    check_against_reference(results)
    assert len(REF["samples"]["jx_gen"]) == 16 and any(r[0][0] for r in answers(results, "jx_gen"))
    # The buckets: batch 8 always; lengths 16 and 64 for scoring (short prompts; a window of 64), one
    # generation shape (prompts of < 16 tokens, 8 new tokens).
    shapes = set(lm.programs.stats.shapes)
    assert {k for k in shapes if k[0] == "score"} == {("score", 8, 16), ("score", 8, 64)}
    assert {k for k in shapes if k[0] == "generate"} == {("generate", 8, 16, 8)}
    assert 0 < lm.programs.stats.real_tokens < lm.programs.stats.computed_tokens


def test_one_device_agrees_with_the_hf_backend(single):
    check_against_reference(single[1])


def test_the_rolling_windows_cover_a_document_longer_than_the_window(sharded):
    lm = sharded[0]
    longest = max((json.loads(line)["text"] for line in (TASKS_DIR / "ppl.jsonl").read_text().splitlines()), key=len)
    assert len(lm.tok_encode(longest)) > lm.max_length  # so the rolling windows are exercised


def test_flat_metrics_name_task_and_metric(sharded):
    flat = harness.flat_metrics(sharded[1])
    assert flat["eval/jx_choice/acc"] == REF["results"]["jx_choice"]["acc,none"]
    assert set(flat) == {
        "eval/jx_choice/acc",
        "eval/jx_choice/acc_norm",
        "eval/jx_ppl/word_perplexity",
        "eval/jx_ppl/byte_perplexity",
        "eval/jx_ppl/bits_per_byte",
        "eval/jx_gen/exact_match",
        "eval/jx_choice/sample_len",
        "eval/jx_ppl/sample_len",
        "eval/jx_gen/sample_len",
    }


def test_buckets():
    assert programs.buckets(64) == [16, 32, 64]
    assert programs.buckets(100) == [16, 32, 64, 100]
    assert programs.bucket(17, 64) == 32 and programs.bucket(3, 64) == 16 and programs.bucket(64, 64) == 64


def test_cli_writes_lm_eval_results_and_a_table(tmp_path, capsys, sharded):
    """The command end to end on the generation task (its programs are cached from the fixture's)."""
    capsys.readouterr()
    rc = eval_cmd.main(
        ["--hf", str(FIXTURE), "--mesh", "fsdp=4,tp=2", "--tasks", "jx_gen", "--include-path", str(TASKS_DIR)]
        + ["--output-path", str(tmp_path), "--limit", "4"]
    )
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "jx_gen" in out and "exact_match" in out and "compiled shapes: generate 8x16x8" in err
    (written,) = tmp_path.rglob("results_*.json")
    saved = json.loads(written.read_text())
    assert saved["results"]["jx_gen"]["sample_len"] == 4 and "configs" in saved


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--hf", "x", "--tasks", " , "], "--tasks is empty"),
        (["--hf", "x", "--tasks", "a", "--batch-size", "0"], "--batch-size 0"),
        (["--hf", "x", "--tasks", "a", "--limit", "nan"], "--limit nan"),
        (["--hf", "x", "--tasks", "a", "--log-samples"], "--output-path"),
    ],
)
def test_bad_flags_are_one_line(argv, words, capsys):
    assert eval_cmd.main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1


def test_unknown_task_and_bad_include_path_are_one_line():
    local = harness.task_manager(str(TASKS_DIR), ["jx_gen"])  # the folder alone: it holds the task asked for
    assert set(local.all_tasks) == set(TASKS)
    with pytest.raises(JaxdistError, match="unknown task jx_nope: not one of lm-eval's tasks"):
        harness.check_tasks(["jx_gen", "jx_nope"], local)
    with pytest.raises(JaxdistError, match="is not a folder"):
        harness.evaluate(model.JaxdistLM(None, None, 64), ["jx_gen"], include_path=str(TASKS_DIR / "missing"))


OFFLINE_TASK = """task: jx_offline
dataset_path: jaxdist-missing/nothing
dataset_name: main
output_type: multiple_choice
test_split: test
doc_to_text: "{{q}}"
doc_to_choice: "{{c}}"
doc_to_target: 0
"""


def test_a_dataset_missing_offline_is_one_line_naming_it(tmp_path, monkeypatch):
    """HF_DATASETS_OFFLINE=1 and a task whose dataset is in no cache: the dataset and how to fetch it."""
    import datasets
    import huggingface_hub.constants

    (tmp_path / "offline.yaml").write_text(OFFLINE_TASK)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)  # read at import: set it as the env would
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    lm = model.JaxdistLM(None, None, 64)  # never asked: the data fails first
    with pytest.raises(JaxdistError) as e:
        harness.evaluate(lm, ["jx_offline"], include_path=str(tmp_path))
    text = str(e.value)
    assert "dataset jaxdist-missing/nothing is not in the datasets cache" in text and "while offline" in text
    assert "datasets.load_dataset('jaxdist-missing/nothing', 'main')" in text and "\n" not in text


def test_without_lm_eval_the_command_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(__import__("sys").modules, "lm_eval", None)  # as if the eval extra were not installed
    assert eval_cmd.main(["--hf", "x", "--tasks", "a"]) == 2
    assert capsys.readouterr().err == 'error: python -m jaxdist.eval needs lm-eval: pip install "jaxdist[eval]"\n'


def test_chat_template_renders_as_the_tokenizer_folder_says(tmp_path):
    """--apply-chat-template: lm-eval's chat history through the folder's chat_template.jinja (jaxdist's
    sandboxed renderer, as transformers renders it); a folder without one is one line."""
    (tmp_path / "tokenizer.json").write_bytes((FIXTURE / "tokenizer.json").read_bytes())
    tokens = model.Tokens(model._read_tokenizer(tmp_path / "tokenizer.json"), 0, None, tmp_path)
    lm = model.JaxdistLM(None, tokens, 64)
    with pytest.raises(JaxdistError, match="has no chat template .* copy the model's chat_template.jinja"):
        lm.apply_chat_template([{"role": "user", "content": "hi"}])
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    (tmp_path / "chat_template.jinja").write_text(template)
    history = [{"role": "user", "content": "after two comes"}]
    assert lm.apply_chat_template(history) == "<user>after two comes\n<assistant>"
    assert lm.apply_chat_template(history, add_generation_prompt=False) == "<user>after two comes\n"
    assert lm.chat_template(True) == template and lm.chat_template(False) is None
