"""The JSONL lines `prepare --chat`, `--preference` and `--prompts` read, each taken apart safely: a line
over MAX_LINE_BYTES never held whole, bytes that are not UTF-8, JSON nested too deep for the parser, a
lone surrogate; and the per-line loop that encodes each line and, on a bad one, stops with its file:line
or skips it, counted by kind and listed in `skipped.txt` (`encode_lines`)."""

from __future__ import annotations

import collections
import json
from pathlib import Path

from jaxdist.data.chat import BadConversation
from jaxdist.errors import JaxdistError

REPORT_LINES = 10  # skipped lines named in the log (all of them are in skipped.txt)
MAX_JSON_DEPTH = 100  # a conversation nests ~5 levels, a tool's JSON schema a few more
MAX_LINE_BYTES = (
    64 << 20
)  # a JSONL line longer than this is refused unread (64 MiB; a render's limit is 16 Mi characters)


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
        raise BadConversation("too_long", f"the line is over {MAX_LINE_BYTES:,} bytes; it was not read")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadConversation(
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
        raise BadConversation("bad_json", f"its JSON nests {depth:,} levels deep (at most {MAX_JSON_DEPTH})")
    try:
        record = json.loads(text)
    except RecursionError:
        raise BadConversation("bad_json", f"its JSON nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:
        raise BadConversation("bad_json", f"not valid JSON ({getattr(e, 'msg', e)})") from None
    if "\\u" in text and (where := lone_surrogate(record)) is not None:
        raise BadConversation("bad_utf8", f"it holds a lone surrogate {where}, which is not text")
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
        except BadConversation as e:
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
