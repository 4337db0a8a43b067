"""Mixtures: several weighted sources (`data.sources`) whose weights may change by step (`data.stages`),
drawn into one step-indexed stream of windows.

Each source is read as `data.path` reads it (loader.load_windows) and its training windows are shuffled
from `train.seed` and the source's name, reshuffled at each of its epochs. Global batch row g (step
g // global_batch) is given by grain's proportional mixing (`grain.MapDataset.mix`, which interleaves
the sources deterministically, each at its share of every prefix of the stream to within one row),
over the sources with a positive weight in the stage that holds g. A stage starts where the previous
one left each source: the number of windows a source gave before row g is a closed form of the
weights (`counts`, grain's own interleaving rule), so row g's window depends on g alone: the same on
any mesh or process count, and a resume at any step (across a stage boundary too) is exact.

The iterator's state records each source's position (windows read so far). A resume whose config
computes the same positions changes nothing; one that computes others (the weights or stages were
changed, with --allow-config-change data) continues each source from its saved position.

A source read to its end (`data.on_exhausted`): `repeat` starts its next epoch, reshuffled (the
start-up line gives each source's expected epochs); `stop` refuses the run at start-up, naming the
source and the step where it would run out.
"""

from __future__ import annotations

import bisect
import threading
import zlib
from typing import Any, cast

import grain
import numpy as np

from jaxdist.config import Config
from jaxdist.errors import JaxdistError

INFINITE = 1 << 62


def proportions(weights: list[float]) -> list[int]:
    """Integer proportions of the positive weights, as grain's mix makes them from floats (the smallest
    scaled to 100); passing these ints to grain reproduces them exactly."""
    low = min(weights)
    return [int(w * (100 / low)) for w in weights]


def counts(n: int, props: list[int]) -> list[int]:
    """How many of the first n elements of grain's proportional mix come from each parent: the same
    recursion grain's `_dataset_and_key_of_next_element` runs (tests check it against grain's mix)."""
    remaining, cur, out = sum(props), n, []
    for p in props:
        nxt = cur * (remaining - p) // remaining
        out.append(cur - nxt)
        remaining, cur = remaining - p, nxt
    return out


