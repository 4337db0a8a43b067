"""Streamed sources: raw documents (JSONL, Parquet, Arrow, text) tokenized while training runs, with no
`prepare` step (a `data.sources` entry with `stream: true`).

The windows are `prepare`'s: each document encoded `[BOS] tokens EOS` by `data.tokenizer`'s rule, the
documents concatenated in input order (files sorted, then line / row order) and cut into windows of
model.seq_len + 1 tokens that share one token (`loader.Windows` over `prepare --val-fraction 0`'s
train/ shard). The tail shorter than a window at the end of a pass is dropped and the next pass
(epoch) starts again from the first file, in the same order: a streamed source is not shuffled
(shuffle the documents when writing the files). Everything is held out of evaluation's reach: a streamed
source has no val/ split.

Window i is a function of i alone, so the mixture's rule holds unchanged: the same global batch at step s
on any mesh or process count. The price of that rule: every process tokenizes the whole stream up to the
windows its rows need (it cannot read only a share of the files, because which source window lands in
which process's rows is decided by the mixture's interleaving, not by the files). The opt-in
`split_files` trades that rule for reading less: process p of P streams only files p, p+P, ...
(loader.streamed_source) and its rows take those windows in turn (mixture.Mixture.local_read). With the source's
`workers: N` > 1, tokenizing runs in N grain worker processes (jaxdist/data/stream_workers.py), chunk k
in worker k mod N, the chunks coming back in input order: the windows are the same for any N, and the
packing into windows stays here, in the reader.

Resume: the loader's state records, per streamed source, where the file holding its next window starts
(window index, file, the tokens carried over into it) and the pass length once known, so a resumed run
re-reads at most that one file; the windows after a resume are those of the uninterrupted run.

Bad input while streaming: a document that is not UTF-8 is skipped and counted (`skipped`, in the
state, the run's closing line and metrics.jsonl's summary); an unreadable file or a line that is not JSON
stops with one line naming the file and line (`jaxdist.errors.JaxdistError`); in a run, the steps done
before it are saved first (training/stepping.py).
"""

from __future__ import annotations

import atexit
import collections
import threading
import weakref
from collections.abc import Iterator

import numpy as np

from jaxdist.data import stream_workers
from jaxdist.data import tokenizer as tokenizer_mod
from jaxdist.errors import JaxdistError

CACHE_TOKENS = 1 << 22  # windows kept for out-of-order reads by grain's threads (~16 MB of int32)


_OPEN: weakref.WeakSet = weakref.WeakSet()  # sources with worker processes, stopped before grain's exit hooks run


@atexit.register
def _close_all() -> None:
    for source in list(_OPEN):
        source.close()


