"""The loss mask, carried inside the token array: a token that is not a loss target is stored as `~id` (= -id-1).

Why inside the tokens: the batch stays one int32 array, so every path that moves tokens (the loader, the
batch sharding, micro-batch splits, the explicit and compressed reductions, the pipeline, context
parallelism, evaluation) carries the mask unchanged, and the step reads it as data. Token ids are
non-negative, so a batch without a mask (all pretraining data) decodes to weight 1 everywhere: its loss
is bit-for-bit what it was. `split` runs inside the step; `encode` and `Masked` on the host.

Mask convention: mask[i] = 1 means token i is trained on, i.e. the loss of predicting it (from the
tokens before it) counts; the model's input is always the decoded id.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def encode(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """int32 tokens with the masked-out ones stored as ~id."""
    ids = np.asarray(ids, np.int32)
    return np.where(np.asarray(mask, bool), ids, ~ids)


def split(tokens):
    """(ids, weights float32) of an encoded (jax or numpy) array: ids >= 0, weight 1 where trained on."""

    trained = tokens >= 0
    return jnp.where(trained, tokens, ~tokens), trained.astype(jnp.float32)


class Masked:
    """A token array and its uint8 mask (memory-mapped shards) read as encoded int32 slices, so the
    loader's windows (`data.Windows`) slice it like a plain token array."""

    def __init__(self, ids: np.ndarray, mask: np.ndarray):
        if len(ids) != len(mask):
            raise ValueError(f"{len(ids)} tokens but {len(mask)} mask entries")
        self.ids, self.mask = ids, mask

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index) -> np.ndarray:
        return encode(self.ids[index], self.mask[index])
