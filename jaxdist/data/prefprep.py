"""`python -m jaxdist.data prepare --preference`: JSONL preference pairs -> pair records + loss-mask shards.

    python -m jaxdist.data prepare --preference --tokenizer HF_DIR --seq-len 512 --out data/prefs pairs.jsonl

Each JSONL line is `{"prompt": ..., "chosen": ..., "rejected": ...}` in one of TRL's two preference
formats: plain strings (the completions get the tokenizer's EOS text appended when they lack it, as TRL
does), or conversations (`prompt` a list of messages, `chosen` / `rejected` lists of assistant messages)
rendered with the tokenizer folder's chat template (or `--chat-template`), as transformers'
`apply_chat_template` would. Tokenization follows TRL's `DPOTrainer`: the prompt alone, then prompt +
completion; the completion starts where the two token lists diverge (so a token merged across the
boundary belongs to the completion). Only completion tokens are trained on (the loss mask).

The record: one pair = `2 x (seq_len + 1)` tokens, the chosen row then the rejected row, each `prompt +
completion` right-padded with the boundary token (never trained on) to `seq_len + 1` tokens (the model
reads `seq_len` inputs, predicts `seq_len` targets). The trainer reads one record per batch row and runs
both halves in one forward.

The window rule: a pair whose prompt + chosen or prompt + rejected exceeds `seq_len + 1` tokens is
never cut (a cut completion would be a different pair): it is skipped and counted as `too_long`, or
stops the run under `--on-error stop`. So are lines that are not JSON, lack a field, mix the two formats,
have an empty completion (`empty`), or that the template refuses, as in `prepare --chat`: the log names
the first few by file:line, `skipped.txt` lists every one, the manifest counts them by kind.

Output: `train/NNNNNN.bin` + `.mask`, the same for `val/` (held out by a hash of the line, as every
`prepare`), `chat_template.jinja` for conversational data, and `manifest.json` with a `preference`
section (seq_len, record length, pad id, counts).
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from jaxdist.data import chat
from jaxdist.data import tokenizer as tokenizer_mod
from jaxdist.data.jsonl_lines import encode_lines, parse_line
from jaxdist.errors import JaxdistError

FIELDS = ("prompt", "chosen", "rejected")
PAIRED = (
    "dpo",
    "simpo",
    "orpo",
)  # objective.method values that train on these records (jaxdist/objectives/registry.py agrees)


def paired(cfg) -> bool:
    """Whether `cfg`'s objective reads preference pairs (a batch row = one pair record)."""
    name = cfg.objective.method
    return name in PAIRED


def record_length(seq_len: int) -> int:
    """Tokens of one pair record: a chosen and a rejected row of seq_len + 1 each."""
    return 2 * (seq_len + 1)


