"""`python -m jaxdist.data prepare --chat`: JSONL conversations -> packed token windows + loss-mask shards.

    python -m jaxdist.data prepare --chat --tokenizer HF_DIR --seq-len 1024 --out data/chat chats.jsonl

Each JSONL line is `{"messages": [{"role": ..., "content": ...}, ...]}` (optionally `"tools": [...]`),
rendered with the tokenizer folder's chat template and encoded as transformers' `apply_chat_template`
would (jaxdist/data/chat.py). The loss mask keeps the assistant's tokens (`--loss-on assistant`, the
default) or every token (`--loss-on all`).

Packing: the stream is cut into windows of `--seq-len` tokens (the model's `model.seq_len`; training
checks it matches), and a conversation, followed by one boundary token (the manifest's `eos_id`, which
`data.document_mask` cuts attention at), is placed whole inside one window: when it does not fit in what
is left of the current one, the rest is filled with boundary tokens (never trained on) and it starts the
next. So no conversation is ever split from its prompt, and none is truncated.

Bad lines (invalid JSON or JSON nested too deep, bytes that are not UTF-8 or a lone surrogate, no messages,
an unknown role, a template that refuses the conversation or runs past its limits, one whose tokens do not
fit a window, or whose rendering is too many bytes to, or a line over MAX_LINE_BYTES, one containing the
boundary token) are, under `--on-error skip` (the
default), left out and counted: the log names the first few by file:line, `skipped.txt` in the output
lists every one, and the manifest counts them by kind. `--on-error stop` stops at the first with its
file:line and writes nothing.

Output (beside the usual tokenizer files): `train/NNNNNN.bin` tokens + `train/NNNNNN.mask` (uint8, 1 =
trained on), the same for `val/`, `chat_template.jinja` (the template used), and `manifest.json` with a
`chat` section (template sha256, rule, seq_len, boundary id, counts). Each shard holds whole windows plus
the first token of the next (a window's last target), so shards concatenate to the one stream.
"""

from __future__ import annotations

import collections
import hashlib
import json
import time
from pathlib import Path

import numpy as np

from jaxdist.data import chat
from jaxdist.data.documents import file_format
from jaxdist.errors import JaxdistError

REPORT_LINES = 10  # skipped lines named in the log (all of them are in skipped.txt)
MAX_JSON_DEPTH = 100  # a conversation nests ~5 levels, a tool's JSON schema a few more
MAX_LINE_BYTES = (
    64 << 20
)  # a JSONL line longer than this is refused unread (64 MiB; a render's limit is 16 Mi characters)


def check_args(args, files: list[str]) -> None:
    """Flag combinations, before anything is read or written (`--chat`, and `--preference`, which shares
    its flags but --loss-on)."""
    chat_flags = ("seq_len", "loss_on", "chat_template")
    kinds = [
        k
        for k, on in (
            ("--chat", args.chat),
            ("--preference", getattr(args, "preference", False)),
            ("--prompts", getattr(args, "prompts", False)),
        )
        if on
    ]
    if len(kinds) > 1:
        raise JaxdistError(f"{' and '.join(kinds)} exclude each other; give one")
    kind = kinds[0] if kinds else None
    if kind is None:
        given = [f"--{f.replace('_', '-')}" for f in chat_flags if getattr(args, f) is not None]
        if given:
            raise JaxdistError(
                f"{', '.join(given)} only apply to chat, preference or prompt data; add --chat, --preference or --prompts"
            )
        return
    if kind != "--chat" and args.loss_on is not None:
        why = "only completion tokens are trained on" if kind == "--preference" else "prompts are never trained on"
        raise JaxdistError(f"--loss-on does not apply to {kind} ({why}); drop it")
    what = {"--chat": "conversations", "--preference": "preference pairs", "--prompts": "prompts"}[kind]
    if getattr(args, "field", None) is not None:  # was ignored without a word
        raise JaxdistError(f"--field does not apply to {kind}: each JSONL line is read whole as {what}; drop --field")
    if not args.tokenizer:
        raise JaxdistError(f"{kind} needs the model's tokenizer folder (--tokenizer HF_DIR), not --train-tokenizer")
    if not args.inputs:
        raise JaxdistError(f"{kind} needs JSONL input files of {what}")
    if args.seq_len is None or args.seq_len < 2:
        raise JaxdistError(f"{kind} needs --seq-len N (the model.seq_len you will train with, >= 2)")
    not_jsonl = [f for f in files if file_format(f, args.format) != "jsonl"]
    if not_jsonl:
        raise JaxdistError(f"{kind} reads JSONL {what}; {not_jsonl[0]} is not .jsonl (or pass --format jsonl)")


