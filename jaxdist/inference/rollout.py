"""GRPO on the training mesh: rollouts with the KV-cache decoder from the policy's own parameters, scored,
turned into the GRPO stage's batch and trained on by the trainer's compiled step.

`GRPORun` holds the training program (`training.step.build_program` with GRPO's gradient stage,
`jaxdist.objectives.grpo_stage`) and the decoding program (`decode.decode_program`, compiled once per
prompt-length bucket). Each `step`: the batch's prompts (`train.global_batch / group_size`, each repeated
`group_size` times, group after group) are sampled from the state's parameter arrays in place (no copy,
no other process; the batch replicated, the weights sharded as they train), at `temperature` / `top_p`
for `max_new_tokens`, all in one jitted prefill + `lax.scan` (no host round trip per token). Completions
end after their first EOS (kept, as TRL's completion mask). Then the reward functions
(`jaxdist.objectives.rewards`) score the texts, the advantages are group-normalised, and the step runs
`iterations` times on the packed batch (old log-probs from the sampling weights when iterations > 1).
Rows are the prompt then the completion from position 0, right-padded to `seq_len + 1`, so the trained
forward sees what the decoder saw at the same positions.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from jaxdist.data import loss_mask
from jaxdist.distributed import sharding
from jaxdist.errors import JaxdistError
from jaxdist.inference import decode
from jaxdist.objectives import grpo, grpo_stage, rewards
from jaxdist.objectives import registry as objectives
from jaxdist.training import step as step_mod


def prompt_bucket(n: int, limit: int) -> int:
    """Prompt length compiled for: the next multiple of 16 (at most `limit`)."""
    return min(-(-n // 16) * 16, limit)


def rows_of(prompts: list[list[int]], completions: np.ndarray, stop: set[int], width: int, pad: int):
    """(encoded rows (N, width), completion token lists): prompt + completion (through the first EOS),
    right-padded with `pad`; the loss mask on the completion."""
    ids = np.full((len(prompts), width), pad, np.int64)
    mask = np.zeros_like(ids)
    kept = []
    for i, (p, new) in enumerate(zip(prompts, completions.tolist())):
        c = decode.cut_at_eos(new, new, stop)[0]
        ids[i, : len(p)], ids[i, len(p) : len(p) + len(c)] = p, c
        mask[i, len(p) : len(p) + len(c)] = 1
        kept.append(c)
    return loss_mask.encode(ids, mask), kept


@dataclasses.dataclass
class Rollout:
    rows: np.ndarray  # (N, W) encoded
    completions: list[list[int]]
    logprobs: np.ndarray  # (N, max_new_tokens): log-probs of the sampled tokens (before temperature)
    sampled_tokens: int  # N x max_new_tokens: what the decoder computed
    seconds: float  # decoding, without compiling


class GRPORun:
    """The program and the decoder for `cfg` on `mesh` with GRPO settings `g`; `step(state, records)`."""

    def __init__(
        self, cfg, mesh, g: grpo.GRPO, reward_fns: dict[str, Callable], weights: list[float], text, eos, prog=None
    ):
        if cfg.train.global_batch % g.group_size:
            raise JaxdistError(
                f"train.global_batch={cfg.train.global_batch} must be a multiple of group_size={g.group_size} "
                "(each prompt's completions make one group)"
            )
        objectives.unsupported(cfg, mesh, "GRPO")  # pp, cp, reduce methods, offload, document mask: as DPO
        self.cfg, self.mesh, self.g, self.text, self.eos = cfg, mesh, g, text, set(eos)
        self.reward_fns, self.weights = reward_fns, weights
        self.prog = prog or step_mod.build_program(
            cfg, mesh, gradient_stage=lambda apply_fn, c, m, model: grpo_stage.grpo_stage(apply_fn, c, g)
        )  # the trainer's (objective.method=grpo builds this stage) or one of its own
        self.prompts_per_step = cfg.train.global_batch // g.group_size
        self.width = cfg.model.seq_len + 1
        self.pad = min(self.eos) if self.eos else 0
        self._decode = decode.decode_program(self.prog.graphdef, cfg, g.max_new_tokens, g.temperature, g.top_p)
        self._compiled: dict = {}
        self._train = None
        self._old = jax.jit(grpo_stage.old_logps_fn(self.prog.apply_fn, g.temperature))
        self.compile_s = 0.0

    @property
    def batch_shape(self) -> tuple[int, int]:
        """The train step's batch: `grpo_stage.pack`'s (global_batch, 2 x (seq_len + 1)) int32."""
        return (self.cfg.train.global_batch, 2 * self.width)

    def use(self, compiled) -> None:
        """Train with this compiled step (the trainer compiles it before the first rollout)."""
        self._train = compiled

    def sample(self, params, prompts: list[list[int]], seed: int) -> Rollout:
        """`group_size` completions of each prompt (group after group) from `params`, on the mesh."""
        g, limit = self.g, self.width - self.g.max_new_tokens
        for p in prompts:
            if len(p) > limit:
                raise JaxdistError(
                    f"a prompt of {len(p)} tokens + max_new_tokens {g.max_new_tokens} is more than a row of "
                    f"model.seq_len {self.cfg.model.seq_len} + 1; shorten the prompts (prepare --prompts --seq-len) "
                    "or lower max_new_tokens"
                )
        rows = [p for p in prompts for _ in range(g.group_size)]
        P = prompt_bucket(max(len(p) for p in rows), limit)
        tokens = np.zeros((len(rows), P), np.int32)
        for i, p in enumerate(rows):
            tokens[i, P - len(p) :] = p
        pad = np.array([P - len(p) for p in rows], np.int32)
        key = jax.random.key(seed)
        with sharding.activate(self.mesh, decode.generation_rules(self.cfg)):
            if (len(rows), P) not in self._compiled:
                t0 = time.perf_counter()
                self._compiled[(len(rows), P)] = self._decode.lower(params, tokens, pad, key).compile()
                self.compile_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            new, logp = (
                np.asarray(a) for a in jax.device_get(self._compiled[(len(rows), P)](params, tokens, pad, key))
            )
            seconds = time.perf_counter() - t0
        encoded, kept = rows_of(rows, new, self.eos, self.width, self.pad)
        return Rollout(encoded, kept, logp, new.size, seconds)

    def scored(self, params, records: list[dict], seed: int):
        """Sample `records`' groups from `params` and score them -> (rollout, total rewards (N,), {name: (N,)})."""
        g = self.g
        out = self.sample(params, [r["ids"] for r in records], seed)
        texts = [self.text(c) for c in out.completions]
        prompts = [r["prompt"] for r in records for _ in range(g.group_size)]
        conversational = isinstance(prompts[0], list)
        completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
        keys = sorted({k for r in records for k in r} - {"ids", "prompt"})
        columns = {k: [r.get(k) for r in records for _ in range(g.group_size)] for k in keys}
        total, per = rewards.score(self.reward_fns, self.weights, prompts, completions, columns, out.completions)
        return out, total, per

    def evaluate(self, params, batches: list[list[dict]], seed: int) -> dict[str, float]:
        """The reward of completions sampled (as in training: same temperature, top-p, group size) for the
        held-out prompt batches: {reward, reward_std, rewards/NAME/mean, completion_length}."""
        totals, pers, lengths = [], [], []
        for i, records in enumerate(batches):
            out, total, per = self.scored(params, records, seed + i)
            totals.append(total)
            pers.append(per)
            lengths += [len(c) for c in out.completions]
        total = np.concatenate(totals)
        scored = total[~np.isnan(total)]
        got = {
            "reward": float(scored.mean()) if scored.size else float("nan"),
            "reward_std": float(scored.std(ddof=1)) if scored.size > 1 else 0.0,
            "completion_length": float(np.mean(lengths)),
        }
        for name in pers[0]:
            got[f"rewards/{name}/mean"] = float(np.nanmean(np.concatenate([p[name] for p in pers])))
        return got

    def step(self, state, records: list[dict], seed: int):
        """One GRPO step on `records` (prompt records: `ids`, `prompt`, other columns) -> (state, metrics)."""
        t0, compiling = time.perf_counter(), self.compile_s
        g = self.g
        out, total, per = self.scored(state.params, records, seed)
        adv = grpo.advantages(total, g.group_size, g.scale_rewards)
        placed = lambda a: jax.device_put(a, self.prog.batch_sharding)
        old = None
        if g.iterations > 1:
            with self.prog.activate():
                old = np.asarray(jax.device_get(self._old(state.params, placed(out.rows))))
        batch = placed(grpo_stage.pack(out.rows, adv, old))
        if self._train is None:
            t1 = time.perf_counter()
            self._train = self.prog.train_step.lower(state, batch).compile()
            self.compile_s += time.perf_counter() - t1
        for _ in range(g.iterations):
            state, metrics = self._train(state, batch)
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        scored = total[~np.isnan(total)]
        metrics |= {
            "reward": float(scored.mean()) if scored.size else float("nan"),
            "reward_std": float(scored.std(ddof=1)) if scored.size > 1 else 0.0,
            "unscored": int(np.isnan(total).sum()),
            "rollout_tokens_per_s": out.sampled_tokens / out.seconds,
            "generate_share": out.seconds / (time.perf_counter() - t0 - (self.compile_s - compiling)),
        }
        metrics |= {f"rewards/{k}/mean": float(np.nanmean(v)) for k, v in per.items()}
        return state, metrics


def for_run(run) -> GRPORun:
    """objective.method=grpo's driver for a training run (`jaxdist.run`'s `rollouts`): its program, the
    objective's settings, the reward functions of objective.reward (loaded now: a missing file or name is one
    line before anything is written), the run's tokenizer and EOS."""
    cfg, o = run.cfg, run.cfg.objective
    fns = {name.rpartition(":")[2]: rewards.load(name) for name in o.reward}  # TRL's metric name: the function's
    if len(fns) != len(o.reward):
        raise JaxdistError(
            f"objective.reward names two functions alike ({', '.join(o.reward)}); give each its own name"
        )
    weights = list(o.reward_weights) or [1.0] * len(fns)
    text = decode.Text(cfg, Path(cfg.data.path), recorded=run.run_tok)
    if not text.usable:
        raise JaxdistError(
            "objective.method=grpo decodes completions for the reward functions but the run has no tokenizer; "
            "prepare the prompts with --tokenizer"
        )
    eos = [] if run.run_tok.eos_id is None else [int(run.run_tok.eos_id)]
    g = objectives.grpo_settings(cfg)
    return GRPORun(cfg, run.mesh, g, fns, weights, text.decode, eos, prog=run.prog)
