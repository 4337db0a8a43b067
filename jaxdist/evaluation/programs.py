"""The compiled programs lm-eval's requests run on, padded to a few shape buckets.

`score` is one forward over a (batch, length) block of token rows padded on the right (causal
attention: a row's padding never reaches its real positions): for each row the summed
log-probability of its target tokens where `mask` is set, and whether each of them is the argmax
(lm-eval's `is_greedy`). Generation is `jaxdist.inference.decode`'s KV-cache program, prompts padded
on the left. Rows are padded to the batch size and lengths to the next bucket (powers of two from 16,
capped at the model's window), so a whole task compiles a handful of programs; `Programs.stats` counts
the buckets used and the token slots computed against the real ones (what padding costs).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdist.distributed import sharding
from jaxdist.inference import decode

SMALLEST_BUCKET = 16


def buckets(limit: int) -> list[int]:
    """Lengths programs are compiled for: 16, 32, 64, ... below `limit`, then `limit` itself."""
    out, b = [], SMALLEST_BUCKET
    while b < limit:
        out.append(b)
        b *= 2
    return [*out, limit]


def bucket(n: int, limit: int) -> int:
    """The smallest bucket holding `n` tokens (`limit` at most)."""
    return next(b for b in buckets(limit) if b >= n)


def score_fn(graphdef):
    """(params, tokens_BL, targets_BL, mask_BL) -> (logprob sum_B, all greedy_B)."""

    def run(params, tokens_BL, targets_BL, mask_BL):
        logits_BLV = nnx.merge(graphdef, params)(tokens_BL).astype(jnp.float32)
        logp_BLV = jax.nn.log_softmax(logits_BLV, axis=-1)
        picked_BL = jnp.take_along_axis(logp_BLV, targets_BL[..., None], axis=-1)[..., 0]
        greedy_BL = jnp.argmax(logits_BLV, axis=-1) == targets_BL
        return jnp.sum(jnp.where(mask_BL, picked_BL, 0.0), axis=-1), jnp.all(greedy_BL | ~mask_BL, axis=-1)

    return jax.jit(run)


@dataclasses.dataclass
class Stats:
    """Which compiled shapes ran how often, and the token slots computed vs the real ones."""

    shapes: dict = dataclasses.field(default_factory=dict)  # ("score"|"generate", B, L[, N]) -> calls
    compile_s: float = 0.0
    real_tokens: int = 0
    computed_tokens: int = 0

    def count(self, key, real: int, computed: int) -> None:
        self.shapes[key] = self.shapes.get(key, 0) + 1
        self.real_tokens += real
        self.computed_tokens += computed

    def line(self) -> str:
        shapes = ", ".join(f"{k[0]} {'x'.join(map(str, k[1:]))} ({n}x)" for k, n in sorted(self.shapes.items()))
        waste = 1 - self.real_tokens / self.computed_tokens if self.computed_tokens else 0.0
        return (
            f"compiled shapes: {shapes or 'none'}; padding {waste:.0%} of {self.computed_tokens:,} token slots; "
            f"compiling {self.compile_s:.1f}s"
        )


class Programs:
    """The model's weights on the mesh and the programs compiled for them, one per shape."""

    def __init__(self, cfg, params, graphdef, mesh, rules):
        self.cfg, self.params, self.graphdef, self.mesh, self.rules = cfg, params, graphdef, mesh, rules
        self._score = score_fn(graphdef)
        self._compiled: dict = {}
        self.stats = Stats()

    def _get(self, key, build):
        if key not in self._compiled:
            t0 = time.perf_counter()
            self._compiled[key] = build()
            self.stats.compile_s += time.perf_counter() - t0
        return self._compiled[key]

    def score(self, rows: list[tuple[list[int], int]], batch: int, limit: int) -> list[tuple[float, bool]]:
        """rows: (tokens, n) with n <= len(tokens) - 1: the log-probability of the last n tokens given
        the ones before, and whether each is the argmax. At most `batch` rows, each <= limit + 1 tokens."""
        L = bucket(max(len(t) - 1 for t, _ in rows), limit)
        tokens, targets, mask = (np.zeros((batch, L), dt) for dt in (np.int32, np.int32, bool))
        for i, (toks, n) in enumerate(rows):
            k = len(toks) - 1
            tokens[i, :k], targets[i, :k] = toks[:-1], toks[1:]
            mask[i, k - n : k] = True
        with sharding.activate(self.mesh, self.rules):
            run = self._get(
                ("score", batch, L), lambda: self._score.lower(self.params, tokens, targets, mask).compile()
            )
            sums, greedy = jax.device_get(run(self.params, tokens, targets, mask))
        self.stats.count(("score", batch, L), sum(len(t) - 1 for t, _ in rows), batch * L)
        return [(float(sums[i]), bool(greedy[i])) for i in range(len(rows))]

    def generate(
        self, prompts: list[list[int]], batch: int, limit: int, new: int, temperature: float, top_p: float, seed: int
    ):
        """-> new tokens (len(prompts), new) for at most `batch` prompts, each <= limit tokens, left-padded."""
        P = bucket(max(len(p) for p in prompts), limit)
        tokens = np.zeros((batch, P), np.int32)
        pad = np.full(batch, P - 1, np.int32)  # filler rows: one token
        for i, p in enumerate(prompts):
            tokens[i, P - len(p) :], pad[i] = p, P - len(p)
        key = jax.random.key(seed)
        with sharding.activate(self.mesh, self.rules):
            run = self._get(
                ("generate", batch, P, new, temperature, top_p),
                lambda: (
                    decode.decode_program(self.graphdef, self.cfg, new, temperature, top_p)
                    .lower(self.params, tokens, pad, key)
                    .compile()
                ),
            )
            out = np.asarray(jax.device_get(run(self.params, tokens, pad, key)[0]))
        real = sum(len(p) + new for p in prompts)
        self.stats.count(("generate", batch, P, new), real, batch * (P + new))
        return out[: len(prompts)]