def source_seed(seed: int, name: str) -> int:
    """A source's shuffle seed: from train.seed and its name (not its position in the list)."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 32)


def schedule(d) -> list[tuple[int, list[float]]]:
    """[(first step, weight per source)]: data.sources' weights from step 0, then data.stages'."""
    names = [s.name for s in d.sources]
    out = [(0, [s.weight for s in d.sources])]
    out += [(st.step, [float(st.weights.get(n, 0.0)) for n in names]) for st in d.stages]
    return out


class Stream:
    """Global row g -> (source, index into that source's shuffled, repeated window stream)."""

    def __init__(self, sched: list[tuple[int, list[float]]], global_batch: int, n_sources: int, anchor=None):
        """`anchor`: (step, windows read per source) a resume saved; the stage holding that step is
        shifted so that each source continues from its saved position."""
        self.global_batch, self.n = global_batch, n_sources
        self.starts, self.stages = [], []  # first global row; (active sources, int proportions, offsets, mix)
        offsets = [0] * n_sources
        for k, (step, weights) in enumerate(sched):
            start = step * global_batch
            active = [j for j, w in enumerate(weights) if w > 0]
            props = proportions([weights[j] for j in active])
            if (
                anchor is not None
                and start <= anchor[0] * global_batch
                and (k + 1 == len(sched) or sched[k + 1][0] > anchor[0])
            ):
                done = counts(anchor[0] * global_batch - start, props)
                offsets = list(anchor[1])
                for j, c in zip(active, done):
                    offsets[j] -= c
            parents = [grain.MapDataset.range(INFINITE).map(_Tag(j, offsets[j])) for j in active]
            mix = grain.MapDataset.mix(parents, props) if len(parents) > 1 else parents[0]
            self.starts.append(start)
            self.stages.append((active, props, list(offsets), mix))
            if k + 1 < len(sched):  # where the next stage starts each source
                for j, c in zip(active, counts(sched[k + 1][0] * global_batch - start, props)):
                    offsets[j] += c

    def __getitem__(self, g: int) -> tuple[int, int]:
        k = bisect.bisect_right(self.starts, g) - 1
        return self.stages[k][3][g - self.starts[k]]

    def read(self, step: int) -> list[int]:
        """Windows each source gave to steps 0 .. step-1."""
        return self.count(step * self.global_batch)

    def count(self, g: int) -> list[int]:
        """Windows each source gave to global rows 0 .. g-1."""
        k = bisect.bisect_right(self.starts, g) - 1
        active, props, offsets, _ = self.stages[k]
        out = list(offsets)
        for j, c in zip(active, counts(g - self.starts[k], props)):
            out[j] += c
        return out

    def sources_of_step(self, step: int) -> np.ndarray:
        """The source of each row of step's global batch."""
        g = step * self.global_batch
        return np.array([self[g + r][0] for r in range(self.global_batch)])


class _Tag:
    """Element i of source j's parent in a stage: (j, offset + i), a picklable map function."""

    def __init__(self, j: int, offset: int):
        self.j, self.offset = j, offset

    def __call__(self, i: int) -> tuple[int, int]:
        return self.j, self.offset + int(i)


class Mixture:
    """The sources of `data.sources` (each a (train, held-out) pair of window sources) and the step-indexed
    stream that draws from them."""

    def __init__(self, cfg: Config, read_source, rows: tuple[int, int] | None = None):
        """`read_source(cfg, source) -> (train, held_out)`: how one source is read (loader.read_source);
        `rows`: this process's rows of each global batch (default all), which a split_files source counts."""
        d = cfg.data
        self.names = [s.name for s in d.sources]
        self.weights = schedule(d)
        self.train, self.held_out = [], []
        for src in d.sources:
            train, held = read_source(cfg, src)
            self.train.append(train)
            self.held_out.append(held)
        self.global_batch = cfg.train.global_batch
        self.streamed = [src.stream for src in d.sources]  # read in order, repeated (data/stream.py)
        self.streams = [
            t if streamed else grain.MapDataset.source(t).shuffle(seed=source_seed(cfg.train.seed, n)).repeat(None)
            for t, n, streamed in zip(self.train, self.names, self.streamed)
        ]
        self.stream = Stream(self.weights, self.global_batch, len(self.names))
        # split_files: this process reads only its files, so its rows take that stream's windows in turn:
        # window i of such a source is the i-th row of it among this process's rows (`local`)
        self.split = [src.stream and src.split_files for src in d.sources]
        self.rows = rows or (0, self.global_batch)
        self.lock = threading.Lock()
        self.local: dict[int, list[int]] = {0: [0] * len(self.names)}  # step -> split windows read before it
        self.anchor = 0  # the earliest step of `local` (a resume's)
        if d.on_exhausted == "stop":
            self.check_enough(cfg.train.steps)

    def window(self, g: int) -> np.ndarray:
        j, i = self.stream[g]
        if self.split[j]:
            step, lo = g // self.global_batch, g // self.global_batch * self.global_batch + self.rows[0]
            i = self.local_read(step)[j] + self.stream.count(g)[j] - self.stream.count(lo)[j]
        return cast(np.ndarray, self.streams[j][i])  # a grain dataset's item is typed optional; no filter: never None

    def local_read(self, step: int) -> list[int]:
        """Windows each source gave to this process's rows of steps before `step` (for split_files)."""
        with self.lock:
            if step not in self.local:
                if step < self.anchor:
                    raise JaxdistError(f"step {step} is before this run's resumed step {self.anchor}")
                start = max(k for k in self.local if k <= step)
                got, (lo, hi), b = self.local[start], self.rows, self.global_batch
                for t in range(start, step):
                    first, last = self.stream.count(t * b + lo), self.stream.count(t * b + hi)
                    got = [c + y - x for c, x, y in zip(got, first, last)]
                self.local[step] = got
                for k in [k for k in self.local if self.anchor < k < step - 4096]:  # bounded: reads move forward
                    del self.local[k]
            return self.local[step]

    def stream_state(self, j: int, step: int) -> dict:
        """Streamed source j's resume state at `step` (where its next window is read from)."""
        source = cast(Any, self.train[j])  # a stream.Streamed
        if not self.split[j]:
            return source.state(self.stream.read(step)[j])
        local = self.local_read(step)[j]
        return {**source.state(local), "local": local, "process": list(source.process)}

    def restore_stream(self, j: int, step: int, saved: dict) -> None:
        """Continue streamed source j from a checkpoint's state (`stream_state`)."""
        source = cast(Any, self.train[j])
        if self.split[j]:
            (p, count), was = source.process, saved.get("process")
            if "local" not in saved or was is None or list(was) != [p, count]:
                by = f"by process {was[0]} of {was[1]}" if was else "without split_files"
                raise JaxdistError(
                    f"data.sources {self.names[j]} has split_files and the checkpoint was saved {by}, but this is "
                    f"process {p} of {count}: each process's files would change; resume on the same process count, "
                    "or start a new run"
                )
            with self.lock:
                if self.anchor != step or step not in self.local:
                    self.local, self.anchor = {step: [0] * len(self.names)}, step
                self.local[step][j] = int(saved["local"])
        source.restore(saved)

    def read(self, step: int) -> dict[str, int]:
        """{source: windows read by steps 0 .. step-1}: the per-source iterator state."""
        return dict(zip(self.names, self.stream.read(step)))

    def resume(self, step: int, read: dict[str, int]) -> None:
        """Continue each source from `read` (a saved state) if this config would have read otherwise."""
        if read == self.read(step):
            return
        missing = [n for n in self.names if n not in read]
        if missing:
            raise JaxdistError(
                f"the checkpoint's data state has no position for source {missing[0]!r} (added to data.sources "
                "since it was saved); a source cannot join a mixture on resume, start a new run"
            )
        anchor = (step, [int(read[n]) for n in self.names])
        self.stream = Stream(self.weights, self.global_batch, len(self.names), anchor)

    def check_enough(self, steps: int) -> None:
        """data.on_exhausted=stop: every source holds the windows `steps` steps read from it."""
        total = self.stream.read(steps)
        for j, name in enumerate(self.names):
            if self.streamed[j]:  # refused with on_exhausted=stop by the config check
                continue
            have = len(self.train[j])
            if total[j] > have:
                lo, hi = 0, steps  # the first step whose batch needs window `have` of this source
                while lo < hi:
                    mid = (lo + hi) // 2
                    lo, hi = (mid + 1, hi) if self.stream.read(mid + 1)[j] <= have else (lo, mid)
                raise JaxdistError(
                    f"data.sources {name}: {steps} steps read {total[j]:,} windows of its {have:,}, so it runs out after "
                    f"{lo} steps and data.on_exhausted=stop; lower its weight, train fewer steps, add data, or set "
                    "data.on_exhausted=repeat (its next epoch, reshuffled)"
                )

    def skipped(self) -> dict[str, list[str]]:
        """{streamed source: the documents it skipped (not UTF-8)}, for the sources that skipped any."""
        return {
            n: docs
            for n, t, on in zip(self.names, self.train, self.streamed)
            if on and (docs := t.skipped_docs())  # type: ignore[attr-defined]  # a streamed source is stream.Streamed
        }

    def skip_counts(self) -> dict[str, int]:
        """{streamed source: documents skipped}: metrics.jsonl's summary `data_skipped` (training/finish.py)."""
        return {name: len(docs) for name, docs in self.skipped().items()}

    def skip_note(self) -> str:
        """'' or '; streamed data skipped N document(s) ...': what a run's closing line adds."""
        got = self.skipped()
        if not got:
            return ""
        each = ", ".join(f"{name} {len(docs)} (first {docs[0]})" for name, docs in got.items())
        return f"; streamed data skipped {sum(map(len, got.values()))} document(s) that are not UTF-8: {each}"

    def line(self, cfg: Config) -> str:
        """The start-up data line: per source what was read, its tokens, weight(s) and expected epochs."""
        total = self.stream.read(cfg.train.steps)
        parts = []
        for j, name in enumerate(self.names):
            train, held = self.train[j], self.held_out[j]
            ws = " -> ".join(f"{w[j]:g}" if step == 0 else f"{w[j]:g} from step {step}" for step, w in self.weights)
            if self.streamed[j]:
                parts.append(f"{name}: {train.label}, weight {ws}, {total[j]:,} windows to read, none held out")
                continue
            tokens = sum(len(a) for a in train.source.arrays)
            parts.append(
                f"{name}: {train.label}, {tokens:,} tokens, weight {ws}, {len(train):,} windows "
                f"+ {len(held):,} held out, {total[j] / max(len(train), 1):.3g} epochs"
            )
        return (
            f"data: a mixture of {len(self.names)} sources, {cfg.train.steps} steps x {cfg.train.global_batch} windows of "
            f"{cfg.model.seq_len + 1} tokens; " + "; ".join(parts) + f" (data.on_exhausted={cfg.data.on_exhausted})"
        )


def eval_losses(names: list[str], sums: list[tuple[float, float]]) -> dict[str, float]:
    """{"loss": all eval batches' loss, "loss/NAME": each source's}: `sums` holds each eval batch's
    (summed loss, token count) and `names` its source (logged as eval_loss and eval_loss/NAME)."""
    per: dict[str, list[float]] = {}
    for name, (x, c) in zip(names, sums):
        tot = per.setdefault(name, [0.0, 0.0])
        tot[0], tot[1] = tot[0] + float(x), tot[1] + float(c)
    loss = sum(x for x, _ in per.values()) / sum(c for _, c in per.values())
    return {"loss": loss, **{f"loss/{name}": x / c for name, (x, c) in per.items()}}