class Packer:
    """Writes whole conversations into windows of `seq_len` tokens: `folder/NNNNNN.bin` + `.mask` shards."""

    def __init__(self, folder: Path, dtype: str, seq_len: int, boundary: int, boundary_mask: int, shard_tokens: int):
        self.folder, self.dtype, self.S, self.boundary, self.boundary_mask = (
            folder,
            dtype,
            seq_len,
            boundary,
            boundary_mask,
        )
        self.windows_per_shard = max(1, shard_tokens // seq_len)
        self.ids, self.mask = [], []  # the window being filled
        self.files: list[str] = []
        self.mask_files: list[str] = []
        self.documents = self.tokens = self.trained = self.padding = 0
        self._open_windows = 0  # whole windows in the open shard
        self._fh = None

    def add(self, ids: np.ndarray, mask: np.ndarray) -> None:
        if len(self.ids) + len(ids) + 1 > self.S:
            self._fill()
        self.ids += [*ids.tolist(), self.boundary]
        self.mask += [*mask.tolist(), self.boundary_mask]
        self.documents += 1
        if len(self.ids) == self.S:
            self._flush()

    def _fill(self) -> None:
        """Close the current window with boundary tokens that are never trained on."""
        n = self.S - len(self.ids)
        self.ids += [self.boundary] * n
        self.mask += [0] * n
        self.padding += n
        self._flush()

    def _flush(self) -> None:
        """Write the full current window; a shard that is full closes with this window's first token."""
        if self._fh is not None and self._open_windows == self.windows_per_shard:
            self._write(self.ids[:1], self.mask[:1])
            self._close()
        if self._fh is None:
            self._open()
        self._write(self.ids, self.mask)
        self._open_windows += 1
        self.ids, self.mask = [], []

    def _open(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        name = f"{len(self.files):06d}"
        self.files.append(f"{self.folder.name}/{name}.bin")
        self.mask_files.append(f"{self.folder.name}/{name}.mask")
        self._fh = (open(self.folder / f"{name}.bin", "wb"), open(self.folder / f"{name}.mask", "wb"))  # noqa: SIM115
        self._open_windows = 0

    def _write(self, ids: list[int], mask: list[int]) -> None:
        if self._fh is None:
            raise RuntimeError("a window is written after _open")
        self._fh[0].write(np.asarray(ids, self.dtype).tobytes())
        self._fh[1].write(np.asarray(mask, np.uint8).tobytes())
        self.tokens += len(ids)
        self.trained += int(sum(mask))

    def _close(self) -> None:
        for fh in self._fh or ():
            fh.close()
        self._fh = None

    def finish(self) -> dict:
        if self.ids:
            self._fill()
        if self._fh is not None:  # the last window's last target: one more boundary token, not trained on
            self._write([self.boundary], [0])
            self._close()
        return {
            "files": self.files,
            "mask_files": self.mask_files,
            "tokens": self.tokens,
            "documents": self.documents,
            "trained_tokens": self.trained,
            "padding_tokens": self.padding,
        }


def conversations(files: list[str]):
    """(file, line number, bytes) of every non-blank line; a line over MAX_LINE_BYTES is never held whole:
    its bytes are None (and the line is refused)."""
    for f in files:
        try:
            with open(f, "rb") as fh:
                lineno = 0
                while raw := fh.readline(MAX_LINE_BYTES + 1):
                    lineno += 1
                    if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                        while (rest := fh.readline(1 << 20)) and not rest.endswith(b"\n"):
                            pass  # the rest of an oversized line, read and dropped a MiB at a time
                        yield f, lineno, None
                    elif raw.strip():
                        yield f, lineno, raw
        except OSError as e:
            raise JaxdistError(f"cannot read input {f} ({e.strerror}); fix its permissions or the input list")


def decode_line(raw: bytes | None) -> str:
    """A line's text, or BadConversation: over the size limit, or not UTF-8 (never replaced by U+FFFD)."""
    if raw is None:
        raise chat.BadConversation("too_long", f"the line is over {MAX_LINE_BYTES:,} bytes; it was not read")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise chat.BadConversation(
            "bad_utf8", f"byte {raw[e.start]:#04x} at offset {e.start} is not UTF-8 (convert the file to UTF-8)"
        ) from None


def lone_surrogate(record) -> str | None:
    """The first string of `record` holding a lone UTF-16 surrogate (JSON's "\\ud800"), which no tokenizer
    can encode; None if there is none."""
    stack = [record]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError as e:
                return f"\\u{ord(x[e.start]):04x}"
        elif isinstance(x, dict):
            stack += [*x.keys(), *x.values()]
        elif isinstance(x, list):
            stack += x
    return None


def parse_line(text: str):
    """A JSONL line's record, or BadConversation: invalid JSON, nested too deep, or holding a lone surrogate."""
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH and (depth := json_depth(text)) > MAX_JSON_DEPTH:
        raise chat.BadConversation("bad_json", f"its JSON nests {depth:,} levels deep (at most {MAX_JSON_DEPTH})")
    try:
        record = json.loads(text)
    except RecursionError:
        raise chat.BadConversation("bad_json", f"its JSON nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:
        raise chat.BadConversation("bad_json", f"not valid JSON ({getattr(e, 'msg', e)})") from None
    if "\\u" in text and (where := lone_surrogate(record)) is not None:
        raise chat.BadConversation("bad_utf8", f"it holds a lone surrogate {where}, which is not text")
    return record


def json_depth(text: str) -> int:
    """The deepest nesting of [ and { outside JSON strings (parsing 100,000 levels overflows the parser's
    recursion, or, under a raised recursion limit, the C stack)."""
    depth = deepest = 0
    in_string = escaped = False
    for c in text:
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth -= 1
    return deepest


def encode_line(ct: chat.ChatTokenizer, text: str, loss_on: str, seq_len: int, boundary: int):
    """(ids, mask) of one line, or BadConversation (its kind and reason)."""
    record = parse_line(text)
    ids, mask = chat.encode(ct, record, loss_on, max_tokens=seq_len - 1)
    if boundary in ids:
        raise chat.BadConversation(
            "boundary", f"it contains the conversation boundary token {ct.parser.id_to_token(boundary)!r}"
        )
    if len(ids) + 1 > seq_len:
        raise chat.BadConversation(
            "too_long", f"{len(ids)} tokens + 1 boundary do not fit a window of --seq-len {seq_len}"
        )
    return ids, mask


def encode_lines(files: list[str], encode, sink, args, tmp: Path, log, noun: str) -> tuple[int, dict[str, int]]:
    """The per-line loop of `prepare --chat` and `--preference`: each JSONL line decoded, `encode(text)`d and
    added to `sink(text)` (its split's writer); a bad line stops the run (`--on-error stop`) or is skipped,
    counted by kind and listed in `skipped.txt`. Returns the lines read and the skips by kind."""
    on_error = args.on_error or "skip"
    skipped: list[str] = []
    kinds: collections.Counter = collections.Counter()
    lines = 0
    for f, lineno, raw in conversations(files):
        lines += 1
        try:
            text = decode_line(raw)  # not UTF-8, or over the size limit: a bad line
            encoded = encode(text)
        except chat.BadConversation as e:
            if on_error == "stop":
                raise JaxdistError(f"{f}:{lineno}: {e.reason}; fix the line, or pass --on-error skip") from None
            kinds[e.kind] += 1
            skipped.append(f"{f}:{lineno}: {e.reason}")
            continue
        sink(text).add(*encoded)
    if skipped:
        (tmp / "skipped.txt").write_text("".join(s + "\n" for s in skipped), encoding="utf-8")
        shown = "\n".join(f"  {s}" for s in skipped[:REPORT_LINES])
        more = f"\n  ... {len(skipped) - REPORT_LINES} more" if len(skipped) > REPORT_LINES else ""
        log(
            f"skipped {len(skipped)} of {lines} {noun} ({', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))}); "
            f"every one is listed in {args.out}/skipped.txt:\n{shown}{more}"
        )
    return lines, dict(sorted(kinds.items()))


def encode_chat(args, files: list[str], total_bytes: int, dtype: str, tmp: Path, log, held_out) -> dict:
    """Render, encode, check and pack every conversation into `tmp`; returns the manifest.
    `held_out(text, fraction)`: the split rule `prepare` uses for documents (a hash of the line)."""
    ct = chat.load(args.tokenizer, args.chat_template)
    boundary = chat.boundary_id(ct)
    loss_on, on_error, S = args.loss_on or "assistant", args.on_error or "skip", args.seq_len
    (tmp / "chat_template.jinja").write_text(ct.text, encoding="utf-8")
    boundary_mask = 1 if loss_on == "all" else 0
    packers = {
        name: Packer(tmp / name, dtype, S, boundary, boundary_mask, args.shard_tokens) for name in ("train", "val")
    }
    t0 = time.perf_counter()
    lines, skips = encode_lines(
        files,
        lambda text: encode_line(ct, text, loss_on, S, boundary),
        lambda text: packers["val" if held_out(text.strip(), args.val_fraction) else "train"],
        args,
        tmp,
        log,
        "conversations",
    )
    splits = {name: p.finish() for name, p in packers.items()}
    seconds = time.perf_counter() - t0
    tokens = sum(s["tokens"] for s in splits.values())
    trained = sum(s["trained_tokens"] for s in splits.values())
    padding = sum(s["padding_tokens"] for s in splits.values())
    log(
        f"{splits['train']['documents']:,} train / {splits['val']['documents']:,} held-out conversations -> {tokens:,} "
        f"tokens in windows of {S} ({trained:,} trained on, {padding:,} padding) in {seconds:.1f}s; "
        f"template {ct.source} ({rule(ct, loss_on)} rule); dtype {dtype} -> {args.out}"
    )
    return {
        "format": "jaxdist-tokens/1",
        "dtype": dtype,
        "vocab_size": ct.tok.vocab_size,
        "eos_id": boundary,
        "prefix_ids": [],
        "tokenizer": {"file": "tokenizer.json", "sha256": ct.tok.sha256},
        "splits": splits,
        "val_fraction": args.val_fraction,
        "input": {"files": len(files), "bytes": total_bytes, "lines": lines},
        "chat": {
            "template": "chat_template.jinja",
            "template_sha256": hashlib.sha256(ct.text.encode()).hexdigest(),
            "loss_on": loss_on,
            "rule": rule(ct, loss_on),
            "seq_len": S,
            "boundary_id": boundary,
            "on_error": on_error,
            "skipped": skips,
        },
    }


def rule(ct: chat.ChatTokenizer, loss_on: str) -> str:
    if loss_on == "all":
        return "all"
    return "generation" if ct.marks_generation else "prefix"