class PairWriter:
    """Whole pair records into `folder/NNNNNN.bin` + `.mask` shards (no record straddles two shards)."""

    def __init__(self, folder: Path, dtype: str, record: int, shard_tokens: int):
        self.folder, self.dtype, self.record = folder, dtype, record
        self.per_shard = max(1, shard_tokens // record)
        self.files: list[str] = []
        self.mask_files: list[str] = []
        self.documents = self.tokens = self.trained = self.padding = 0
        self._fh = None
        self._in_shard = 0

    def add(self, ids: np.ndarray, mask: np.ndarray, padding: int) -> None:
        if self._fh is None or self._in_shard == self.per_shard:
            self._close()
            self.folder.mkdir(parents=True, exist_ok=True)
            name = f"{len(self.files):06d}"
            self.files.append(f"{self.folder.name}/{name}.bin")
            self.mask_files.append(f"{self.folder.name}/{name}.mask")
            self._fh = (open(self.folder / f"{name}.bin", "wb"), open(self.folder / f"{name}.mask", "wb"))  # noqa: SIM115
            self._in_shard = 0
        self._fh[0].write(np.asarray(ids, self.dtype).tobytes())
        self._fh[1].write(np.asarray(mask, np.uint8).tobytes())
        self._in_shard += 1
        self.documents += 1
        self.tokens += len(ids)
        self.trained += int(mask.sum())
        self.padding += padding

    def _close(self) -> None:
        if self._fh is not None:
            for fh in self._fh:
                fh.close()
        self._fh = None

    def finish(self) -> dict:
        self._close()
        return {
            "files": self.files,
            "mask_files": self.mask_files,
            "tokens": self.tokens,
            "documents": self.documents,  # pairs
            "trained_tokens": self.trained,
            "padding_tokens": self.padding,
        }


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _messages(value, field: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise chat.BadConversation("malformed", f'"{field}" is not a non-empty list of messages')
    return value


def tokenize_pair(ct: chat.ChatTokenizer, record) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, chosen completion ids, rejected completion ids), as TRL's DPOTrainer tokenizes a pair."""
    if not isinstance(record, dict) or any(f not in record for f in FIELDS):
        missing = [f for f in FIELDS if not isinstance(record, dict) or f not in record]
        raise chat.BadConversation("malformed", f"no {', '.join(repr(f) for f in missing)} field")
    prompt, chosen, rejected = (record[f] for f in FIELDS)
    if all(isinstance(v, str) for v in (prompt, chosen, rejected)):
        eos = ct.variables.get("eos_token", "")
        encode = lambda text: ct.parser.encode(text).ids
        if not chosen.strip() or not rejected.strip():
            raise chat.BadConversation("empty", "an empty completion (chosen or rejected)")
        chosen, rejected = (c if not eos or c.endswith(eos) else c + eos for c in (chosen, rejected))
        p, pc, pr = encode(prompt), encode(prompt + chosen), encode(prompt + rejected)
    elif all(isinstance(v, list) for v in (prompt, chosen, rejected)):
        if not ct.text:
            raise chat.BadConversation(
                "template", "conversational pair but the tokenizer has no chat template; pass --chat-template FILE"
            )
        tools = record.get("tools")
        prompt_m = chat.check_messages(
            {"messages": [*_messages(prompt, "prompt"), {"role": "assistant", "content": ""}]}
        )[0][:-1]
        sides = []
        for field, value in (("chosen", chosen), ("rejected", rejected)):
            msgs = chat.check_messages({"messages": prompt_m + _messages(value, field)})[0]
            if any(
                m["role"] == "assistant" and not m.get("content") and not m.get("tool_calls")
                for m in msgs[len(prompt_m) :]
            ):
                raise chat.BadConversation("empty", f'an empty "{field}" assistant message')
            sides.append(msgs)
        render = lambda msgs, gen=False: (
            ct.parser.encode(chat.render(ct, msgs, tools, gen)[0], add_special_tokens=False).ids
        )
        p, pc, pr = render(prompt_m, True), render(sides[0]), render(sides[1])
    else:
        raise chat.BadConversation(
            "malformed", "prompt, chosen and rejected must all be strings, or all lists of messages (TRL's two formats)"
        )
    n = min(_common_prefix(p, pc), _common_prefix(p, pr))
    if n == 0:
        raise chat.BadConversation("empty", "the prompt renders to no tokens (nothing to condition on)")
    if len(pc) == n or len(pr) == n:
        raise chat.BadConversation("empty", "a completion renders to no tokens")
    return p[:n], pc[n:], pr[n:]


def encode_pair(ct: chat.ChatTokenizer, text: str, seq_len: int, pad: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(record ids, record mask, padding tokens) of one line, or BadConversation (its kind and reason)."""
    record = parse_line(text)
    prompt, chosen, rejected = tokenize_pair(ct, record)
    width = seq_len + 1
    ids, mask, padding = [], [], 0
    for name, completion in (("chosen", chosen), ("rejected", rejected)):
        n = len(prompt) + len(completion)
        if n > width:
            raise chat.BadConversation(
                "too_long",
                f"prompt + {name} is {n} tokens, more than a row of --seq-len {seq_len} + 1 (pairs are never cut)",
            )
        ids += [*prompt, *completion] + [pad] * (width - n)
        mask += [0] * len(prompt) + [1] * len(completion) + [0] * (width - n)
        padding += width - n
    return np.asarray(ids, np.int64), np.asarray(mask, np.uint8), padding


def load_tokenizer(path: str, template_file: str | None) -> chat.ChatTokenizer:
    """The tokenizer with its chat template; without one (plain-string pairs need none) `text` is empty
    and a conversational line is refused by `tokenize_pair`."""
    try:
        return chat.load(path, template_file)
    except JaxdistError:
        if template_file:
            raise
    tok = tokenizer_mod.load(path)
    parser = Tokenizer.from_file(str(tok.file))
    variables = {n: v for n in chat.SPECIAL_NAMES if (v := tokenizer_mod._token_text(tok.config.get(n))) is not None}
    return chat.ChatTokenizer(tok, parser, None, "", "", variables)


def encode_preference(args, files: list[str], total_bytes: int, dtype: str, tmp: Path, log, held_out) -> dict:
    """Tokenize, check and write every pair into `tmp`; returns the manifest."""
    ct = load_tokenizer(args.tokenizer, args.chat_template)
    pad = chat.boundary_id(ct) if ct.text else ct.tok.eos_id
    on_error, S = args.on_error or "skip", args.seq_len  # encode_lines reads the same default
    if ct.text:
        (tmp / "chat_template.jinja").write_text(ct.text, encoding="utf-8")
    writers = {n: PairWriter(tmp / n, dtype, record_length(S), args.shard_tokens) for n in ("train", "val")}
    t0 = time.perf_counter()
    lines, skips = encode_lines(
        files,
        lambda text: encode_pair(ct, text, S, pad),
        lambda text: writers["val" if held_out(text.strip(), args.val_fraction) else "train"],
        args,
        tmp,
        log,
        "pairs",
    )
    splits = {name: w.finish() for name, w in writers.items()}
    log(
        f"{splits['train']['documents']:,} train / {splits['val']['documents']:,} held-out pairs in rows of "
        f"{S} + 1 tokens in {time.perf_counter() - t0:.1f}s; dtype {dtype} -> {args.out}"
    )
    section = {"seq_len": S, "record": record_length(S), "pad_id": pad, "on_error": on_error}
    if ct.text:
        section |= {"template": "chat_template.jinja", "template_sha256": hashlib.sha256(ct.text.encode()).hexdigest()}
    return {
        "format": "jaxdist-tokens/1",
        "dtype": dtype,
        "vocab_size": ct.tok.vocab_size,
        "eos_id": pad,
        "prefix_ids": [],
        "tokenizer": {"file": "tokenizer.json", "sha256": ct.tok.sha256},
        "splits": splits,
        "val_fraction": args.val_fraction,
        "input": {"files": len(files), "bytes": total_bytes, "lines": lines},
        "preference": section | {"skipped": skips},
    }
