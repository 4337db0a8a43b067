"""The micro-batch split shared by gradient accumulation (jaxdist/reduce/gradients.py) and the pipeline."""

from __future__ import annotations


def split_microbatches(x_B, microbatches: int):
    """(B, ...) -> (M, B/M, ...) taking rows m, m+M, ...: each device keeps its own rows (no resharding).
    Used for gradient accumulation and for the pipeline's micro-batches."""
    return x_B.reshape(x_B.shape[0] // microbatches, microbatches, *x_B.shape[1:]).swapaxes(0, 1)