class Streamed:
    """Window i (any i >= 0; the stream repeats) of documents read from `files`, tokenized on demand.
    Safe to call from grain's reader threads."""

    def __init__(self, files: list[str], fmt: str, field: str, tokenizer_path: str, length: int, workers: int = 1):
        self.files, self.fmt, self.field, self.length, self.workers = files, fmt, field, length, workers
        self.tokenizer_path, self.label = tokenizer_path, f"{len(files)} streamed file(s)"
        self.tok = tokenizer_mod.load(tokenizer_path)
        self.lock = threading.Lock()
        self.cache: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()
        self.keep = max(256, CACHE_TOKENS // length)
        self.bookmarks: dict[int, tuple[int, list[int]]] = {0: (0, [])}  # file -> (first window, carried tokens)
        self.epoch: int | None = None  # windows in one pass, once a pass was read to its end
        self.skipped: list[str] = []
        self.gen: Iterator[tuple[int, np.ndarray]] | None = None
        self.next = 0  # index of the window self.gen yields next
        self.process: tuple[int, int] = (
            0,
            1,
        )  # (index, count) whose share of the files this is (split_files; loader.py)
        if workers > 1:
            _OPEN.add(self)

    def __len__(self) -> int:  # unknown until read: grain is never asked (the mixture indexes directly)
        raise TypeError("a streamed source's length is known only once it was read")

    def __getitem__(self, i: int) -> np.ndarray:
        with self.lock:
            i = int(i) if self.epoch is None else int(i) % self.epoch
            if i in self.cache:
                return self.cache[i]
            if self.gen is None or i < self.next:
                self._restart(i)
            while True:
                try:
                    got = next(self.gen, None)  # type: ignore[arg-type]
                except BaseException:  # a file that cannot be read: the next call reads it again
                    self.gen = None
                    raise
                if got is None:  # the pass ended before window i: its length is now known
                    self._end_of_pass()
                    i %= self.epoch  # type: ignore[operator]
                    if i in self.cache:
                        return self.cache[i]
                    self._restart(i)
                    continue
                k, window = got
                self.cache[k] = window
                if len(self.cache) > self.keep:
                    self.cache.popitem(last=False)
                if k == i:
                    return window

    def _end_of_pass(self) -> None:
        if self.next == 0:
            raise JaxdistError(
                f"the {len(self.files)} streamed file(s) hold too few tokens for one window of "
                f"model.seq_len+1={self.length}; add documents or lower model.seq_len"
            )
        self.epoch = self.next

    def _restart(self, i: int) -> None:
        """Read again from the start of the latest file whose first window is <= i."""
        if self.gen is not None:
            self.gen.close()  # type: ignore[attr-defined]
        file = max(f for f, (w, _) in self.bookmarks.items() if w <= i)
        first, carry = self.bookmarks[file]
        self.cache.clear()
        self.next = first
        self.gen = self._windows(file, first, carry)

    def _windows(self, file: int, first: int, carry: list[int]) -> Iterator[tuple[int, np.ndarray]]:
        """(index, window) from the start of `file` on, to the end of the pass."""
        buf, k = np.asarray(carry, np.int64), first
        self.bookmarks.setdefault(file, (k, [int(t) for t in buf]))
        chunks = stream_workers.encoded(self.files, file, self.fmt, self.field, self.tokenizer_path, self.workers)
        try:
            for _, f, ids, skipped, error in chunks:
                self.skipped += skipped
                if f not in self.bookmarks:
                    self.bookmarks[f] = (k, [int(t) for t in buf])
                buf = np.concatenate([buf, ids])
                n = max((len(buf) - 1) // (self.length - 1), 0)  # whole windows sharing one token
                for w in range(n):
                    start = w * (self.length - 1)
                    self.next = k + 1
                    yield k, buf[start : start + self.length].astype(np.int32)
                    k += 1
                buf = buf[n * (self.length - 1) :]
                if error:  # after the windows of the documents before the bad line
                    raise JaxdistError(error)
        finally:
            chunks.close()  # type: ignore[attr-defined]  # stops grain's worker processes

    def close(self) -> None:
        """Stop reading (and grain's worker processes, with workers > 1); a later read starts again."""
        with self.lock:
            if self.gen is not None:
                self.gen.close()  # type: ignore[attr-defined]
            self.gen = None

    def state(self, window: int) -> dict:
        """What a resume needs to read window `window` without re-reading earlier files."""
        with self.lock:
            i = window if self.epoch is None else window % self.epoch
            file = max(f for f, (w, _) in self.bookmarks.items() if w <= i)
            first, carry = self.bookmarks[file]
            return {
                "file": file,
                "window": first,
                "carry": carry,
                "epoch": self.epoch,
                "skipped": len(self.skipped_docs()),
            }

    def skipped_docs(self) -> list[str]:
        """The documents skipped so far (not UTF-8), each once: a file read again names its skips again."""
        return list(dict.fromkeys(self.skipped))

    def restore(self, state: dict) -> None:
        with self.lock:
            self.bookmarks[int(state["file"])] = (int(state["window"]), [int(t) for t in state["carry"]])
            if state.get("epoch"):
                self.epoch = int(state["epoch"])
            self.gen = None
