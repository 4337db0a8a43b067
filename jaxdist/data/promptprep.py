"""`python -m jaxdist.data prepare --prompts`: JSONL prompts (and the columns a reward needs) -> prompt records.

    python -m jaxdist.data prepare --prompts --tokenizer HF_DIR --seq-len 512 --out data/prompts prompts.jsonl

Each JSONL line holds a `prompt`, in either of TRL's formats: a plain string (tokenized with the
tokenizer's own special tokens, as TRL's `GRPOTrainer` does), or a conversation (a list of messages,
rendered with the chat template and the assistant's turn opened, as `apply_chat_template(...,
add_generation_prompt=True)`). Every other field (e.g. a reference `answer`) is kept as it is and given to
the reward functions as a column, as TRL does.

The window rule: a prompt of more than `seq_len - 1` tokens leaves no room for a completion in a row of
`seq_len + 1`: it is skipped and counted as `too_long` (never cut: a cut prompt is a different question),
or stops the run under `--on-error stop`. Bad lines (not JSON, no or an empty prompt, a template that
refuses) are skipped and counted by kind as `prepare --chat` does (`skipped.txt`, the manifest).

Output: `train/prompts.jsonl` and `val/prompts.jsonl` (held out by a hash of the line, as every
`prepare`), one record a line: `{"ids": [prompt token ids], "prompt": the prompt as given, ...columns}`;
`chat_template.jinja` for conversational prompts; `manifest.json` with a `prompts` section (seq_len,
counts, the longest prompt). `read(folder, split)` returns the records.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from jaxdist.data import chat
from jaxdist.data.jsonl_lines import encode_lines, parse_line
from jaxdist.data.prefprep import _messages, load_tokenizer
from jaxdist.errors import JaxdistError

FILE = "prompts.jsonl"


def tokenize_prompt(ct: chat.ChatTokenizer, record) -> list[int]:
    """A record's prompt ids, as TRL's GRPOTrainer tokenizes its prompt (BadConversation if unusable)."""
    if not isinstance(record, dict) or "prompt" not in record:
        raise chat.BadConversation("malformed", 'no "prompt" field')
    prompt = record["prompt"]
    if isinstance(prompt, str):
        if not prompt.strip():
            raise chat.BadConversation("empty", "an empty prompt")
        ids = ct.parser.encode(prompt).ids
    elif isinstance(prompt, list):
        if not ct.text:
            raise chat.BadConversation(
                "template", "a conversational prompt but the tokenizer has no chat template; pass --chat-template FILE"
            )
        msgs = chat.check_messages({"messages": [*_messages(prompt, "prompt"), {"role": "assistant", "content": ""}]})
        text = chat.render(ct, msgs[0][:-1], record.get("tools"), True)[0]
        ids = ct.parser.encode(text, add_special_tokens=False).ids
    else:
        raise chat.BadConversation("malformed", "prompt must be a string or a list of messages (TRL's two formats)")
    if not ids:
        raise chat.BadConversation("empty", "the prompt renders to no tokens")
    return ids


class PromptWriter:
    def __init__(self, path: Path):
        self.path, self.fh, self.documents, self.tokens, self.longest = path, None, 0, 0, 0

    def add(self, record: dict) -> None:
        if self.fh is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.fh = open(self.path, "w", encoding="utf-8")  # noqa: SIM115
        self.fh.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.documents += 1
        self.tokens += len(record["ids"])
        self.longest = max(self.longest, len(record["ids"]))

    def finish(self) -> dict:
        if self.fh is not None:
            self.fh.close()
        return {
            "files": [f"{self.path.parent.name}/{FILE}"] if self.documents else [],
            "documents": self.documents,
            "tokens": self.tokens,
            "longest": self.longest,
        }


def encode_record(ct, text: str, seq_len: int) -> tuple[dict]:
    record = parse_line(text)
    ids = tokenize_prompt(ct, record)
    if len(ids) > seq_len - 1:
        raise chat.BadConversation(
            "too_long",
            f"the prompt is {len(ids)} tokens, more than --seq-len {seq_len} - 1 (a row must hold it and one new "
            "token; prompts are never cut)",
        )
    return ({"ids": ids, **record},)


def encode_prompts(args, files: list[str], total_bytes: int, dtype: str, tmp: Path, log, held_out) -> dict:
    """Tokenize, check and write every prompt record into `tmp`; returns the manifest."""
    ct = load_tokenizer(args.tokenizer, args.chat_template)
    if ct.text:
        (tmp / "chat_template.jinja").write_text(ct.text, encoding="utf-8")
    writers = {n: PromptWriter(tmp / n / FILE) for n in ("train", "val")}
    t0 = time.perf_counter()
    lines, skips = encode_lines(
        files,
        lambda text: encode_record(ct, text, args.seq_len),
        lambda text: writers["val" if held_out(text.strip(), args.val_fraction) else "train"],
        args,
        tmp,
        log,
        "prompts",
    )
    splits = {name: w.finish() for name, w in writers.items()}
    log(
        f"{splits['train']['documents']:,} train / {splits['val']['documents']:,} held-out prompts (longest "
        f"{max(s['longest'] for s in splits.values())} tokens) in {time.perf_counter() - t0:.1f}s -> {args.out}"
    )
    section = {"seq_len": args.seq_len, "on_error": args.on_error or "skip", "skipped": skips}
    if ct.text:
        section |= {"template": "chat_template.jinja", "template_sha256": hashlib.sha256(ct.text.encode()).hexdigest()}
    return {
        "format": "jaxdist-tokens/1",  # the prepared-folder format; the prompts section says what it holds
        "dtype": dtype,
        "vocab_size": ct.tok.vocab_size,
        "eos_id": ct.tok.eos_id,
        "prefix_ids": [],
        "tokenizer": {"file": "tokenizer.json", "sha256": ct.tok.sha256},
        "splits": splits,
        "val_fraction": args.val_fraction,
        "input": {"files": len(files), "bytes": total_bytes, "lines": lines},
        "prompts": section,
    }


def read(folder: str | Path, split: str = "train") -> list[dict]:
    """The prompt records of a `prepare --prompts` folder's split (one-line errors for another folder)."""
    folder = Path(folder)
    try:
        manifest = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise JaxdistError(f"{folder} has no readable manifest.json; make it with prepare --prompts") from None
    if not isinstance(manifest, dict) or "prompts" not in manifest:
        raise JaxdistError(
            f"{folder} holds no prompts (no prompts section in its manifest); make it with prepare --prompts"
        )
    path = folder / split / FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
