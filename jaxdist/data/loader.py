"""Data: token streams -> fixed windows -> deterministic global batches, on grain.

The global batch of step s is the same whatever the mesh or process count: windows are shuffled once
from `train.seed` (reshuffled per epoch), and step s takes shuffled windows [s*B, (s+1)*B). Each
process reads only the rows its devices hold and the global array is assembled with
`jax.make_array_from_process_local_data`. Iteration state (grain's `get_state`) is checkpointable.

Sources:
- `text`: UTF-8 files from a glob or folder, one document per file: byte-level tokens joined by a
  separator byte, or with `data.tokenizer` real tokens with the tokenizer's BOS/EOS rule
  (jaxdist/data/tokenizer.py). With no path, the running interpreter's standard library source.
- `tokens`: flat binary token files (uint16/uint32), memory-mapped (nanoGPT / Megatron style), from a
  glob or folder (read and checked by jaxdist/data/arrays.py); a folder made by
  `python -m jaxdist.data prepare` (jaxdist/data/prepare.py) trains on its train/ shards and evaluates on
  its val/ shards, with the dtype its manifest records (the manifest decides: `data.token_dtype` may be
  left at auto, and another value is an error).

Evaluation reads one source, by one rule: a prepared folder's val/ split; otherwise the last
`data.eval_fraction` of the token stream. When that source holds no whole window of model.seq_len+1
tokens, evaluation is off with one start-up warning saying why (never windows taken from elsewhere).
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, cast

import grain
import jax
import numpy as np

from jaxdist.config import Config
from jaxdist.data import mixture, prefprep, stream, tokenizer
from jaxdist.data.arrays import read_documents, read_text, token_arrays
from jaxdist.data.data_rules import resolve_token_dtype, row_width, source_config
from jaxdist.data.files import expand_path, stdlib_files
from jaxdist.errors import JaxdistError


class Windows:
    """Random access to non-overlapping windows of `length` tokens (input + shifted target share one)
    over a list of 1-D token arrays; windows never straddle two arrays. `records=True`: the arrays hold
    whole records of `length` tokens (preference pairs), read back to back with no shared token."""

    def __init__(self, arrays: list[np.ndarray], length: int, records: bool = False):
        self.arrays, self.length = arrays, length
        self.stride = length if records else length - 1
        per = [max((len(a) - (length - self.stride)) // self.stride, 0) for a in arrays]
        self.offsets = np.concatenate([[0], np.cumsum(per)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, i: int) -> np.ndarray:
        k = int(np.searchsorted(self.offsets, i, side="right") - 1)
        start = (int(i) - int(self.offsets[k])) * self.stride
        return np.asarray(self.arrays[k][start : start + self.length], dtype=np.int32)


class Subset:
    """Windows [start, stop) of another source (train / held-out split); `label` says what was read."""

    def __init__(self, source, start: int, stop: int, label: str = ""):
        self.source, self.start, self.stop, self.label = source, start, stop, label

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, i: int) -> np.ndarray:
        return self.source[self.start + int(i)]


def load_windows(cfg: Config) -> tuple[Subset, Subset]:
    """(train, eval) window sources; eval is a prepared folder's val/ split (maybe empty), else the
    tail `data.eval_fraction` of the stream. Their `label`s say what was read."""
    cfg = resolve_token_dtype(cfg)
    d, length = cfg.data, row_width(cfg)
    records = prefprep.paired(cfg)
    if records and d.source != "tokens":
        raise JaxdistError(
            f"objective.method={cfg.objective.method} trains on preference pairs: set data.source=tokens and "
            "data.path to a folder made by python -m jaxdist.data prepare --preference"
        )
    held_out: list[np.ndarray] | None = None
    if d.source == "text":
        if cfg.model.vocab_size < 256 and not d.tokenizer:
            raise JaxdistError(
                f"data.source=text uses byte tokens (256) but model.vocab_size="
                f"{cfg.model.vocab_size}; set model.vocab_size=256 or more (or data.tokenizer)"
            )
        files = expand_path(d.path) if d.path else stdlib_files()
        where = d.path or "the Python standard library"
        if d.tokenizer:
            arrays = [read_documents(files, d.tokenizer, cfg.model.vocab_size)]
            what = f"{len(files):,} text files ({where}), tokenizer {d.tokenizer}"
        else:
            arrays = [read_text(files, d.separator)]
            what = f"{len(files):,} text files ({where}), byte tokens"
    else:
        arrays, held_out, what = token_arrays(cfg)
    windows = Windows(arrays, length, records)
    n = len(windows)
    n_eval = 0 if held_out is not None else int(n * d.eval_fraction)
    if n - n_eval < 1:
        total = sum(len(a) for a in arrays)
        raise JaxdistError(
            f"the corpus has {total} tokens, too few for one window of model.seq_len+1="
            f"{length}; add data or lower model.seq_len"
        )
    if held_out is not None:  # a prepared folder: its val/ split, however small (no fallback)
        val = Windows(held_out, length, records)
        tokens = sum(len(a) for a in held_out)
        return Subset(windows, 0, n, what), Subset(val, 0, len(val), f"the val/ split, {tokens:,} tokens")
    tail = f"the last {d.eval_fraction:.3%} of the stream, data.eval_fraction".replace(".000%", "%")
    return Subset(windows, 0, n - n_eval, what), Subset(windows, n - n_eval, n, tail)


def read_source(cfg: Config, src, process: tuple[int, int] = (0, 1)) -> tuple[Subset | stream.Streamed, Subset]:
    """One mixture source's (train, eval) windows, read as data.path would be; `process` (index, count)
    matters only to a streamed source with split_files."""
    if prefprep.paired(cfg):
        raise JaxdistError(
            f"objective.method={cfg.objective.method} trains on preference pairs, which data.sources does not mix; "
            "give one prepared folder as data.path"
        )
    try:
        if src.stream:
            return streamed_source(cfg, src, process)
        return load_windows(source_config(cfg, src))
    except JaxdistError as e:
        raise JaxdistError(f"data.sources {src.name}: {e}") from None


def streamed_source(cfg: Config, src, process: tuple[int, int] = (0, 1)) -> tuple[stream.Streamed, Subset]:
    """A `stream: true` source: its documents tokenized while training (jaxdist/data/stream.py); no held-out
    split. With split_files, process p of P reads only files p, p+P, ... of the sorted list."""
    tok = tokenizer.load(cfg.data.tokenizer)
    tokenizer.check_vocab(tok, cfg.model.vocab_size, f"data.tokenizer={cfg.data.tokenizer}")
    files = expand_path(src.path)
    share = ""
    if src.split_files:
        p, count = process
        if len(files) < count:
            raise JaxdistError(
                f"split_files gives each of the {count} processes its own files, but {src.path} holds "
                f"{len(files)}; split the documents into at least {count} files, or drop split_files"
            )
        share = f", this process's share: files {p}, {p + count}, ... of {len(files):,} (process {p} of {count})"
        files = files[p::count]
    train = stream.Streamed(files, "auto", src.field, cfg.data.tokenizer, cfg.model.seq_len + 1, src.workers)
    train.process = process if src.split_files else (0, 1)
    train.label = (
        f"{len(files):,} file{'s' if len(files) != 1 else ''} streamed ({src.path}, field {src.field!r}), "
        f"tokenizer {cfg.data.tokenizer}, in file order{share}"
    )
    return train, Subset(Windows([], cfg.model.seq_len + 1), 0, 0, "none (a streamed source)")


def local_rows(sharding: jax.sharding.Sharding, global_batch: int, width: int) -> tuple[int, int]:
    """The contiguous block of global-batch rows that this process's devices hold."""
    # an addressable device always has its index (the map's values are typed optional)
    index_map = cast(dict[Any, tuple[slice, ...]], sharding.addressable_devices_indices_map((global_batch, width)))
    starts = [idx[0].start or 0 for idx in index_map.values()]
    stops = [global_batch if idx[0].stop is None else idx[0].stop for idx in index_map.values()]
    lo, hi = min(starts), max(stops)
    covered = sorted(set(zip(starts, stops)))
    if sum(b - a for a, b in covered) < hi - lo:
        raise JaxdistError(
            "this process's batch rows are not contiguous; use a mesh whose batch axes "
            "(dp, fsdp) are laid out host-major (the default --dcn-mesh)"
        )
    return lo, hi


