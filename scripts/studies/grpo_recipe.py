"""The GRPO "it learns" recipe on CPU: a verifiable rule reward the base model rarely earns, its mean
reward at the start and at the end, and the rollout throughput (docs/post-training.md#grpo).

    python scripts/studies/grpo_recipe.py [--steps 40] [--mesh fsdp=4,tp=2] [--out /tmp/grpo_recipe.jsonl]

The task: prompts "N:" (N in 0..199, bytes), the built-in rule reward `digits` (the share of the
completion's characters that are digits). The model is a fresh random byte-level Llama (2 layers,
d_model 64, vocab 256), so at step 0 its samples are near-uniform bytes: ~10/256 of them digits. GRPO with
TRL's defaults (dapo loss, beta 0.04, epsilon 0.2, group-scaled advantages), 8 prompts x group_size 8 = a
batch of 64 completions of 8 new tokens at temperature 1.0, AdamW lr 3e-3, on 8 simulated CPU devices.
Prints each step's reward, kl, clip_ratio, completion length and rollout tokens/s; the last line compares
the mean reward of the first and last 5 steps. Writes each step's metrics as JSON lines to --out.
"""

from __future__ import annotations

import argparse
import json
import time

from jaxdist.distributed import platform

platform.setup_platform(8)

from jaxdist import config  # noqa: E402
from jaxdist.distributed.mesh import mesh_from_string  # noqa: E402
from jaxdist.inference import decode, rollout  # noqa: E402
from jaxdist.objectives import grpo, rewards  # noqa: E402

MODEL = dict(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128, seq_len=32)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--mesh", default="fsdp=4,tp=2")
    ap.add_argument("--out", default="/tmp/grpo_recipe.jsonl")
    args = ap.parse_args()
    overrides = [f"model.{k}={v}" for k, v in MODEL.items()]
    overrides += ["train.global_batch=64", "optim.lr=3e-3", "optim.warmup_steps=2", f"train.steps={args.steps}"]
    cfg = config.load("tiny", overrides)
    mesh = mesh_from_string(args.mesh)
    g = grpo.GRPO(group_size=8, max_new_tokens=8, temperature=1.0)
    text = decode.Text(cfg, decode.Path("."))
    records = [{"ids": text.encode(f"{n}:"), "prompt": f"{n}:"} for n in range(200)]
    run = rollout.GRPORun(cfg, mesh, g, {"digits": rewards.load("digits")}, [1.0], text.decode, eos=[])
    state = run.prog.init_state(cfg.train.seed)
    per = run.prompts_per_step
    history = []
    t0 = time.perf_counter()
    with open(args.out, "w") as out:
        for i in range(args.steps):
            batch = [records[(i * per + j) % len(records)] for j in range(per)]
            state, m = run.step(state, batch, seed=i)
            m["step"] = i
            history.append(m)
            out.write(json.dumps(m) + "\n")
            print(
                f"step {i:>3}  reward {m['reward']:.3f}  reward_std {m['reward_std']:.3f}  kl {m['kl']:.4f}  "
                f"clip_ratio {m['clip_ratio']:.3f}  completion_length {m['completion_length']:.1f}  "
                f"rollout {m['rollout_tokens_per_s']:,.0f} tok/s  generate share {m['generate_share']:.2f}",
                flush=True,
            )
    start = sum(m["reward"] for m in history[:5]) / 5
    end = sum(m["reward"] for m in history[-5:]) / 5
    rate = sorted(m["rollout_tokens_per_s"] for m in history[1:])[len(history[1:]) // 2]
    print(
        f"mean reward: first 5 steps {start:.3f}, last 5 steps {end:.3f}; median rollout {rate:,.0f} tokens/s on "
        f"{args.mesh}; {time.perf_counter() - t0:.0f}s ({run.compile_s:.0f}s compiling)"
    )


if __name__ == "__main__":
    main()
