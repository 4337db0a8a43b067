"""Untrusted input is bounded: chat templates (time and size), chat JSONL lines (size, UTF-8, surrogates,
depth), documents that are not UTF-8, `prepare --workers`; and `prepare` on a full disk leaves nothing."""

import dataclasses
import json
import os
import time
from pathlib import Path

import pytest
from conftest import full_disk

from jaxdist.data import chat, chat_template, jsonl_lines, prepare, template_sandbox
from jaxdist.errors import JaxdistError

FIX = Path(__file__).parent / "fixtures" / "chat"
GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


@pytest.fixture(scope="module")
def qwen():
    return chat.load(str(FIX / "qwen"))


def with_template(ct, text: str):
    return dataclasses.replace(
        ct, template=chat_template.compile_template(text, "t.jinja"), text=text, source="t.jinja"
    )


# Each ran for minutes or filled memory before (range nested twice: > 200 s; 'a' * 300000000: 21 GB).
HOSTILE = {
    "nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "repeat": "{{ 'a' * 300000000 }}",
    "huge range": "{{ range(10**12)|list }}",
    "recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "width": "{{ 'a'|center(1000000000) }}{{ 'b'.ljust(1000000000) }}",
    "format width": "{{ '%0300000000d' % 1 }}",
    "power": "{{ 10 ** 100000000 }}",
    "doubling": "{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "replace": "{{ ('a' * 1000000)|replace('a', 'a' * 1000000) }}",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_template_is_stopped_by_the_limits(qwen, name, monkeypatch):
    monkeypatch.setattr(template_sandbox, "RENDER_SECONDS", 0.3)
    t0 = time.monotonic()
    with pytest.raises(chat.BadConversation) as e:
        chat.render(with_template(qwen, HOSTILE[name]), GOOD["messages"])
    # 5 s: the 0.3 s limit plus a loaded 2-core CI machine; unlimited, these run for minutes or exhaust memory
    assert time.monotonic() - t0 < 5 and e.value.kind == "template_limit", e.value.reason
    assert "\n" not in e.value.reason and len(e.value.reason) < 300


def test_limits_leave_ordinary_templates_and_big_numbers_alone(qwen):
    text = "{{ '%d' % 99999999999 }} {{ 123456789|filesizeformat }} {{ '{} {}'.format(1, 2) }}{{ 'x' * 3 }}"
    assert chat.render(with_template(qwen, text), GOOD["messages"])[0] == "99999999999 123.5 MB 1 2xxx"
    ids, mask = chat.encode(qwen, GOOD)  # the fixture template itself, unchanged (test_chat checks it in full)
    assert len(ids) == len(mask) > 0 and mask.any()


def test_generate_chat_and_prepare_chat_stop_a_bad_template_in_one_line(qwen, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(template_sandbox, "RENDER_SECONDS", 0.3)
    with pytest.raises(JaxdistError, match=r"cannot build a chat prompt with t\.jinja: .*ran longer than 0\.3s"):
        chat.prompt_ids(with_template(qwen, HOSTILE["nested loops"]), [{"role": "user", "content": "hi"}])
    with pytest.raises(JaxdistError, match=r"ZeroDivisionError"):
        chat.prompt_ids(with_template(qwen, "{{ 1 / 0 }}"), [{"role": "user", "content": "hi"}])
    with pytest.raises(JaxdistError, match="chat message 1 is not UTF-8"):
        chat.prompt_ids(qwen, [{"role": "user", "content": b"caf\xe9".decode("utf-8", "surrogateescape")}])
    # prepare --chat: a template slow on a 3-message probe is the template's fault: one line, before any data
    (tmp_path / "slow.jinja").write_text(HOSTILE["nested loops"] + "{{ messages[0].content }}")
    (tmp_path / "in.jsonl").write_text(json.dumps(GOOD) + "\n")
    argv = ["prepare", "--chat", "--tokenizer", str(FIX / "qwen"), "--seq-len", "64", "--workers", "1"]
    argv += [str(tmp_path / "in.jsonl"), "--out", str(tmp_path / "out")]
    assert prepare.main([*argv, "--chat-template", str(tmp_path / "slow.jinja")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ran longer than 0.3s" in err and "fix the template" in err, err
    (tmp_path / "latin1.jinja").write_bytes(b"{{ 'caf\xe9' }}")
    assert prepare.main([*argv, "--chat-template", str(tmp_path / "latin1.jinja")]) == 2
    assert "latin1.jinja is not UTF-8 (byte 0xe9 at offset 7); save it as UTF-8" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


def test_bad_chat_lines_are_skipped_by_kind_or_stop(tmp_path, monkeypatch, capsys):
    """Non-UTF-8 bytes were replaced by U+FFFD even with --on-error stop; a lone surrogate or 100k-deep JSON
    raised; a 10 MB message took 3.5 GB and 23 s to be refused; a line of any length was read whole."""
    monkeypatch.setattr(jsonl_lines, "MAX_LINE_BYTES", 50_000)
    good = json.dumps(GOOD).encode()
    lines = [
        good,
        good.replace(b"hello", b"caf\xe9"),  # 2: latin-1
        good.replace(b"hello", b"\\ud800"),  # 3: a lone surrogate
        b"[" * 100_000 + b"]" * 100_000,  # 4: deeper than the parser (and over the line limit)
        b"[" * 20_000 + b"]" * 20_000,  # 5: deeper than the parser
        json.dumps({"messages": [GOOD["messages"][0], {"role": "assistant", "content": "x " * 5000}]}).encode(),  # 6
        good,
    ]
    (tmp_path / "in.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    common = ["prepare", "--chat", "--tokenizer", str(FIX / "qwen"), "--seq-len", "64", "--workers", "1"]
    common += [str(tmp_path / "in.jsonl"), "--val-fraction", "0"]
    t0 = time.monotonic()
    assert prepare.main([*common, "--out", str(tmp_path / "a")]) == 0
    assert time.monotonic() - t0 < 10
    listed = (tmp_path / "a" / "skipped.txt").read_text().splitlines()
    src = tmp_path / "in.jsonl"
    assert [x.split(": ", 1)[0] for x in listed] == [f"{src}:{n}" for n in (2, 3, 4, 5, 6)]
    assert "byte 0xe9 at offset" in listed[0] and "lone surrogate \\ud800" in listed[1]
    assert "over 50,000 bytes; it was not read" in listed[2] and "nests 20,000 levels deep (at most 100)" in listed[3]
    assert "renders to" in listed[4] and "more than 63 tokens" in listed[4]
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["chat"]["skipped"] == {"bad_json": 1, "bad_utf8": 2, "too_long": 2}
    assert manifest["splits"]["train"]["documents"] == 2
    capsys.readouterr()
    assert prepare.main([*common, "--out", str(tmp_path / "b"), "--on-error", "stop"]) == 2
    err = capsys.readouterr().err
    want = "byte 0xe9 at offset 86 is not UTF-8 (convert the file to UTF-8); fix the line, or pass --on-error skip"
    assert err == f"error: {src}:2: {want}\n"
    assert not (tmp_path / "b").exists()


def test_documents_that_are_not_utf8_follow_on_error(tmp_path, capsys):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("plain text " * 50)
    (tmp_path / "in" / "b.txt").write_bytes(b"caf\xe9 au lait " * 50)
    common = ["prepare", "--train-tokenizer", "300", "--workers", "1", str(tmp_path / "in"), "--val-fraction", "0"]
    assert prepare.main([*common, "--out", str(tmp_path / "a")]) == 0
    assert "skipped 1 document(s) that are not UTF-8" in capsys.readouterr().out
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["input"]["skipped"] == {"not_utf8": 1} and manifest["splits"]["train"]["documents"] == 1
    listed = (tmp_path / "a" / "skipped.txt").read_text()
    assert listed == f"{tmp_path / 'in' / 'b.txt'}: byte 0xe9 at offset 3 is not UTF-8\n"
    assert prepare.main([*common, "--out", str(tmp_path / "b"), "--on-error", "stop"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "b.txt: byte 0xe9 at offset 3 is not UTF-8; convert it to UTF-8" in err
    assert not (tmp_path / "b").exists()


def test_workers_are_capped(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("text")
    argv = ["prepare", "--train-tokenizer", "300", str(tmp_path / "a.txt"), "--out", str(tmp_path / "o")]
    assert prepare.main([*argv, "--workers", "100000"]) == 2
    err = capsys.readouterr().err
    most = prepare.max_workers()
    assert err.count("\n") == 1 and f"give --workers {most} or fewer" in err and not (tmp_path / "o").exists()
    assert most == max(4, 2 * len(os.sched_getaffinity(0)))


@pytest.mark.parametrize("kind", ["text", "chat"])
def test_prepare_on_a_full_disk_leaves_nothing_and_the_rerun_works(tmp_path, capsys, kind):
    """A raw OSError traceback before (the temporary folder was removed); now one line naming the fix."""
    if kind == "chat":
        (tmp_path / "in.jsonl").write_text((json.dumps(GOOD) + "\n") * 400)
        argv = ["--chat", "--tokenizer", str(FIX / "qwen"), "--seq-len", "64", str(tmp_path / "in.jsonl")]
    else:
        (tmp_path / "in.txt").write_text(" ".join(f"w{i % 5000}" for i in range(40_000)))
        argv = ["--tokenizer", str(FIX / "qwen"), str(tmp_path / "in.txt")]
    with full_disk(tmp_path / "disk", 64) as grow:
        out = tmp_path / "disk" / "out"
        argv = ["prepare", "--workers", "1", *argv, "--out", str(out)]
        assert prepare.main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"error: cannot write {out} (no space left on device): nothing " in err, err
        assert "free space, then run the same command" in err
        assert list((tmp_path / "disk").iterdir()) == []  # nothing half-written, no hidden folder
        grow(4096)
        assert prepare.main(argv) == 0
        assert json.loads((out / "manifest.json").read_text())["splits"]["train"]["documents"] > 0
