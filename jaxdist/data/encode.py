"""Documents -> token ids, in order, in worker processes: the encoder `prepare` and streamed sources
(jaxdist/data/stream.py) share, so both pack the same tokens. Each document is encoded `[BOS] tokens EOS`
by the tokenizer's rule; the held-out split is a hash of the document's text (`is_held_out`)."""

from __future__ import annotations

import collections
import hashlib
import multiprocessing
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from jaxdist.data import tokenizer as tokenizer_mod

CHUNK_CHARS = 1 << 20  # text per task sent to a worker


def is_held_out(text: str, fraction: float) -> bool:
    digest = hashlib.blake2b(text.encode("utf-8", errors="replace"), digest_size=8).digest()
    return int.from_bytes(digest, "little") < fraction * 2.0**64


def chunks(docs: Iterator[tuple[str, float]], fraction: float) -> Iterator[tuple[list[str], list[bool], float]]:
    texts, held, size, nbytes = [], [], 0, 0
    for text, n in docs:
        if not text:
            continue
        texts.append(text)
        held.append(is_held_out(text, fraction))
        size, nbytes = size + len(text), nbytes + n
        if size >= CHUNK_CHARS:
            yield texts, held, nbytes
            texts, held, size, nbytes = [], [], 0, 0
    if texts:
        yield texts, held, nbytes


_WORKER_TOK = None


def _init_worker(tokenizer_dir: str) -> None:
    global _WORKER_TOK
    _WORKER_TOK = tokenizer_mod.load(tokenizer_dir)


def _encode(task, tok=None):
    """One chunk -> (train ids, held-out ids, train docs, held-out docs, input bytes)."""
    texts, held, nbytes = task
    tok = tok or _WORKER_TOK
    assert tok is not None, "a worker encodes with the tokenizer _init_worker loaded"
    ids = tok.encode_documents(texts)
    train = [a for a, h in zip(ids, held) if not h]
    val = [a for a, h in zip(ids, held) if h]
    return _cat(train), _cat(val), len(train), len(val), nbytes


def _cat(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(arrays) if arrays else np.zeros(0, np.int64)


def encoded(tasks: Iterator, tok, tokenizer_dir: Path | str, workers: int) -> Iterator[tuple]:
    """Encoded chunks in input order; at most 2 x workers chunks in flight (bounded memory)."""
    if workers <= 1:
        for task in tasks:
            yield _encode(task, tok)
        return
    # Workers fork from a fresh server process that has imported only this module: safe even when the
    # caller is multithreaded (JAX, a trained tokenizer's thread pool) and fast to start.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["jaxdist.data.encode"])
    with context.Pool(workers, _init_worker, (str(tokenizer_dir),)) as pool:
        pending = collections.deque()
        for task in tasks:
            pending.append(pool.apply_async(_encode, (task,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
