"""The documents `prepare` and a streamed source read: a plain-text file is one document, a JSONL line or
a Parquet / Arrow row one (its text field). Bad input is a one-line error naming the file and line."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

from jaxdist.data.files import expand_path, stdlib_files
from jaxdist.errors import JaxdistError


def input_files(patterns: list[str]) -> list[str]:
    if not patterns:
        return stdlib_files()
    files: list[str] = []
    for pattern in patterns:
        files += [f for f in expand_path(pattern, what="input") if f not in files]
    return files


def file_format(path: str, forced: str) -> str:
    if forced != "auto":
        return forced
    if path.endswith((".jsonl", ".ndjson")):
        return "jsonl"
    if path.endswith(".arrow"):  # the Hugging Face datasets cache: Arrow IPC streams
        return "arrow"
    return "parquet" if path.endswith(".parquet") else "text"


def documents(files: list[str], fmt: str, field: str, skipped: list[str] | None = None) -> Iterator[tuple[str, float]]:
    """(text, input bytes it stands for) per document, in input order; empty documents are skipped.
    A document that is not UTF-8 is never read with U+FFFD in place of its bytes: it stops the command
    (`skipped` None: --on-error stop) or is left out and named in `skipped`."""
    for f in files:
        kind = file_format(f, fmt)
        try:
            if kind == "text":
                raw = Path(f).read_bytes()
                if (text := utf8(raw, f, skipped)) is not None:
                    yield text, len(raw)
            elif kind == "jsonl":
                with open(f, "rb") as fh:
                    for lineno, line in enumerate(fh, 1):
                        if line.strip() and (text := utf8(line, f"{f}:{lineno}", skipped)) is not None:
                            yield _field(json_line(text, f, lineno), field, f"{f}:{lineno}"), len(line)
            elif kind == "arrow":
                yield from arrow_documents(f, field)
            else:
                yield from parquet_documents(f, field)
        except OSError as e:
            raise JaxdistError(f"cannot read input {f} ({e.strerror}); fix its permissions or the input list")


def utf8(raw: bytes, where: str, skipped: list[str] | None) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        why = f"{where}: byte {raw[e.start]:#04x} at offset {e.start} is not UTF-8"
        if skipped is None:
            raise JaxdistError(f"{why}; convert it to UTF-8, or pass --on-error skip to leave it out") from None
        skipped.append(why)
        return None


def json_line(line: str | bytes, f: str, lineno: int):
    try:
        return json.loads(line)
    except ValueError:
        raise JaxdistError(f"{f}:{lineno} is not valid JSON; JSONL needs one JSON object per line") from None


def _field(record, field: str, where: str) -> str:
    value = record.get(field) if isinstance(record, dict) else None
    if not isinstance(value, str):
        raise JaxdistError(f"{where} has no string field {field!r}; pass --field with the name of the text field")
    return value


def parquet_documents(f: str, field: str) -> Iterator[tuple[str, float]]:
    try:
        # deferred: an optional extra, imported only where its feature is used
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise JaxdistError("reading Parquet needs pyarrow: pip install 'jaxdist[parquet]'") from None
    try:
        pf = pq.ParquetFile(f)
    except pa.ArrowException as e:
        raise JaxdistError(f"{f} is not a readable Parquet file ({str(e).splitlines()[0][:120]})") from None
    if field not in pf.schema_arrow.names:
        raise JaxdistError(f"{f} has no column {field!r} (columns: {', '.join(pf.schema_arrow.names)}); pass --field")
    per_row = os.path.getsize(f) / max(pf.metadata.num_rows, 1)
    for batch in pf.iter_batches(columns=[field]):
        for value in batch.column(0).to_pylist():
            if isinstance(value, str):
                yield value, per_row


def arrow_documents(f: str, field: str) -> Iterator[tuple[str, int]]:
    """Rows of an Arrow IPC stream or file, as the Hugging Face datasets cache stores a split
    (`~/.cache/huggingface/datasets/.../*.arrow`), read offline."""
    try:
        import pyarrow as pa  # deferred: an optional extra
    except ImportError:
        raise JaxdistError("reading Arrow files needs pyarrow: pip install 'jaxdist[parquet]'") from None
    try:
        try:
            reader = pa.ipc.open_stream(f)
        except pa.ArrowInvalid:
            reader = pa.ipc.open_file(f)
        schema = reader.schema
        batches = (
            iter(reader)
            if isinstance(reader, pa.ipc.RecordBatchStreamReader)
            else (reader.get_batch(i) for i in range(reader.num_record_batches))
        )
        if field not in schema.names:
            raise JaxdistError(f"{f} has no column {field!r} (columns: {', '.join(schema.names)}); pass --field")
        for batch in batches:
            for value in batch.column(schema.get_field_index(field)).to_pylist():
                if isinstance(value, str):
                    yield value, len(value)  # input bytes, approximately (for progress only)
    except pa.ArrowException as e:
        raise JaxdistError(f"{f} is not a readable Arrow file ({str(e).splitlines()[0][:120]})") from None