def batches(
    source, global_batch: int, seed: int, rows: tuple[int, int], poison_step: int = -1, poison_value: int = 0
) -> grain.MapDataset:
    """Step-indexed dataset: element s is this process's rows of the global batch of step s."""
    shuffled = grain.MapDataset.source(source).shuffle(seed=seed).repeat(None)
    lo, hi = rows

    def rows_of_step(s: int) -> np.ndarray:
        batch = np.stack(
            [cast(np.ndarray, shuffled[s * global_batch + r]) for r in range(lo, hi)]
        )  # never None: no filter
        if s == poison_step:  # testing aid: out-of-vocabulary ids make the loss NaN
            batch = np.full_like(batch, poison_value)
        return batch

    return grain.MapDataset.range(1 << 62).map(rows_of_step)


def mixed_batches(mix, global_batch: int, rows: tuple[int, int]) -> grain.MapDataset:
    """Step-indexed dataset of a mixture: element s is this process's rows of step s's global batch."""
    lo, hi = rows
    return grain.MapDataset.range(1 << 62).map(
        lambda s: np.stack([mix.window(s * global_batch + r) for r in range(lo, hi)])
    )


def eval_batches(source, global_batch: int, count: int, rows: tuple[int, int]) -> list[np.ndarray]:
    """The first `count` global batches of the held-out split, in order (the same every eval)."""
    if len(source) == 0 or count == 0:
        return []
    lo, hi = rows
    return [np.stack([source[(s * global_batch + r) % len(source)] for r in range(lo, hi)]) for s in range(count)]


def test_poison_step() -> int:
    """Test hook, not a user setting: JAXDIST_TEST_POISON_STEP=s fills step s's batch with out-of-vocabulary
    ids (NaN loss), to exercise the non-finite guard end to end."""
    return int(os.environ.get("JAXDIST_TEST_POISON_STEP", "-1"))


