"""Chat data: templates and masks against transformers, `prepare --chat`, bad lines, the masked loss on a mesh."""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdist.data import chat, data_rules, loader, loss_mask, prepare
from jaxdist.distributed import mesh as mesh_mod
from jaxdist.errors import JaxdistError
from jaxdist.reduce.gradients import implicit_gradients
from jaxdist.training import step

FIX = Path(__file__).parent / "fixtures" / "chat"
CONVERSATIONS = [json.loads(line) for line in (FIX / "conversations.jsonl").read_text().splitlines()]
EXPECTED = json.loads((FIX / "expected.json").read_text())
# template name -> (tokenizer folder, template file or None for the folder's own)
TEMPLATES = {
    "llama3": ("llama3", None),
    "llama3-gen": ("llama3", FIX / "templates" / "llama3-gen.jinja"),
    "qwen": ("qwen", None),
    "qwen-gen": ("qwen", FIX / "templates" / "qwen-gen.jinja"),
}


def chat_tokenizer(name: str) -> chat.ChatTokenizer:
    folder, template = TEMPLATES[name]
    return chat.load(str(FIX / folder), str(template) if template else None)


# ------------------------------------------------------------------------- against transformers


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_ids_and_masks_equal_transformers(name):
    """Ids equal `apply_chat_template`'s for every fixture conversation (and with the generation prompt,
    before the last answer); masks equal
    `return_assistant_tokens_mask` (marked templates), and the prefix rule on an unmarked template equals
    transformers' mask of its twin marked around exactly what an assistant turn adds."""
    ct = chat_tokenizer(name)
    assert ct.marks_generation == name.endswith("-gen")
    reference = EXPECTED[name.removesuffix("-gen") + "-gen"]  # the masks come from the marked twin
    for conv, want, want_mask in zip(CONVERSATIONS, EXPECTED[name], reference, strict=True):
        ids, mask = chat.encode(ct, conv)
        assert ids.tolist() == want["ids"]
        assert mask.tolist() == want_mask["mask"]
        assert 0 < mask.sum() < len(mask)
        all_ids, all_mask = chat.encode(ct, conv, loss_on="all")
        assert all_ids.tolist() == want["ids"] and all_mask.all()
        assert chat.prompt_ids(ct, conv["messages"][:-1], conv.get("tools")) == want["prompt"]  # generate --chat


def test_masks_cover_the_answers_and_what_closes_them():
    ct = chat_tokenizer("qwen")
    ids, mask = chat.encode(ct, CONVERSATIONS[2])
    trained = ct.tok.decode(ids[mask == 1])
    assert trained == "one, two, three<|im_end|>\nthree, two, one<|im_end|>\n"
    llama = chat_tokenizer("llama3")
    ids, mask = chat.encode(llama, CONVERSATIONS[3])  # the template trims the answer
    assert llama.tok.decode(ids[mask == 1]) == "padded answer.<|eot_id|>"
    assert ids[0] == llama.parser.token_to_id("<|begin_of_text|>") and mask[0] == 0


def test_boundary_is_an_end_of_text_the_template_never_writes():
    # Qwen's EOS <|im_end|> closes every turn: conversations are separated by <|endoftext|> instead.
    qwen, llama = chat_tokenizer("qwen"), chat_tokenizer("llama3")
    assert qwen.tok.eos_id == qwen.parser.token_to_id("<|im_end|>")
    assert chat.boundary_id(qwen) == qwen.parser.token_to_id("<|endoftext|>")
    assert chat.boundary_id(llama) == llama.parser.token_to_id("<|end_of_text|>")


