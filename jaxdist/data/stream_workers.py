"""A streamed source's documents -> token ids, in order, chunk by chunk: in the reader's thread, or in
grain worker processes (`IterDataset.mp_prefetch`) when the source asks for `workers: N` > 1.

The documents of files[first:] are cut into chunks (a chunk never crosses a file; it closes at CHUNK_CHARS
characters or the file's end) and chunk k is encoded by worker k mod N: grain gives worker w the slice
k = w, w+N, ... (`set_slice`) and interleaves the workers' outputs round-robin, so the chunks come back in
input order whatever N is, and the packing into windows (stream.Streamed, in the reader) sees the same
token sequence as with one worker. Each worker reads every document (cheap) to agree on the chunk
boundaries, and encodes only its own chunks (the cost).

An element is (k, file, ids, skipped, error): `skipped` names the documents of chunk k that are not UTF-8
(so each is counted once, by the worker that owns the chunk); `error` is the one-line message of input that
stops the stream (a line that is not JSON, an unreadable file), carried as text with the documents before
the bad line, so it arrives as the same `JaxdistError` line after every window before it.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator

import grain
import numpy as np
from absl import flags

from jaxdist.data import tokenizer as tokenizer_mod
from jaxdist.data.documents import documents
from jaxdist.errors import JaxdistError

CHUNK_CHARS = 1 << 18  # text per chunk: small enough that the first windows do not wait on a large encode

Chunk = tuple[int, int, np.ndarray, list[str], str]


def texts(files: list[str], first: int, fmt: str, field: str, chars: int) -> Iterator[tuple[int, int, list, list, str]]:
    """(k, file, texts, skipped, error) per chunk of files[first:], k counted from 0. Where the input turns
    bad, the last chunk holds the documents before the bad line and `error` its one-line message."""
    k = 0
    for f in range(first, len(files)):
        batch: list[str] = []
        skipped: list[str] = []
        size = 0
        try:
            for text, _ in documents([files[f]], fmt, field, skipped):
                if text:
                    batch.append(text)
                    size += len(text)
                if size >= chars:
                    yield k, f, batch, skipped, ""
                    k, batch, skipped, size = k + 1, [], [], 0
        except JaxdistError as e:
            yield k, f, batch, skipped, str(e)
            return
        if batch or skipped:
            yield k, f, batch, skipped, ""
            k += 1


def encode(tok, batch: list[str]) -> np.ndarray:
    ids = tok.encode_documents(batch) if batch else []
    return np.concatenate(ids) if ids else np.zeros(0, np.int64)


class Chunks(grain.IterDataset):
    """The encoded chunks of files[first:]; grain slices it across its worker processes."""

    def __init__(self, files: list[str], first: int, fmt: str, field: str, tokenizer_path: str, chars: int):
        super().__init__()
        self.files, self.first, self.fmt, self.field = files, first, fmt, field
        self.tokenizer_path, self.chars = tokenizer_path, chars
        self.start, self.step = 0, 1  # this worker's chunks: k = start, start + step, ...

    def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:  # grain's SupportsInPlaceSlicing
        if sequential_slice:
            raise ValueError("a streamed source's chunks are sliced round-robin, never sequentially")
        self.start, self.step = sl.start or 0, sl.step or 1

    def __iter__(self) -> grain.DatasetIterator:
        return _ChunkIterator(self)

    def __str__(self) -> str:
        return f"Chunks({len(self.files)} files from {self.first}, k = {self.start} mod {self.step})"


class _ChunkIterator(grain.DatasetIterator):
    def __init__(self, ds: Chunks):
        super().__init__()
        self.ds, self.next = ds, 0  # the first chunk this iterator may still yield
        self.tok = tokenizer_mod.load(ds.tokenizer_path)
        self.gen = self._chunks()

    def _chunks(self) -> Generator[tuple, None, None]:
        ds = self.ds
        for k, f, batch, skipped, error in texts(ds.files, ds.first, ds.fmt, ds.field, ds.chars):
            if k >= self.next and k % ds.step == ds.start:
                self.next = k + 1
                yield k, f, encode(self.tok, batch).astype(np.int32).tobytes(), skipped, error
            elif error:  # every worker meets it in chunk k: the owner of k says it, in its turn
                return

    def __next__(self) -> tuple:  # ids as int32 bytes: grain would put an array in shared memory, and a
        # closed pipeline's buffered blocks are then left for the resource tracker
        return next(self.gen)

    def get_state(self) -> dict:
        return {"next": self.next}

    def set_state(self, state: dict) -> None:
        self.gen.close()
        self.next = int(state["next"])
        self.gen = self._chunks()


def encoded(
    files: list[str], first: int, fmt: str, field: str, tokenizer_path: str, workers: int, chars: int = 0
) -> Iterator[Chunk]:
    """The chunks of files[first:] in order, encoded in this thread (workers <= 1) or in `workers` grain
    worker processes; closing the generator stops the workers."""
    chars = chars or CHUNK_CHARS
    ds = Chunks(files, first, fmt, field, tokenizer_path, chars)
    if workers <= 1:
        tok = tokenizer_mod.load(tokenizer_path)
        for k, f, batch, skipped, error in texts(files, first, fmt, field, chars):
            yield k, f, encode(tok, batch), skipped, error
        return
    if not flags.FLAGS.is_parsed():  # grain's worker start reads an absl flag; a library has no argv to parse
        flags.FLAGS.mark_as_parsed()
    it = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers, per_worker_buffer_size=2)).__iter__()
    try:
        for expect, (k, f, ids, skipped, error) in enumerate(it):
            if k != expect:  # grain's round-robin broke the input order: never pack out of order
                raise RuntimeError(f"streamed chunk {k} arrived where chunk {expect} was due")
            yield k, f, np.frombuffer(ids, np.int32).astype(np.int64), skipped, error
            if error:
                return
    finally:
        it.close()