class Loader:
    """Training batches as global sharded arrays, prefetched by grain threads; checkpointable."""

    def __init__(self, cfg: Config, batch_sharding: jax.sharding.NamedSharding, process: tuple[int, int] | None = None):
        """`process` (index, count): this process's place, for split_files (default: JAX's; tests simulate)."""
        self.sharding = batch_sharding
        self.process = process or (jax.process_index(), jax.process_count())
        self.global_shape = (cfg.train.global_batch, row_width(cfg))
        self.rows = local_rows(batch_sharding, *self.global_shape)
        self.options = grain.ReadOptions(num_threads=cfg.data.prefetch, prefetch_buffer_size=cfg.data.prefetch)
        self.mixture = None
        self.eval_names: list[str] = []  # with data.sources: the source of each eval batch
        if cfg.data.sources:
            read = functools.partial(read_source, process=self.process)
            self.mixture = mixture.Mixture(cfg, read, self.rows)
            self._eval = []
            for name, held in zip(self.mixture.names, self.mixture.held_out):
                got = eval_batches(held, cfg.train.global_batch, cfg.train.eval_batches, self.rows)
                self._eval += got
                self.eval_names += [name] * len(got)
            self.train = self.held_out = None
            self.iterator = self._mixed_iterator()
            return
        self.train, self.held_out = load_windows(cfg)
        dataset = batches(
            self.train, cfg.train.global_batch, cfg.train.seed, self.rows, test_poison_step(), cfg.model.vocab_size
        )
        self.iterator = iter(dataset.to_iter_dataset(self.options))
        self._eval = eval_batches(self.held_out, cfg.train.global_batch, cfg.train.eval_batches, self.rows)

    def _mixed_iterator(self):
        return iter(mixed_batches(self.mixture, self.global_shape[0], self.rows).to_iter_dataset(self.options))

    def to_global(self, local: np.ndarray) -> jax.Array:
        return jax.make_array_from_process_local_data(self.sharding, local, self.global_shape)

    def __next__(self) -> jax.Array:
        return self.to_global(next(self.iterator))

    def __iter__(self):
        return self

    def has_eval(self) -> bool:
        return bool(self._eval)

    def eval_arrays(self) -> list[jax.Array]:
        return [self.to_global(b) for b in self._eval]

    def get_state(self) -> dict:
        """grain's iterator state (the next step); with data.sources also each source's windows read."""
        state = self.iterator.get_state()
        if self.mixture is not None:
            mix, step = self.mixture, int(state["next_index"])
            read = mix.read(step)
            state = {**state, "sources": read}
            streamed = {n: mix.stream_state(j, step) for j, n in enumerate(mix.names) if mix.streamed[j]}
            if streamed:  # where each streamed source's next window is read from (data/stream.py)
                state["streamed"] = streamed
        return state

    def skip_note(self) -> str:
        """What a run's closing line says of documents a streamed source skipped ('' if none)."""
        return self.mixture.skip_note() if self.mixture is not None else ""

    def set_state(self, state: dict) -> None:
        if self.mixture is not None and "sources" in state:
            state = dict(state)
            read = state.pop("sources")
            saved = state.pop("streamed", {})
            self.mixture.resume(int(state["next_index"]), read)
            for name, got in saved.items():
                j = self.mixture.names.index(name) if name in self.mixture.names else -1
                if j >= 0 and self.mixture.streamed[j]:
                    self.mixture.restore_stream(j, int(state["next_index"]), got)
            self.iterator = self._mixed_iterator()
        self.iterator.set_state(state)


def no_eval_reason(cfg: Config, loader: Loader) -> str | None:
    """Why evaluation cannot run although train.eval_every asks for it (None: it can, or is off)."""
    if not cfg.train.eval_every or loader.has_eval():
        return None
    if cfg.train.eval_batches == 0:
        return f"train.eval_every={cfg.train.eval_every} but train.eval_batches=0"
    train, held = loader.train, loader.held_out
    if train is None or held is None:  # data.sources: the mixture's sources hold the windows
        return (
            f"no source of data.sources holds a held-out window of model.seq_len+1={cfg.model.seq_len + 1} tokens "
            "(a prepared folder's val/, else the last data.eval_fraction of its stream); add held-out data or lower "
            "model.seq_len"
        )
    if held.label.startswith("the val/ split"):
        return (
            f"the val/ split of {cfg.data.path} ({held.label.split(', ')[-1]}) holds no window of "
            f"model.seq_len+1={cfg.model.seq_len + 1} tokens; re-run prepare with a larger --val-fraction (or more "
            "documents), or lower model.seq_len"
        )
    return (
        f"no held-out data: data.eval_fraction={cfg.data.eval_fraction} of the corpus's "
        f"{len(train) + len(held)} windows is no whole window; raise data.eval_fraction or add data"
    )


if __name__ == "__main__":  # python -m jaxdist.data prepare ... (jaxdist/data/prepare.py)
    from jaxdist.data.prepare import main

    sys.exit(main())
