"""`python -m jaxdist.generate`: KV-cache decoding with sharded weights (fsdp/tp), several prompts at once.

    python -m jaxdist.generate --run-dir runs/X --prompt "def main(" --max-new-tokens 64
    python -m jaxdist.generate --hf HF_DIR --prompt-tokens "1 450 4996" --max-new-tokens 16 --json
    python -m jaxdist.generate --run-dir runs/X --chat "What is the capital of France?" --max-new-tokens 32

Prompts are left-padded to one length; each row's positions start at its first real token and its
padding is masked out, so a batched prompt decodes as it would alone (tested against transformers run on
each prompt: the same greedy tokens, log-probabilities to 1e-4). One jitted program
runs the prefill (the whole prompt into the cache) and a `lax.scan` of single-token steps.
Text output: each prompt under `--- prompt K of N ---`, its completion under `--- completion ---`.
`--json` prints one object per prompt: `tokens` (the new ids) and `logprobs` (each chosen token's
log-probability under the model, before temperature). `--temperature 0` (the default) is greedy.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from jaxdist.distributed.platform import setup_platform
from jaxdist.errors import ArgumentParser, JaxdistError, command


def parse_args(argv):
    p = ArgumentParser(
        prog="python -m jaxdist.generate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run-dir", help="a jaxdist run dir or checkpoints/STEP (its latest checkpoint)")
    src.add_argument(
        "--hf",
        help="a Hugging Face model (Llama, Qwen2/3, Mistral, Mixtral, Qwen3-MoE...): a directory or a Hub id ORG/NAME[@REV]",
    )
    p.add_argument("--prompt", action="append", default=[], help="prompt text (repeat for a batch)")
    p.add_argument("--prompt-tokens", action="append", default=[], help='token ids "ID ID ..." (repeatable)')
    p.add_argument(
        "--chat",
        action="append",
        default=[],
        metavar="MESSAGE",
        help="a user message in the model's chat template, the assistant's turn opened (repeatable)",
    )
    p.add_argument("--max-new-tokens", type=int, required=True)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mesh", default="fsdp=-1", help="mesh for the weights, e.g. fsdp=4,tp=2")
    p.add_argument("--ignore-eos", action="store_true", help="do not cut the output after an EOS token")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt: tokens, logprobs, text")
    p.add_argument("--cpu-devices", type=int, default=8)
    args = p.parse_args(argv)
    if not args.prompt and not args.prompt_tokens and not args.chat:
        raise JaxdistError('give at least one --prompt TEXT, --chat MESSAGE or --prompt-tokens "ID ID ..."')
    if args.max_new_tokens <= 0 or not args.temperature >= 0 or not math.isfinite(args.temperature):
        raise JaxdistError(
            f"--max-new-tokens {args.max_new_tokens} --temperature {args.temperature}: --max-new-tokens must be "
            "> 0 and --temperature a finite number >= 0 (0 = greedy)"
        )
    if not 0 < args.top_p <= 1:  # NaN fails this too
        raise JaxdistError(f"--top-p {args.top_p} must be in (0, 1]")
    if args.top_p != 1 and args.temperature == 0:  # was ignored without a word
        raise JaxdistError(
            f"--top-p {args.top_p} has no effect with --temperature 0 (greedy decoding); give a --temperature > 0 "
            "to sample from the nucleus, or drop --top-p"
        )
    if not -(2**63) <= args.seed < 2**63:  # JAX's PRNG key takes a 64-bit integer
        raise JaxdistError(f"--seed {args.seed} does not fit in 64 bits; give an integer in [-2**63, 2**63)")
    return args


@command
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_platform(args.cpu_devices)
    # The library, once, here: --help and a bad flag answer before it loads.
    # deferred: flax, grain, jax, optax, orbax load on first use, not when python -m jaxdist.generate starts
    from jaxdist.inference.decode import (
        Text,
        chat_prompts,
        check_lengths,
        cut_at_eos,
        eos_ids,
        generate,
        load,
        recorded_tokenizer,
        window,
    )

    recorded = recorded_tokenizer(args.run_dir)  # checked before the weights are read
    cfg, params, graphdef, mesh, source = load(args.run_dir, args.hf, args.mesh)
    text = Text(cfg, source, recorded)
    prompts = [text.encode(t) for t in args.prompt]
    for ids in args.prompt_tokens:
        try:
            prompts.append([int(x) for x in ids.replace(",", " ").split()])
        except ValueError:
            raise JaxdistError(f"--prompt-tokens {ids!r} must be integers separated by spaces") from None
    prompts += chat_prompts(text, args.chat)
    check_lengths(prompts, args.max_new_tokens, window(cfg, source, bool(args.hf)))
    stop = set() if args.ignore_eos else eos_ids(source, recorded)  # its files checked before decoding
    new, logp, compile_s, run_s = generate(
        cfg, params, graphdef, mesh, prompts, args.max_new_tokens, args.temperature, args.top_p, args.seed
    )
    for k, (prompt, toks, lps) in enumerate(zip(prompts, new.tolist(), logp.tolist())):
        toks, lps = cut_at_eos(toks, lps, stop)
        shown, completion = text.decode(prompt), text.decode(toks)  # None without a usable tokenizer
        if args.json:
            print(json.dumps({"prompt_tokens": prompt, "tokens": toks, "logprobs": lps, "text": completion}))
        elif shown is not None and completion is not None:
            print(row(k + 1, len(prompts), shown, completion))
        else:
            print(f"{prompt} -> {toks}")
    n = new.size
    print(
        f"generated {len(prompts)} x {args.max_new_tokens} tokens in {run_s:.2f}s "
        f"({n / run_s:,.0f} tokens/s; compiled in {compile_s:.1f}s)",
        file=sys.stderr,
    )
    return 0


def row(k: int, n: int, prompt: str, completion: str) -> str:
    """One prompt and its completion as text, each under a marker line, so that rows (and a completion
    that starts mid-word or spans lines) never run together."""
    return f"--- prompt {k} of {n} ---\n{prompt}\n--- completion ---\n{completion}"


if __name__ == "__main__":
    sys.exit(main())