def test_prefix_rule_refuses_a_template_that_rewrites_past_turns(tmp_path):
    """A template that shows only the last answer (as reasoning templates drop past thoughts) renders
    earlier turns differently: the prefix rule cannot place them and says to mark the template."""
    template = (
        "{% for m in messages %}{% if m.role != 'assistant' or loop.last %}"
        "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    (tmp_path / "t.jinja").write_text(template)
    ct = chat.load(str(FIX / "qwen"), str(tmp_path / "t.jinja"))
    ids, mask = chat.encode(ct, CONVERSATIONS[0])  # one answer: fine
    assert ct.tok.decode(ids[mask == 1]) == "The capital of France is Paris.<|im_end|>\n"
    with pytest.raises(chat.BadConversation, match="generation") as e:
        chat.encode(ct, CONVERSATIONS[2])
    assert e.value.kind == "prefix_rule"
    # A conversation that opens with the assistant: the fixture templates cannot render what precedes it.
    first = {"messages": [{"role": "assistant", "content": "Hi"}, *CONVERSATIONS[1]["messages"]]}
    with pytest.raises(chat.BadConversation, match="before assistant message 0") as e:
        chat.encode(chat_tokenizer("qwen"), first)
    assert e.value.kind == "prefix_rule"


# --------------------------------------------------------------------------------- prepare --chat


def run_prepare(*argv):
    return prepare.main(["prepare", "--chat", "--workers", "1", *map(str, argv)])


@pytest.fixture(scope="module")
def prepared_chat(tmp_path_factory):
    """The fixture conversations, each 4 times (32 lines), packed into windows of 128 tokens (the tool
    conversation, 297 tokens, does not fit: skipped), 25% held out."""
    root = tmp_path_factory.mktemp("chat")
    lines = [json.dumps({**c, "id": k}) for k in range(4) for c in CONVERSATIONS]
    (root / "in.jsonl").write_text("\n".join(lines) + "\n")
    args = ["--tokenizer", FIX / "qwen", "--seq-len", 128, "--out", root / "out", root / "in.jsonl"]
    assert run_prepare(*args, "--val-fraction", 0.25, "--shard-tokens", 300) == 0
    return root / "out", root / "in.jsonl"


def test_prepared_windows_hold_whole_conversations_with_their_masks(prepared_chat):
    out, src = prepared_chat
    manifest = json.loads((out / "manifest.json").read_text())
    ct = chat.load(str(out))  # the output folder is itself a tokenizer folder with the template used
    boundary = manifest["eos_id"]
    assert boundary == ct.parser.token_to_id("<|endoftext|>") == manifest["chat"]["boundary_id"]
    assert manifest["chat"]["rule"] == "prefix" and manifest["chat"]["skipped"] == {"too_long": 4}
    expected = {}  # every encodable line's (ids, mask) by its text
    for line in src.read_text().splitlines():
        ids, mask = chat.encode(ct, json.loads(line))
        if len(ids) < 128:  # with its boundary token it fits a window
            expected[line] = ids, mask
    seen, before = [], 0
    for name in ("train", "val"):
        split = manifest["splits"][name]
        ids = [np.fromfile(out / f, np.uint16) for f in split["files"]]
        masks = [np.fromfile(out / f, np.uint8) for f in split["mask_files"]]
        assert [len(a) for a in ids] == [len(m) for m in masks] and sum(map(len, ids)) == split["tokens"]
        assert all(len(a) % 128 == 1 for a in ids)  # whole windows + the next window's first token
        assert len(ids) >= 2 or name == "val"  # --shard-tokens 300: two windows per shard
        stream = np.concatenate([a[:-1] for a in ids])
        mstream = np.concatenate([m[:-1] for m in masks])
        for w in range(len(stream) // 128):
            window, wmask = stream[w * 128 : (w + 1) * 128], mstream[w * 128 : (w + 1) * 128]
            ends = np.flatnonzero(window == boundary)
            starts = np.concatenate([[0], ends[:-1] + 1])
            for a, b in zip(starts, ends):
                if b > a:  # a conversation, whole in this window, and its mask
                    seen.append((window[a:b].tolist(), wmask[a:b].tolist()))
            assert not wmask[window == boundary].any()  # boundaries and padding are never trained on
        assert split["documents"] == len(seen) - before
        before = len(seen)
    want = sorted((i.tolist(), m.tolist()) for i, m in expected.values())
    assert sorted(seen) == want and len(seen) == 28
    assert manifest["splits"]["train"]["documents"] + manifest["splits"]["val"]["documents"] == 28
    assert manifest["splits"]["val"]["documents"] >= 1


def test_loader_carries_the_mask_to_the_step(prepared_chat, tiny_cfg):
    out, _ = prepared_chat
    manifest = json.loads((out / "manifest.json").read_text())
    cfg = tiny_cfg.replace(
        data=dict(source="tokens", path=str(out), document_mask=True), model=dict(vocab_size=320, seq_len=128)
    )
    train, held_out = loader.load_windows(cfg)
    ids = np.fromfile(out / manifest["splits"]["train"]["files"][0], np.uint16)
    mask = np.fromfile(out / manifest["splits"]["train"]["mask_files"][0], np.uint8)
    w = train[1]
    assert w.dtype == np.int32 and len(w) == 129
    np.testing.assert_array_equal(w, loss_mask.encode(ids[128:257], mask[128:257]))
    decoded, weights = loss_mask.split(jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(decoded), ids[128:257])
    np.testing.assert_array_equal(np.asarray(weights), mask[128:257])
    assert len(held_out) >= 1 and (held_out[0] < 0).any()  # eval reads the held-out masks too
    assert data_rules.document_eos(cfg) == manifest["eos_id"]
    with pytest.raises(JaxdistError, match="model.seq_len=128"):
        loader.load_windows(cfg.replace(model=dict(seq_len=64)))


def test_chat_data_needs_the_document_mask_and_says_what_the_loss_covers(prepared_chat, tiny_cfg):
    """Packed conversations without data.document_mask would attend to each other: refused, naming the
    flag; with it, the data line (start-up) says the loss covers the assistant's tokens only."""
    out, _ = prepared_chat
    manifest = json.loads((out / "manifest.json").read_text())
    cfg = tiny_cfg.replace(data=dict(source="tokens", path=str(out)), model=dict(vocab_size=320, seq_len=128))
    with pytest.raises(JaxdistError, match="set data.document_mask=true"):
        loader.load_windows(cfg)
    train, _ = loader.load_windows(cfg.replace(data=dict(document_mask=True)))
    trained = sum(manifest["splits"][s]["trained_tokens"] for s in ("train", "val"))
    assert 0 < trained < sum(manifest["splits"][s]["tokens"] for s in ("train", "val"))
    assert f"loss on the assistant's tokens only ({trained:,} of " in train.label
    assert "attention inside each conversation" in train.label


def test_a_run_on_prepared_chat_data_keeps_the_template_for_generate_chat(prepared_chat, tiny_cfg, tmp_path):
    """docs/chat-data.md's recipe: train on a prepared folder, then `generate --run-dir RUN --chat MSG`
    reads the template from the tokenizer the run recorded (it was left behind: a one-line error)."""
    from jaxdist.data import run_tokenizer
    from jaxdist.hf import export
    from jaxdist.inference import decode

    out, _ = prepared_chat
    cfg = tiny_cfg.replace(data=dict(source="tokens", path=str(out)), model=dict(vocab_size=320, seq_len=128))
    run_tokenizer.record(run_tokenizer.of_config(cfg), tmp_path)
    text = decode.Text(cfg, tmp_path / "hf_source", recorded=run_tokenizer.of_run(tmp_path))
    want = chat.prompt_ids(chat_tokenizer("qwen"), [{"role": "user", "content": "Say hello."}])
    assert decode.chat_prompts(text, ["Say hello."]) == [want]
    export.copy_tokenizer(str(tmp_path / run_tokenizer.FOLDER), None, tmp_path)  # as convert to-hf exports it
    assert (tmp_path / "chat_template.jinja").read_text() == (FIX / "qwen" / "chat_template.jinja").read_text()
    (tmp_path / "tokenizer" / "chat_template.jinja").unlink()  # a run recorded without it: generate's own fix
    with pytest.raises(JaxdistError, match="no chat template.*copy the model's chat_template.jinja into it"):
        decode.chat_prompts(decode.Text(cfg, tmp_path, recorded=run_tokenizer.of_run(tmp_path)), ["Hi"])


def _mask_value_2(folder: Path, f: str) -> None:
    m = np.fromfile(folder / f, np.uint8)
    m[np.flatnonzero(m)[0]] = 2
    m.tofile(folder / f)


def _mask_zeroed(folder: Path, f: str) -> None:
    np.zeros((folder / f).stat().st_size, np.uint8).tofile(folder / f)


MASK_DAMAGE = {  # issue 39 item 7: each was accepted (nan loss, skipped steps) or a FileNotFoundError
    "a value other than 0/1": (
        _mask_value_2,
        r"train/000000.mask holds the value 2 where a loss mask holds only 0 or 1",
    ),
    "an all-zero mask": (
        _mask_zeroed,
        r"the train/ masks mark [\d,]+ tokens to train on but its manifest.json records",
    ),
    "a missing .mask": (
        lambda folder, f: (folder / f).unlink(),
        r"train/000000.mask is missing \(its manifest.json lists",
    ),
}


@pytest.mark.parametrize("damage", MASK_DAMAGE, ids=str)
def test_chat_masks_are_checked_against_the_manifest(damage, prepared_chat, tiny_cfg, tmp_path):
    out, _ = prepared_chat
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    make, message = MASK_DAMAGE[damage]
    make(copy, json.loads((copy / "manifest.json").read_text())["splits"]["train"]["mask_files"][0])
    cfg = tiny_cfg.replace(
        data=dict(source="tokens", path=str(copy), document_mask=True), model=dict(vocab_size=320, seq_len=128)
    )
    with pytest.raises(JaxdistError, match=message):
        loader.load_windows(cfg)


def test_bad_lines_are_counted_by_line_or_stop(tmp_path, capsys):
    good = json.dumps(CONVERSATIONS[1])
    bad = [
        good,
        '{"messages": [{"role": "user", "content": "unterminated"}',  # 2: bad JSON
        json.dumps({"messages": [{"role": "robot", "content": "beep"}]}),  # 3: unknown role
        "",  # blank: ignored, not counted
        json.dumps({"messages": [{"role": "user", "content": "only a question"}]}),  # 5: nothing to train on
        json.dumps({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y " * 200}]}),
        json.dumps({"messages": [{"role": "user", "content": "<|endoftext|>"}, {"role": "assistant", "content": "k"}]}),
        json.dumps({"text": "not a chat"}),  # 8
        good,
    ]
    (tmp_path / "in.jsonl").write_text("\n".join(bad) + "\n")
    common = ["--tokenizer", FIX / "qwen", "--seq-len", 128, tmp_path / "in.jsonl", "--val-fraction", 0]
    assert run_prepare(*common, "--out", tmp_path / "a") == 0
    log = capsys.readouterr().out
    assert "skipped 6 of 8 conversations" in log
    src = tmp_path / "in.jsonl"
    listed = (tmp_path / "a" / "skipped.txt").read_text().splitlines()
    assert [line.split(": ", 1)[0] for line in listed] == [f"{src}:{n}" for n in (2, 3, 5, 6, 7, 8)]
    assert "unknown role 'robot'" in listed[1] and "do not fit a window" in listed[3]
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["chat"]["skipped"] == {
        "bad_json": 1,
        "boundary": 1,
        "malformed": 1,
        "no_assistant": 1,
        "too_long": 1,
        "unknown_role": 1,
    }
    assert manifest["splits"]["train"]["documents"] == 2

    assert run_prepare(*common, "--out", tmp_path / "b", "--on-error", "stop") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{src}:2: not valid JSON" in err and "--on-error skip" in err
    assert not (tmp_path / "b").exists()


def test_bad_chat_flags_are_one_line_errors(tmp_path, capsys):
    def fails(*argv):
        assert prepare.main(["prepare", *map(str, argv)]) == 2
        return capsys.readouterr().err

    (tmp_path / "a.txt").write_text("hello")
    (tmp_path / "c.jsonl").write_text(json.dumps(CONVERSATIONS[0]) + "\n")
    tok = FIX / "qwen"
    assert "add --chat" in fails("--tokenizer", tok, "--out", tmp_path / "o", "--seq-len", 64, tmp_path / "a.txt")
    assert "needs --seq-len" in fails("--chat", "--tokenizer", tok, "--out", tmp_path / "o", tmp_path / "c.jsonl")
    chat_field = fails(
        "--chat", "--field", "body", "--tokenizer", tok, "--seq-len", 64, "--out", tmp_path / "o", tmp_path / "c.jsonl"
    )
    assert "--field does not apply to --chat" in chat_field  # issue 39: was ignored silently
    assert "not .jsonl" in fails(
        "--chat", "--tokenizer", tok, "--seq-len", 64, "--out", tmp_path / "o", tmp_path / "a.txt"
    )
    assert "--train-tokenizer" in fails(
        "--chat", "--train-tokenizer", 300, "--seq-len", 64, "--out", tmp_path / "o", tmp_path / "c.jsonl"
    )
    no_template = tmp_path / "bare"
    no_template.mkdir()
    (no_template / "tokenizer.json").write_bytes((tok / "tokenizer.json").read_bytes())
    err = fails("--chat", "--tokenizer", no_template, "--seq-len", 64, "--out", tmp_path / "o", tmp_path / "c.jsonl")
    assert "no chat template" in err and "--chat-template" in err
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------------- the masked loss on a mesh


def masked_batch(cfg, seed=3):
    """Random tokens with a loss mask whose density differs a lot between rows (2 to all 24 targets), so
    a mean of per-replica or per-micro-batch means would differ from the global token-weighted mean."""
    rng = np.random.default_rng(seed)
    B, L = cfg.train.global_batch, cfg.model.seq_len + 1
    ids = rng.integers(0, cfg.model.vocab_size, (B, L))
    keep = np.array([2, 24, 5, 17, 3, 24, 9, 1, 12, 1, 24, 6, 2, 20, 4, 8])[:B]
    mask = np.zeros((B, L), np.uint8)
    for r in range(B):
        mask[r, 1 + rng.choice(L - 1, keep[r], replace=False)] = 1
    mask[:, 0] = rng.integers(0, 2, B)  # the first token is never a target: its mask must not matter
    return ids, mask


def test_masked_loss_is_token_weighted_over_the_global_batch(tiny_cfg):
    """Loss and gradients with a loss mask on dp=2,fsdp=4 with 2 micro-batches, through the implicit stage
    and the explicit dense reduction, equal the unsharded masked mean computed by hand; so does eval."""
    from flax import nnx

    model = dict(num_layers=1, d_model=32, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64, seq_len=24)
    cfg = tiny_cfg.replace(
        model=dict(**model, vocab_size=64, init_std=0.3), train=dict(global_batch=16, grad_accum_steps=2)
    )
    ids, mask = masked_batch(cfg)
    tokens = loss_mask.encode(ids, mask)
    mesh = mesh_mod.mesh_from_string("dp=2,fsdp=4")

    prog = step.build_program(cfg.replace(reduce=dict(method="dense")), mesh)  # explicit reduction over dp
    state = prog.init_state(0)
    host = jax.device_get(state.params)

    def by_hand(params):  # one device, no sharding: mean of -log p over the masked-in targets
        logits = nnx.merge(prog.graphdef, params)(jnp.asarray(ids[:, :-1]))
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), jnp.asarray(ids[:, 1:])[..., None], -1)[..., 0]
        w = jnp.asarray(mask[:, 1:], jnp.float32)
        return (nll * w).sum() / w.sum(), nll

    with jax.default_device(jax.devices()[0]):
        (want_loss, nll), want_grads = jax.device_get(jax.jit(jax.value_and_grad(by_hand, has_aux=True))(host))
    want_grads = jax.tree.leaves(want_grads)
    # what averaging per-row means would give instead (the test can tell them apart)
    per_row = float(np.mean((nll * mask[:, 1:]).sum(1) / mask[:, 1:].sum(1)))
    assert abs(per_row - float(want_loss)) > 0.05

    placed = jax.device_put(tokens, prog.batch_sharding)
    scale = max(float(np.abs(g).max()) for g in want_grads)
    stages = {"dense": (prog.gradients, state.reducer_state), "implicit": (implicit_gradients(prog.apply_fn, 2), ())}
    for method, (stage, reducer_state) in stages.items():
        with prog.activate():
            grads, loss, _, _ = jax.device_get(jax.jit(stage.apply)(state.params, placed, reducer_state, state.step))
        np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5, err_msg=method)
        worst = max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(grads), want_grads, strict=True))
        assert worst < 1e-5 * scale, (method, worst, scale)
    loss_sum, count = prog.eval_step(state.params, placed)
    assert float(count) == mask[:, 1:].sum()
    np.testing.assert_allclose(float(loss_sum) / float(count), float(want_loss), rtol=1e-5)


def test_loss_on_all_trains_every_token_but_the_padding(tmp_path):
    args = ["--tokenizer", FIX / "llama3", "--seq-len", 320, "--val-fraction", 0, "--loss-on", "all"]
    assert run_prepare(*args, "--out", tmp_path / "o", FIX / "conversations.jsonl") == 0
    manifest = json.loads((tmp_path / "o" / "manifest.json").read_text())
    split = manifest["splits"]["train"]
    assert manifest["chat"]["rule"] == "all" and split["documents"] == len(CONVERSATIONS)
    ids = np.fromfile(tmp_path / "o" / split["files"][0], np.uint16)
    mask = np.fromfile(tmp_path / "o" / split["mask_files"][0], np.uint8)
    # every conversation token and its boundary; not the padding nor the last window's extra token
    assert split["trained_tokens"] == int(mask.sum()) == len(ids) - split["padding_tokens"] - 1
    assert mask[ids != manifest["eos_id"]].all()
