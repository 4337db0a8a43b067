"""Issue 39's red-team cases, re-run: each one a small jaxdist command under a timeout, judged; prints the table.

    python scripts/checks/redteam.py                 # every case (~10 min on 2 shared cores), the table at the end
    python scripts/checks/redteam.py --only chat     # the cases whose name holds "chat" (or --only B: a group)
    python scripts/checks/redteam.py --keep /tmp/rt  # keep the work folder (runs, prepared data, logs per case)

Verdicts:
- `clean error`: exit 2, exactly one `error:` line on stderr, no traceback;
- `correct`: exit 0 (or the exit the case expects) and the case's check of the result holds;
- `silent wrong`: exit 0 where an error was due, or a result that fails the case's check;
- `hang`: the timeout passed (the process group is killed);
- `traceback`: a Python traceback, or an exit status that is neither 0 nor 2 (nor the case's own).
A case that needs a mount (a small tmpfs for a full disk, a read-only bind mount) and cannot make one says
`not run`. The setup (a prepared folder, a 2-step run, a LoRA run, HF and chat fixtures) is made first.
Groups: A (file verifiers: reads), B (bounded input, atomic writes, launcher: bounds), L (LoRA/PEFT: finetune2).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "fixtures"
PEFT_BASE = FIX / "hf_llama"  # the model tests/fixtures/lora_peft adapts (tests/test_lora.py's BASE)
MICRO = ["model.num_layers=1", "model.d_model=32", "model.num_heads=2", "model.num_kv_heads=1"]
MICRO += ["model.head_dim=16", "model.mlp_dim=64", "model.seq_len=16", "train.eval_every=0"]
ENV = {
    **os.environ,
    "JAX_PLATFORMS": "cpu",
    "JAX_NUM_CPU_DEVICES": "8",
    "TQDM_DISABLE": "1",
    "HF_HUB_OFFLINE": "1",
    "PYTHONUNBUFFERED": "1",
}
GOOD_CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}


@dataclasses.dataclass
class Case:
    group: str  # A, B, L
    name: str
    argv: Callable[[Path], list[str]]  # the command, given the work folder
    expect: str = "error"  # "error": a clean error is the right answer; "ok": a result, judged by `check`
    setup: Callable[[Path], object] | None = None  # returns False: cannot run here ("not run")
    check: Callable[[Path, subprocess.CompletedProcess], bool] | None = None
    timeout: float = 120
    runner: Callable[[Path], tuple[str, str]] | None = None  # a case with its own procedure: (verdict, note)


def jx(module: str, *args) -> list[str]:
    return [sys.executable, "-m", f"jaxdist.{module}", *map(str, args)]


def sh(argv: list[str], timeout: float = 600, env=None, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env or ENV, cwd=cwd or ROOT)


MOUNTED: list[str] = []  # unmounted at the end (a bind mount is not a mount point to Path.is_mount)


def mount(args: list[str]) -> bool:
    ok = subprocess.run(["mount", *args], capture_output=True).returncode == 0
    if ok and not args[0].startswith("-o"):
        MOUNTED.append(args[-1])
    return ok


def tmpfs(path: Path, kb: int) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return mount(["-t", "tmpfs", "-o", f"size={kb}k", "tmpfs", str(path)])


def write(path: Path, data: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data) if isinstance(data, bytes) else path.write_text(data)
    return path


def fresh(path: Path) -> Path:
    """`path` removed first: a case that trains a new run starts it even in a reused --keep folder."""
    shutil.rmtree(path, ignore_errors=True)
    return path


def copy(src: Path, dst: Path) -> Path:
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    return dst


# ------------------------------------------------------------------------------------------------ setup


SETUP = {"corpus", "prep", "run", "chat.jsonl", "lora_run", "tokens128.bin"}  # what setup and lora_run make


def setup(w: Path) -> None:
    """The shared inputs: a corpus, its prepared folder (BPE 300), a 2-step run on it, a chat folder."""
    for i in range(4):
        write(w / "corpus" / f"{i}.txt", " ".join(f"word{(i * 7 + j) % 97} and more text {j}" for j in range(800)))
    steps = [  # (what it makes, the command): skipped when made, so --keep DIR can be reused
        (w / "prep" / "manifest.json", jx("data", "prepare", "--train-tokenizer", 300, "--workers", 1)),
        (w / "run" / "checkpoints" / "2", jx("train", "--run-dir", w / "run", *MICRO)),
    ]
    steps[0][1].extend(["--out", str(w / "prep"), str(w / "corpus")])
    steps[1][1].extend([f"data.path={w / 'prep'}", "model.vocab_size=300", "train.steps=2", "checkpoint.every=2"])
    write(w / "chat.jsonl", "\n".join(json.dumps(GOOD_CHAT) for _ in range(40)) + "\n")
    for made, argv in steps:
        if made.exists():
            continue
        r = sh(argv)
        if r.returncode != 0:
            sys.exit(f"setup failed: {' '.join(argv)}\n{r.stderr[-3000:]}")


def chat_prepare(w: Path, *extra) -> list[str]:
    return jx("data", "prepare", "--chat", "--tokenizer", FIX / "chat" / "qwen", "--seq-len", 64, *extra)


def run_copy(w: Path, name: str) -> Path:
    return copy(w / "run", w / name)


def flip_byte(w: Path) -> None:
    run = run_copy(w, "run_flip")
    ck = run / "checkpoints" / "2"
    write(ck / "jaxdist-checksums.json", json.dumps({"files": {}}))
    big = max((p for p in ck.rglob("*") if p.is_file() and "params" in str(p)), key=lambda p: p.stat().st_size)
    data = bytearray(big.read_bytes())
    data[len(data) // 2] ^= 0xFF
    big.write_bytes(bytes(data))


def hf_both_layouts(w: Path) -> None:
    d = copy(FIX / "hf_llama", w / "hf_both")
    shutil.copy(d / "model.safetensors", d / "model-00001-of-00001.safetensors")
    names = json.loads(sh([sys.executable, "-c", SAFETENSOR_KEYS, str(d / "model.safetensors")]).stdout)
    write(
        d / "model.safetensors.index.json",
        json.dumps({"weight_map": dict.fromkeys(names, "model-00001-of-00001.safetensors")}),
    )


SAFETENSOR_KEYS = (
    "import json, sys; from safetensors import safe_open; print(json.dumps(list(safe_open(sys.argv[1], 'np').keys())))"
)


def hf_outside(w: Path) -> None:
    d = copy(FIX / "hf_llama", w / "hf_out" / "a" / "model")
    names = json.loads(sh([sys.executable, "-c", SAFETENSOR_KEYS, str(d / "model.safetensors")]).stdout)
    shutil.move(d / "model.safetensors", w / "hf_out" / "outside.safetensors")
    write(
        d / "model.safetensors.index.json",
        json.dumps({"weight_map": dict.fromkeys(names, "../../outside.safetensors")}),
    )


def hub_cache(w: Path, ref: str, name: str = "models--acme--tiny") -> None:
    """A Hub cache (HF_HUB_CACHE=w/hub) whose refs/main holds `ref`."""
    snap = w / "hub" / name / "snapshots" / "abc123"
    copy(FIX / "hf_llama", snap)
    write(w / "hub" / name / "refs" / "main", ref)


def chat_folder(w: Path, name: str, damage: Callable[[Path], None]) -> None:
    out = w / name
    shutil.rmtree(out, ignore_errors=True)
    r = sh(chat_prepare(w, "--out", out, "--val-fraction", 0, w / "chat.jsonl"))
    assert r.returncode == 0, r.stderr
    damage(out)


def chat_train(w: Path, name: str) -> list[str]:
    return jx(
        "train",
        "--run-dir",
        w / f"{name}_run",
        f"data.path={w / name}",
        *MICRO,
        "model.seq_len=64",
        "model.vocab_size=320",
        "data.document_mask=true",
    )


def template(w: Path, name: str, text: str | bytes) -> Path:
    return write(w / "templates" / name, text)


def generate_chat_run(w: Path, name: str, text: str | bytes) -> None:
    run = run_copy(w, name)
    write(run / "tokenizer" / "chat_template.jinja", text)


def full_disk_prepare(w: Path, chat: bool) -> list[str]:
    disk = w / ("disk_chat" if chat else "disk_text")
    if chat:
        write(w / "chat_big.jsonl", (json.dumps(GOOD_CHAT) + "\n") * 400)
        return chat_prepare(w, "--workers", 1, "--out", disk / "out", w / "chat_big.jsonl")
    write(w / "big.txt", " ".join(f"w{i % 5000}" for i in range(40_000)))
    return jx(
        "data", "prepare", "--tokenizer", FIX / "chat" / "qwen", "--workers", 1, "--out", disk / "out", w / "big.txt"
    )


LORA_SETUP = threading.Lock()  # two cases share the LoRA run; made once


def lora_run(w: Path) -> bool:
    """A 2-step LoRA run on the HF fixture (docs/lora.md's CPU recipe, shortened); made once per work folder."""
    with LORA_SETUP:
        return _lora_run(w)


def _lora_run(w: Path) -> bool:
    if (w / "lora_run" / "checkpoints" / "2").is_dir():
        return True
    shutil.rmtree(w / "lora_run", ignore_errors=True)  # a half-made one from an interrupted setup
    tokens = w / "tokens128.bin"
    if not tokens.is_file():
        np_code = f"import numpy as np; (np.arange(40_000) * 37 % 128).astype(np.uint16).tofile({str(tokens)!r})"
        sh([sys.executable, "-c", np_code])
    r = sh(
        jx("train", "--restore", f"hf:{FIX / 'hf_llama'}", "--run-dir", w / "lora_run", "lora.rank=4")
        + ["data.source=tokens", f"data.path={tokens}", "model.seq_len=32", "train.steps=2", "checkpoint.every=2"]
        + ["train.eval_every=0", "checkpoint.async_save=false"]
    )
    return r.returncode == 0


def peft_file(w: Path, kind: str) -> None:
    d = copy(FIX / "lora_peft", w / f"peft_{kind}")
    code = (
        "import sys, numpy as np; from safetensors.numpy import load_file, save_file; f = sys.argv[1]; t = load_file(f); "
        "k = sorted(t)[0]; "
        + ("t[k] = np.full_like(t[k], np.nan)" if kind == "nan" else "t[k] = t[k].astype(np.int32)")
        + "; save_file(t, f)"
    )
    sh([sys.executable, "-c", code, str(d / "adapter_model.safetensors")])


PEFT_READ = (
    "import sys; from pathlib import Path; from jaxdist.adapters import peft_read; from jaxdist.hf import mapping; "
    "from jaxdist.errors import JaxdistError\n"
    "try:\n    peft_read.read(Path(sys.argv[1]), mapping.hf_config(None, [], Path(sys.argv[2])).model)\n"
    "except JaxdistError as e:\n    print(f'error: {e}', file=sys.stderr); sys.exit(2)"
)


# -------------------------------------------------------------------------------------- special runners


def two_processes_one_stopped(w: Path, whole_host: bool) -> tuple[str, str]:
    """A real 2-process run under scripts/cluster/launch_local.sh; process 1 stopped (SIGSTOP) mid-run: its
    supervisor and training process (`whole_host`), or its training process alone."""
    run = w / ("stop_host" if whole_host else "stop_worker")
    shutil.rmtree(run, ignore_errors=True)
    env = {**ENV, "JAX_NUM_CPU_DEVICES": "4", "STOP_GRACE": "5"}
    argv = [str(ROOT / "scripts/cluster/launch_local.sh"), "2", "--run-dir", str(run), "--mesh", "fsdp=8", *MICRO]
    argv += ["train.steps=100000", "checkpoint.every=100000", "--heartbeat-timeout", "10"]
    log = (w / f"{run.name}.log").open("w")
    p = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not ((run / "metrics.jsonl").exists() and len((run / "metrics.jsonl").read_text().splitlines()) >= 2):
            if p.poll() is not None or time.monotonic() > deadline:
                return "not run", f"the run did not start (see {log.name})"
            time.sleep(0.5)
        table = [Path(f"/proc/{c}") for c in _children(p.pid)]  # the two supervisors (the subshells exec'd)
        sups = sorted(int(t.name) for t in table)
        index = {_process_id(s): s for s in sups}
        sup1 = index.get(1)
        workers = _children(sup1)
        victims = [sup1, *workers] if whole_host else workers
        for v in victims:
            os.kill(v, signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            p.wait(timeout=180)
        except subprocess.TimeoutExpired:
            return "hang", f"launcher still waiting after 180 s (see {log.name})"
        took = time.monotonic() - t0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        log.close()
    out = (w / f"{run.name}.log").read_text()
    if "Traceback" in out:
        return "traceback", f"{took:.0f} s"
    lines = [x for x in out.splitlines() if "error: process" in x]
    named1 = [x for x in lines if "error: process 1 " in x]
    blamed0 = [x for x in lines if "error: process 0 " in x and "stopped answering" in x]
    if named1 and not blamed0:
        return "clean error", f"process 1 named ({len(named1)} line(s)); launcher ended in {took:.0f} s"
    return "silent wrong", f"lines: {lines[-2:]}"


def _children(pid: int) -> list[int]:
    return [int(c) for f in Path(f"/proc/{pid}/task").glob("*/children") for c in f.read_text().split()]


def _process_id(pid: int) -> int:
    args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return int(args[args.index(b"--process-id") + 1])


# ------------------------------------------------------------------------------------------------ cases


def cases() -> list[Case]:
    c: list[Case] = []
    add = lambda *a, **k: c.append(Case(*a, **k))
    # ---- A: one verifier for every file a command reads ----
    add(
        "A",
        "1 run without tokenizer/: generate --run-dir",
        lambda w: jx("generate", "--run-dir", w / "run_notok", "--prompt", "word1", "--max-new-tokens", 2),
        setup=lambda w: shutil.rmtree(run_copy(w, "run_notok") / "tokenizer"),
    )
    add(
        "A",
        "1 run without tokenizer/: to-hf",
        lambda w: jx("convert", "to-hf", w / "run_notok2", w / "hf_notok"),
        setup=lambda w: shutil.rmtree(run_copy(w, "run_notok2") / "tokenizer"),
    )
    add(
        "A",
        "2 data re-prepared with another tokenizer, --allow-config-change data",
        lambda w: jx(
            "train",
            "--run-dir",
            w / "run_retok",
            f"data.path={w / 'prep2'}",
            "model.vocab_size=300",
            *MICRO,
            "train.steps=3",
            "--allow-config-change",
            "data",
        ),
        setup=lambda w: (
            run_copy(w, "run_retok"),
            sh(jx("data", "prepare", "--train-tokenizer", 280, "--workers", 1, "--out", w / "prep2", w / "corpus")),
        ),
    )
    add(
        "A",
        "3 empty checksum list + a flipped byte: resume",
        lambda w: jx(
            "train",
            "--run-dir",
            w / "run_flip",
            f"data.path={w / 'prep'}",
            "model.vocab_size=300",
            *MICRO,
            "train.steps=3",
        ),
        setup=flip_byte,
    )
    add(
        "A",
        "4 prepared folder without manifest.json: train",
        lambda w: jx(
            "train",
            "--run-dir",
            w / "run_noman",
            f"data.path={w / 'prep_noman'}",
            "model.vocab_size=300",
            *MICRO,
            "train.steps=1",
        ),
        setup=lambda w: (copy(w / "prep", w / "prep_noman") / "manifest.json").unlink(),
    )
    add(
        "A",
        "5 HF folder with model.safetensors and an index: generate --hf",
        lambda w: jx("generate", "--hf", w / "hf_both", "--prompt-tokens", "1 2 3", "--max-new-tokens", 2),
        setup=hf_both_layouts,
    )
    add(
        "A",
        "7 chat .mask value 2: train",
        lambda w: chat_train(w, "chat_mask2"),
        setup=lambda w: chat_folder(
            w,
            "chat_mask2",
            lambda d: write(d / "train" / "000000.mask", bytes([2]) * (d / "train" / "000000.mask").stat().st_size),
        ),
    )
    add(
        "A",
        "7 chat .mask all zero vs trained_tokens: train",
        lambda w: chat_train(w, "chat_mask0"),
        setup=lambda w: chat_folder(
            w,
            "chat_mask0",
            lambda d: write(d / "train" / "000000.mask", bytes(1) * (d / "train" / "000000.mask").stat().st_size),
        ),
    )
    add(
        "A",
        "chat folder missing its .mask: train",
        lambda w: chat_train(w, "chat_nomask"),
        setup=lambda w: chat_folder(w, "chat_nomask", lambda d: (d / "train" / "000000.mask").unlink()),
    )
    add(
        "A",
        "10 index weight_map ../../outside.safetensors: generate --hf",
        lambda w: jx("generate", "--hf", w / "hf_out" / "a" / "model", "--prompt-tokens", "1 2", "--max-new-tokens", 2),
        setup=hf_outside,
    )
    add(
        "A",
        "10 Hub cache refs/main -> ../../etc",
        lambda w: jx("generate", "--hf", "acme/tiny", "--prompt-tokens", "1 2", "--max-new-tokens", 2),
        setup=lambda w: hub_cache(w, "../../../../etc"),
    )
    add(
        "A",
        "unclear: empty refs/main",
        lambda w: jx("generate", "--hf", "acme/empty", "--prompt-tokens", "1 2", "--max-new-tokens", 2),
        setup=lambda w: hub_cache(w, "", "models--acme--empty"),
        check=None,
    )
    add(
        "A",
        "10 corrupt generation_config.json: to-hf",
        lambda w: jx("convert", "to-hf", w / "fromhf_gencfg", w / "hf_gencfg"),
        setup=lambda w: (
            sh(jx("convert", "from-hf", FIX / "hf_llama", fresh(w / "fromhf_gencfg"))).returncode == 0
            and write(w / "fromhf_gencfg" / "hf_source" / "generation_config.json", "{not json") is not None
        ),
    )
    add(
        "A",
        "corrupt generation_config.json: generate --hf",
        lambda w: jx("generate", "--hf", w / "hf_gencfg2", "--prompt-tokens", "1 2", "--max-new-tokens", 2),
        setup=lambda w: write(copy(FIX / "hf_llama", w / "hf_gencfg2") / "generation_config.json", "{not json"),
    )
    for hub_id in ("hf:acme/..", "hf:acme--x/y", "hf:" + "o" * 200 + "/m"):
        add(
            "A",
            f"train --restore {hub_id[:24]}",
            lambda w, h=hub_id: jx("train", "--run-dir", w / "run_hfid", "--restore", h, "train.steps=1"),
        )
    add(
        "A",
        "10 train.steps=5 train.steps=6",
        lambda w: jx("train", "--run-dir", fresh(w / "run_dup"), *MICRO, "train.steps=5", "train.steps=6"),
        expect="ok",  # the last wins, as for a repeated flag, and a warning line says so
        check=lambda w, r: (
            "warning: train.steps is given twice (5, then 6); using 6" in r.stderr
            and json.loads((w / "run_dup" / "metrics.jsonl").read_text().splitlines()[-1]).get("steps") == 6
        ),
    )
    add(
        "A",
        "10 --top-p with greedy",
        lambda w: jx("generate", "--run-dir", w / "run", "--prompt", "word1", "--max-new-tokens", 2, "--top-p", 0.5),
    )
    add(
        "A",
        "10 pipeline.schedule=1f1b at pp=1",
        lambda w: jx("train", "--run-dir", fresh(w / "run_1f1b"), *MICRO, "train.steps=1", "pipeline.schedule=1f1b"),
        expect="ok",
        check=lambda w, r: "warning" in (r.stdout + r.stderr).lower(),
    )
    add(
        "A",
        "10 --field with --chat",
        lambda w: chat_prepare(w, "--field", "body", "--out", w / "chat_field", w / "chat.jsonl"),
    )
    add(
        "A",
        "generate --seed 99999999999999999999999",
        lambda w: jx(
            "generate",
            "--run-dir",
            w / "run",
            "--prompt",
            "word1",
            "--max-new-tokens",
            2,
            "--temperature",
            1,
            "--seed",
            "99999999999999999999999",
        ),
    )
    add(
        "A",
        "plot on a read-only filesystem",
        lambda w: jx("plot", w / "ro" / "run"),
        setup=lambda w: (
            copy(w / "run", w / "ro" / "run"),
            mount(["--bind", str(w / "ro"), str(w / "ro")]) and mount(["-o", "remount,ro,bind", str(w / "ro")]),
        ),
    )
    add(
        "A",
        "unclear: full disk at start with tensorboard",
        lambda w: jx(
            "train", "--run-dir", w / "disk_tb" / "run", *MICRO, "train.steps=1", 'train.trackers=["tensorboard"]'
        ),
        setup=lambda w: tmpfs(w / "disk_tb", 8) and write(w / "disk_tb" / "fill", b"x" * 8000) is not None,
        check=None,
    )
    # ---- B: untrusted input bounded, every writer atomic, nothing waits forever ----
    nested = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{{ messages[0].content }}"
    hostile = {
        "range(100000) nested twice": nested,
        "{{ 'a' * 300000000 }}": "{{ 'a' * 300000000 }}",
        "range(10**12)": "{{ range(10**12)|list }}",
        "recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    }
    for label, text in hostile.items():
        add(
            "B",
            f"template {label}: prepare --chat",
            lambda w, t=text, n=label: chat_prepare(
                w, "--chat-template", template(w, f"{abs(hash(n))}.jinja", t), "--out", w / "o_tpl", w / "chat.jsonl"
            ),
            timeout=60,
        )
        add(
            "B",
            f"template {label}: generate --chat",
            lambda w, n=label: jx(
                "generate", "--run-dir", w / f"gc_{abs(hash(n))}", "--chat", "hi", "--max-new-tokens", 2
            ),
            setup=lambda w, t=text, n=label: generate_chat_run(w, f"gc_{abs(hash(n))}", t),
            timeout=90,
        )
    add(
        "B",
        "template with non-UTF-8 bytes: prepare --chat",
        lambda w: chat_prepare(
            w,
            "--chat-template",
            template(w, "latin1.jinja", b"{{ 'caf\xe9' }}"),
            "--out",
            w / "o_tpl",
            w / "chat.jsonl",
        ),
    )
    add(
        "B",
        "template with non-UTF-8 bytes: generate --chat",
        lambda w: jx("generate", "--run-dir", w / "gc_latin1", "--chat", "hi", "--max-new-tokens", 2),
        setup=lambda w: generate_chat_run(w, "gc_latin1", b"{{ 'caf\xe9' }}"),
    )
    add(
        "B",
        "template that raises: generate --chat",
        lambda w: jx("generate", "--run-dir", w / "gc_raise", "--chat", "hi", "--max-new-tokens", 2),
        setup=lambda w: generate_chat_run(w, "gc_raise", "{{ 1 / 0 }}"),
    )
    add(
        "B",
        "a real 10 MB message: prepare --chat (skipped, counted, fast)",
        lambda w: chat_prepare(w, "--out", w / "o_big", w / "big_msg.jsonl"),
        expect="ok",
        timeout=60,
        setup=lambda w: write(
            w / "big_msg.jsonl",
            json.dumps(
                {"messages": [{"role": "user", "content": "word " * 2_000_000}, {"role": "assistant", "content": "ok"}]}
            )
            + "\n"
            + json.dumps(GOOD_CHAT)
            + "\n",
        ),
        check=lambda w, r: (
            json.loads((w / "o_big" / "manifest.json").read_text())["chat"]["skipped"] == {"too_long": 1}
        ),
    )
    add(
        "B",
        "6 non-UTF-8 chat line, --on-error stop",
        lambda w: chat_prepare(w, "--on-error", "stop", "--out", w / "o_u8", w / "latin1.jsonl"),
        setup=lambda w: write(
            w / "latin1.jsonl", json.dumps(GOOD_CHAT).replace("hello", "caf\xe9").encode("latin-1") + b"\n"
        ),
    )
    add(
        "B",
        "6 non-UTF-8 text document, --on-error stop",
        lambda w: jx(
            "data",
            "prepare",
            "--train-tokenizer",
            300,
            "--workers",
            1,
            "--on-error",
            "stop",
            "--out",
            w / "o_u8t",
            w / "latin1_docs",
        ),
        setup=lambda w: (
            write(w / "latin1_docs" / "a.txt", "plain " * 100),
            write(w / "latin1_docs" / "b.txt", b"caf\xe9 " * 100),
        ),
    )
    add(
        "B",
        "6 non-UTF-8 text document, default (skipped and listed)",
        lambda w: jx(
            "data", "prepare", "--train-tokenizer", 300, "--workers", 1, "--out", w / "o_u8s", w / "latin1_docs"
        ),
        expect="ok",
        setup=lambda w: (
            write(w / "latin1_docs" / "a.txt", "plain " * 100),
            write(w / "latin1_docs" / "b.txt", b"caf\xe9 " * 100),
        ),
        check=lambda w, r: (
            json.loads((w / "o_u8s" / "manifest.json").read_text())["input"]["skipped"] == {"not_utf8": 1}
        ),
    )
    add(
        "B",
        "lone surrogate + 100k-deep JSON in chat JSONL (counted skips)",
        lambda w: chat_prepare(w, "--out", w / "o_sur", w / "sur.jsonl"),
        expect="ok",
        setup=lambda w: write(
            w / "sur.jsonl",
            json.dumps(GOOD_CHAT).replace("hello", "\\ud800")
            + "\n"
            + "[" * 100_000
            + "]" * 100_000
            + "\n"
            + json.dumps(GOOD_CHAT)
            + "\n",
        ),
        check=lambda w, r: (
            json.loads((w / "o_sur" / "manifest.json").read_text())["chat"]["skipped"] == {"bad_json": 1, "bad_utf8": 1}
        ),
    )
    add(
        "B",
        "prepare --workers 100000",
        lambda w: jx(
            "data", "prepare", "--train-tokenizer", 300, "--workers", 100000, "--out", w / "o_w", w / "corpus"
        ),
        timeout=60,
    )
    for kind in ("prepare", "prepare --chat"):
        chat = kind.endswith("--chat")
        disk = "disk_chat" if chat else "disk_text"
        add(
            "B",
            f"full disk: {kind} (nothing left; rerun after freeing works)",
            lambda w, ch=chat: full_disk_prepare(w, ch),
            setup=lambda w, d=disk: tmpfs(w / d, 64),
            check=None,
        )
    add(
        "B",
        "full disk: to-hf",
        lambda w: jx("convert", "to-hf", w / "run", w / "disk_hf" / "hf"),
        setup=lambda w: tmpfs(w / "disk_hf", 32),
    )
    add(
        "B",
        "launch_local.sh 2, one host's processes SIGSTOPped",
        None,
        runner=lambda w: two_processes_one_stopped(w, True),
    )
    add(
        "B",
        "unclear: host 1's training process SIGSTOPped (who is named)",
        None,
        runner=lambda w: two_processes_one_stopped(w, False),
    )
    # ---- L: LoRA / PEFT (finetune2) ----
    add(
        "L",
        "8 from-hf lora.rank=4 lora.base_dtype=nf4, then train",
        lambda w: jx("train", "--run-dir", w / "lora_nf4", "train.steps=1", "train.eval_every=0"),
        expect="ok",
        setup=lambda w: sh(
            jx("convert", "from-hf", FIX / "hf_llama", w / "lora_nf4", "lora.rank=4", "lora.base_dtype=nf4")
        ),
        check=lambda w, r: True,
    )
    add(
        "L",
        "9 plan offload.params=host with pp=2",
        lambda w: jx(
            "plan", "--devices", 8, "--mesh", "pp=2,fsdp=4", *MICRO, "model.num_layers=2", "offload.params=host"
        ),
    )
    add(
        "L",
        "9 plan LoRA with cp=2",
        lambda w: jx("plan", "--devices", 8, "--mesh", "cp=2,fsdp=4", *MICRO, "lora.rank=4"),
    )
    add(
        "L",
        "9 plan nf4 with lora.block_size=7",
        lambda w: jx("plan", "--devices", 8, *MICRO, "lora.rank=4", "lora.base_dtype=nf4", "lora.block_size=7"),
    )
    add(
        "L",
        "10 lora.rank=5000 on d_model 32",
        lambda w: jx("train", "--run-dir", w / "run_rank", *MICRO, "train.steps=1", "lora.rank=5000"),
    )
    add(
        "L",
        "10 peft_read.read: NaN tensor",
        lambda w: [sys.executable, "-c", PEFT_READ, str(w / "peft_nan"), str(PEFT_BASE)],
        setup=lambda w: peft_file(w, "nan"),
    )
    add(
        "L",
        "10 peft_read.read: int32 tensor",
        lambda w: [sys.executable, "-c", PEFT_READ, str(w / "peft_int"), str(PEFT_BASE)],
        setup=lambda w: peft_file(w, "int"),
    )
    add(
        "L",
        "unclear: resume a LoRA run after a lora.* change",
        lambda w: jx("train", "--config", w / "lora_run" / "config.yaml", "--run-dir", w / "lora_run", "lora.rank=8"),
        setup=lora_run,
        check=None,
    )
    add(
        "L",
        "to-hf --peft on a full disk",
        lambda w: jx("convert", "to-hf", w / "lora_run", w / "disk_peft" / "adapter", "--peft"),
        setup=lambda w: lora_run(w) and tmpfs(w / "disk_peft", 8),
    )
    return c


# ------------------------------------------------------------------------------------------------ judge


def judge(case: Case, w: Path, r: subprocess.CompletedProcess | None) -> tuple[str, str]:
    if r is None:
        return "hang", f"no end within {case.timeout:g} s"
    err = r.stderr
    errors = [x for x in err.splitlines() if x.startswith("error:")]
    if "Traceback (most recent call last)" in err or r.returncode not in (0, 2):
        last = next((x for x in reversed(err.splitlines()) if x.strip()), "")
        return "traceback", f"exit {r.returncode}: {last[:140]}"
    if r.returncode == 2:
        if len(errors) == 1:
            return "clean error", errors[0][:160]
        return "traceback", f"exit 2 with {len(errors)} error lines: {err.strip()[-140:]}"
    if case.expect == "error":
        return "silent wrong", "exit 0 where an error was due"
    try:
        ok = case.check(w, r) if case.check else True
    except Exception as e:  # the check could not read the result
        return "silent wrong", f"check failed: {type(e).__name__}: {e}"
    return ("correct", "") if ok else ("silent wrong", "the result failed the check")


def run_case(case: Case, w: Path) -> tuple[str, str, float]:
    t0 = time.monotonic()
    if case.runner is not None:
        verdict, note = case.runner(w)
        return verdict, note, time.monotonic() - t0
    if case.setup is not None:
        try:
            if case.setup(w) is False:
                return "not run", "setup impossible here (a mount?)", 0.0
        except Exception as e:
            return "not run", f"setup failed: {type(e).__name__}: {e}", 0.0
    argv = case.argv(w)
    p = subprocess.Popen(
        argv, env=ENV, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = p.communicate(timeout=case.timeout)
        r = subprocess.CompletedProcess(argv, p.returncode, out, err)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        r = None
    verdict, note = judge(case, w, r)
    if case.name.startswith("full disk") and r is not None and r.returncode == 2:
        disk = Path(argv[argv.index("--out") + 1]).parent if "--out" in argv else Path(argv[-1]).parent
        left = [p.name for p in disk.iterdir()] if disk.is_dir() else []
        if left:
            verdict, note = "silent wrong", f"left behind: {left}"
        elif mount(["-o", "remount,size=65536k", str(disk)]):
            again = sh(argv, timeout=case.timeout)
            note += f"; rerun after freeing space: exit {again.returncode}"
            if again.returncode != 0:
                verdict = "silent wrong"
    return verdict, note, time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="run the cases whose group or name holds this text")
    ap.add_argument("--jobs", type=int, default=2, help="cases run at once (default 2)")
    ap.add_argument("--keep", help="the work folder (kept); default a temporary one, removed")
    args = ap.parse_args()
    w = Path(args.keep or tempfile.mkdtemp(prefix="redteam-"))
    w.mkdir(parents=True, exist_ok=True)
    chosen = [
        c for c in cases() if not args.only or args.only in (c.group, c.name) or args.only.lower() in c.name.lower()
    ]
    print(f"setting up in {w} ...", flush=True)
    for old in w.iterdir():  # a reused --keep folder: only the shared setup survives, every case starts clean
        if old.name not in SETUP:
            shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()
    setup(w)
    ENV["HF_HUB_CACHE"] = str(w / "hub")  # the Hub-cache cases' cache (nothing is downloaded: HF_HUB_OFFLINE)
    results: dict[int, tuple] = {}

    def one(k: int) -> None:
        case = chosen[k]
        verdict, note, seconds = run_case(case, w)
        results[k] = (case.group, case.name, verdict, seconds, note)
        print(f"{case.group} | {case.name} | {verdict} | {seconds:.1f}s | {note}", flush=True)

    try:
        alone = [k for k, c in enumerate(chosen) if c.runner is not None]  # multi-process runs: one at a time
        with ThreadPoolExecutor(args.jobs) as pool:
            list(pool.map(one, [k for k in range(len(chosen)) if k not in alone]))
        for k in alone:
            one(k)
    finally:
        for m in reversed(MOUNTED):
            subprocess.run(["umount", "-l", m], capture_output=True)
        if not args.keep:
            shutil.rmtree(w, ignore_errors=True)
    rows = [results[k] for k in sorted(results)]
    print("\n| group | case | verdict | seconds | note |\n| --- | --- | --- | --- | --- |")
    for g, name, verdict, seconds, note in rows:
        print(f"| {g} | {name} | {verdict} | {seconds:.1f} | {note.replace('|', '/')} |")
    counts = {
        v: sum(r[2] == v for r in rows)
        for v in ("clean error", "correct", "silent wrong", "hang", "traceback", "not run")
    }
    print("\n" + ", ".join(f"{n} {v}" for v, n in counts.items()))
    return 1 if counts["silent wrong"] or counts["hang"] or counts["traceback"] else 0


if __name__ == "__main__":
    sys.exit(main())
