"""KV-cache generation against transformers' `generate` (the committed fixture, no torch needed):
greedy tokens (every one up to a near-tie, conftest.assert_same_greedy) and logprobs to 1e-4, two prompts of different lengths batched (left-padded) on
fsdp=4,tp=2; the `--json` CLI; sampling (top-p nucleus, pre-temperature logprobs, seeded)."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_same_greedy, greedy_gaps

from jaxdist import generate
from jaxdist.errors import JaxdistError
from jaxdist.inference import decode

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "fixtures" / "hf_llama"


@pytest.fixture(scope="module")
def reference():
    """(the fixture's reference, its greedy tokens (2, N), our top-2 logit gaps along them)."""
    ref = np.load(FIXTURE / "reference.npz")
    want = np.stack([ref["greedy0"], ref["greedy1"]])
    cfg, params, graphdef, mesh, _ = decode.load(None, str(FIXTURE), "fsdp=4,tp=2")
    return ref, want, greedy_gaps(cfg, params, graphdef, mesh, [ref["prompt0"], ref["prompt1"]], want, tol=2e-4)


def test_greedy_cli_matches_transformers_batched_and_sharded(reference, capsys, monkeypatch):
    """`python -m jaxdist.generate --json` (in this process; its devices are set up already)."""
    ref, want, gaps = reference
    n = len(ref["greedy0"])
    prompts = [" ".join(map(str, ref[f"prompt{k}"])) for k in (0, 1)]
    monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "8")
    capsys.readouterr()
    rc = generate.main(
        [
            "--hf",
            str(FIXTURE),
            "--mesh",
            "fsdp=4,tp=2",
            "--prompt-tokens",
            prompts[0],
            "--prompt-tokens",
            prompts[1],
            "--max-new-tokens",
            str(n),
            "--ignore-eos",
            "--json",
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert len(rows) == 2 and "tokens/s" in err
    # transformers' greedy continuation, every token up to a near-tie (tol: ours and decode's, each 1e-4)
    assert_same_greedy([row["tokens"] for row in rows], want, gaps, tol=2e-4, what="generate --json tokens")
    for k, row in enumerate(rows):
        assert row["prompt_tokens"] == ref[f"prompt{k}"].tolist()
        assert np.abs(np.array(row["logprobs"]) - ref[f"logprobs{k}"]).max() <= 1e-4


def test_output_stops_after_eos():
    assert decode.cut_at_eos([5, 2, 7, 2], [-1.0, -2.0, -3.0, -4.0], {2}) == ([5, 2], [-1.0, -2.0])
    assert decode.cut_at_eos([5, 7], [-1.0, -2.0], {2}) == ([5, 7], [-1.0, -2.0])
    assert decode.cut_at_eos([2, 7], [-1.0, -2.0], set()) == ([2, 7], [-1.0, -2.0])
    assert decode.eos_ids(FIXTURE) == {2}


def test_sampling_nucleus_seed_and_pre_temperature_logprobs():
    sample = jax.jit(decode.sample, static_argnums=(2, 3))
    logits = jnp.array([[3.0, 2.5, 0.0, -1.0, -5.0]] * 4000)
    probs = jax.nn.softmax(logits[0] / 0.8)
    tok, logp = sample(logits, jax.random.key(0), 0.8, 0.7)
    tok = np.asarray(tok)
    # top_p=0.7 at T=0.8: tokens 0 and 1 hold 0.60 then 0.32 -> the nucleus is {0, 1}.
    assert float(probs[0]) < 0.7 <= float(probs[0] + probs[1])
    assert set(tok.tolist()) == {0, 1}
    share = (tok == 0).mean()  # renormalised within the nucleus
    assert abs(share - float(probs[0] / (probs[0] + probs[1]))) < 0.03
    np.testing.assert_allclose(np.asarray(logp), np.asarray(jax.nn.log_softmax(logits[0]))[tok], rtol=1e-6)
    again, _ = sample(logits, jax.random.key(0), 0.8, 0.7)
    assert np.array_equal(np.asarray(again), tok)  # same seed, same draw
    full, _ = sample(logits, jax.random.key(0), 0.8, 1.0)
    assert set(np.asarray(full).tolist()) > {0, 1}  # without top-p the tail is drawn too
    greedy, glogp = sample(logits[:1], jax.random.key(0), 0.0, 1.0)
    assert int(greedy[0]) == 0 and abs(float(glogp[0]) - float(jax.nn.log_softmax(logits[0])[0])) < 1e-6


def test_prompt_text_uses_the_run_tokenizer_else_bytes(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from jaxdist import config
    from jaxdist.hf import export

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        ["hello world", "hello there"] * 10, trainers.BpeTrainer(vocab_size=40, special_tokens=["[UNK]"])
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    byte_cfg = config.load(None, [])
    text = decode.Text(byte_cfg, tmp_path / "nowhere")
    assert text.encode("hé") == list("hé".encode()) and text.decode(text.encode("hé")) == "hé"
    small = config.load(None, ["model.vocab_size=64"])
    with pytest.raises(JaxdistError, match="needs a tokenizer") as e:  # fewer ids than bytes, no tokenizer
        decode.Text(small, tmp_path / "nowhere").encode("hello")
    assert "\n" not in str(e.value)
    with_tok = decode.Text(small, tmp_path)  # an imported model's tokenizer.json (hf_source/)
    ids = with_tok.encode("hello world")
    assert ids == tok.encode("hello world").ids and with_tok.decode(ids) == tok.decode(ids)
    # The export copies the run's tokenizer (data.tokenizer) next to the weights.
    (tmp_path / "out").mkdir()
    export.copy_tokenizer(str(tmp_path / "tokenizer.json"), None, tmp_path / "out")
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (tmp_path / "tokenizer.json").read_bytes()


def test_run_dir_generation_equals_hf_generation(reference, tmp_path):
    """--run-dir: a converted run decodes exactly as the HF directory it came from (and keeps its EOS)."""
    from jaxdist.hf import convert as hf_convert
    from jaxdist.hf import mapping

    ref, want, gaps = reference
    hf_convert.from_hf(
        FIXTURE, tmp_path / "run", mapping.hf_config(None, [], FIXTURE, "fsdp=4,tp=2"), log=lambda *a: None
    )
    cfg, params, graphdef, mesh, source = decode.load(str(tmp_path / "run"), None, "fsdp=4,tp=2")
    prompts = [ref["prompt0"].tolist(), ref["prompt1"].tolist()]
    new, logp, _, _ = decode.generate(cfg, params, graphdef, mesh, prompts, len(ref["greedy0"]))
    assert_same_greedy(new, want, gaps, tol=2e-4, what="--run-dir greedy tokens")  # as the CLI test
    for k in (0, 1):
        assert np.abs(logp[k] - ref[f"logprobs{k}"]).max() <= 1e-4
    assert decode.eos_ids(source) == {2}


def test_text_rows_mark_each_prompt_and_its_completion():
    """Text output: rows never run together (a completion that starts mid-word, or spans lines, stays
    attributable): each prompt under `--- prompt K of N ---`, its completion under `--- completion ---`."""
    out = [generate.row(k + 1, 2, p, c) for k, (p, c) in enumerate([("Hi", " there\nfriend"), ("Count", " 1 2")])]
    assert "\n".join(out).splitlines() == [
        "--- prompt 1 of 2 ---",
        "Hi",
        "--- completion ---",
        " there",
        "friend",
        "--- prompt 2 of 2 ---",
        "Count",
        "--- completion ---",
        " 1 2",
    ]


def test_assert_same_greedy_checks_up_to_a_near_tie_and_never_vacuously():
    """conftest.assert_same_greedy: tokens agree up to the first near-tie (gap < 2 * tol), nothing after it;
    a mismatch before it fails; a near-tie at position 0 of every row fails (nothing would be checked)."""
    ref = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])
    wide = np.ones((2, 4), np.float32)
    assert assert_same_greedy(ref.copy(), ref, wide, tol=1e-4) == 8
    tie = wide.copy()
    tie[0, 2] = 1e-4  # row 0: a near-tie at step 2 (margin 2e-4); its tokens from there on may differ
    parted = ref.copy()
    parted[0, 2:] = [9, 9]
    assert assert_same_greedy(parted, ref, tie, tol=1e-4) == 6
    parted[0, 1] = 9  # before the near-tie: a real disagreement
    with pytest.raises(AssertionError, match="row 0"):
        assert_same_greedy(parted, ref, tie, tol=1e-4)
    with pytest.raises(AssertionError, match="nothing was checked"):
        assert_same_greedy(ref, ref, np.zeros((2, 4), np.float32), tol=1e-4)
