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
fit a window, or whose rendering is too many bytes to, or a line over MAX_LINE_BYTES (data/jsonl_lines.py), one containing the
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

import hashlib
import time
from pathlib import Path

import numpy as np

from jaxdist.data import chat
from jaxdist.data.documents import file_format
from jaxdist.data.jsonl_lines import encode_lines, parse_line
from jaxdist.errors import JaxdistError


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
