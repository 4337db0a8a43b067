"""GRPO's rollout throughput against the training step's, and against `python -m jaxdist.generate`'s path,
on one model and mesh (docs/post-training.md#grpo-throughput).

    python scripts/bench/grpo_throughput.py [--mesh fsdp=4,tp=2] [--new 32] [--repeats 5]

The model is scripts/studies/grpo_recipe.py's (a random byte-level Llama, 2 layers, d_model 64, seq_len 64 here)
with its batch (64 rows: 8 prompts x group_size 8, prompts of 4 bytes). Measured, each the median of
`--repeats` runs after compiling:
- rollout: `GRPORun.sample` (the KV-cache decoder from the training state's arrays), completion tokens
  computed per second (64 x new);
- generate path: `jaxdist.inference.decode.generate` (what `python -m jaxdist.generate` runs) on the same
  params and prompts, the same count;
- GRPO train step: the compiled step on the packed batch (policy forward + backward, the reference's
  forward, AdamW), row tokens per second (64 x seq_len);
- LM train step: `objective.method=lm`'s compiled step on a batch of the same shape, tokens per second.
"""

from __future__ import annotations

import argparse
import statistics
import time

from jaxdist.distributed import platform

platform.setup_platform(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxdist import config  # noqa: E402
from jaxdist.distributed.mesh import mesh_from_string  # noqa: E402
from jaxdist.inference import decode, rollout  # noqa: E402
from jaxdist.objectives import grpo, grpo_stage, rewards  # noqa: E402
from jaxdist.training import step as step_mod  # noqa: E402

MODEL = dict(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128, seq_len=64)


def step_time(compiled, state, batch, repeats: int) -> float:
    """Median seconds of the compiled train step (it donates its state: each call takes the last one's)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mesh", default="fsdp=4,tp=2")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    cfg = config.load("tiny", [f"model.{k}={v}" for k, v in MODEL.items()] + ["train.global_batch=64"])
    mesh = mesh_from_string(args.mesh)
    g = grpo.GRPO(group_size=8, max_new_tokens=args.new)
    run = rollout.GRPORun(cfg, mesh, g, {"digits": rewards.load("digits")}, [1.0], lambda ids: "", eos=[])
    state = run.prog.init_state(0)
    prompts = [[ord(c) for c in f"{n:>3}:"] for n in range(8)]
    N = len(prompts) * g.group_size
    out = run.sample(state.params, prompts, seed=0)  # compiles
    rollout_s = statistics.median(run.sample(state.params, prompts, seed=i).seconds for i in range(args.repeats))
    rows = [p for p in prompts for _ in range(g.group_size)]
    decode.generate(cfg, state.params, run.prog.graphdef, mesh, rows, args.new, 1.0, 1.0, 0)
    generate_s = statistics.median(
        decode.generate(cfg, state.params, run.prog.graphdef, mesh, rows, args.new, 1.0, 1.0, i)[3]
        for i in range(args.repeats)
    )
    batch = jax.device_put(grpo_stage.pack(out.rows, np.ones(N, np.float32)), run.prog.batch_sharding)
    train = run.prog.train_step.lower(state, batch).compile()
    grpo_s = step_time(train, train(state, batch)[0], batch, args.repeats)
    lm = step_mod.build_program(cfg, mesh)
    lm_state = lm.init_state(0)
    tokens = jax.device_put(np.asarray(out.rows) & 0xFF, lm.batch_sharding)  # ids in range, no mask
    lm_train = lm.train_step.lower(lm_state, tokens).compile()
    lm_s = step_time(lm_train, lm_train(lm_state, tokens)[0], tokens, args.repeats)
    T = cfg.model.seq_len
    print(f"mesh {args.mesh}, {N} rows, {args.new} new tokens, seq_len {T}, median of {args.repeats}:")
    print(
        f"| rollout (GRPORun.sample) | {N * args.new / rollout_s:,.0f} completion tokens/s | {rollout_s * 1e3:.0f} ms |"
    )
    print(
        f"| generate path (decode.generate) | {N * args.new / generate_s:,.0f} completion tokens/s | {generate_s * 1e3:.0f} ms |"
    )
    print(f"| GRPO train step | {N * T / grpo_s:,.0f} row tokens/s | {grpo_s * 1e3:.0f} ms |")
    print(f"| LM train step | {N * T / lm_s:,.0f} tokens/s | {lm_s * 1e3:.0f} ms |")


if __name__ == "__main__":
    main()
