"""GRPO's data: the prompt records of a `prepare --prompts` folder as a checkpointable, step-indexed stream.

Element s of the stream is step s's batch: `PromptBatch(step=s, records=[...])`, the
`train.global_batch / objective.group_size` prompt records of that step, read from a shuffle (seeded by
`train.seed`) of the train split repeated without end. The stream is a grain iterator over step indices,
so a checkpoint saves its position exactly as the token loader's (`Saver.save` writes `iterator` and
`get_state()`; a restore sets it back), and a resumed run draws the same prompts at the same steps. The
sampling seed of step s is `seed(cfg, s)`: a resumed run samples the same completions too.

Held-out: the first `train.eval_batches` batches of the val split, in order (the same every evaluation).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import grain
import numpy as np

from jaxdist.config import Config
from jaxdist.data import promptprep
from jaxdist.errors import JaxdistError


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    step: int
    records: list[dict]


def seed(cfg: Config, step: int) -> int:
    """Step `step`'s sampling seed (the same on a resume); evaluation's is `seed(cfg, -1)`."""
    return (cfg.train.seed * 1_000_003 + step + 1) % (1 << 31)


class PromptStream:
    """Prompt batches of `data.path` (a `prepare --prompts` folder) for GRPO; checkpointable as `Loader`."""

    mixture = None  # never a data.sources mixture (checkpoint restoring asks)

    def __init__(self, cfg: Config):
        path = Path(cfg.data.path or "")
        if cfg.data.sources or not path.is_dir():
            raise JaxdistError(
                "objective.method=grpo reads prompts: set data.path to a folder made by python -m jaxdist.data "
                "prepare --prompts (data.sources is not supported)"
            )
        self.train = promptprep.read(path, "train")
        self.held = promptprep.read(path, "val")
        if not self.train:
            raise JaxdistError(f"{path} holds no training prompts (train/{promptprep.FILE} is empty); add prompts")
        room = cfg.model.seq_len + 1 - cfg.objective.max_new_tokens
        long = sum(len(r["ids"]) > room for r in self.train + self.held)
        if long:
            raise JaxdistError(
                f"{path}: {long} prompts are longer than model.seq_len + 1 - objective.max_new_tokens = {room} tokens "
                "(no room for the completion); lower objective.max_new_tokens, raise model.seq_len or prepare the "
                f"prompts with --seq-len {room}"
            )
        self.per_step = cfg.train.global_batch // cfg.objective.group_size
        self.label = f"{path}: {len(self.train):,} train / {len(self.held):,} held-out prompts"
        order = np.random.default_rng(cfg.train.seed).permutation(len(self.train))
        n, per = len(self.train), self.per_step
        steps = grain.MapDataset.range(1 << 62).map(
            lambda s: PromptBatch(int(s), [self.train[order[(s * per + j) % n]] for j in range(per)])
        )
        self.iterator = iter(steps.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)))
        count = min(cfg.train.eval_batches, -(-len(self.held) // per)) if self.held else 0
        self._eval = [[self.held[(s * per + j) % len(self.held)] for j in range(per)] for s in range(count)]

    def __next__(self) -> PromptBatch:
        return next(self.iterator)

    def __iter__(self):
        return self

    def has_eval(self) -> bool:
        return bool(self._eval)

    def eval_arrays(self) -> list[list[dict]]:
        """The held-out prompt batches (records, not arrays: GRPO's evaluation samples them)."""
        return self._eval

    def get_state(self) -> dict:
        return self.iterator.get_state()

    def set_state(self, state: dict) -> None:
        self.iterator.set_state(state)

    def line(self, cfg: Config) -> str:
        read = cfg.train.steps * self.per_step
        return (
            f"data: {self.label}; {cfg.train.steps} steps x {self.per_step} prompts x {cfg.objective.group_size} "
            f"completions = {read / len(self.train):.3g} epochs of prompts"
        )
