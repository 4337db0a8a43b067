"""KV-cache decoding with sharded weights (fsdp/tp), several prompts at once (the work of `python -m jaxdist.generate`).

Prompts are left-padded to one length; each row's positions start at its first real token and its
padding is masked out, so a batched prompt decodes as it would alone (tested against transformers run on
each prompt: the same greedy tokens, log-probabilities to 1e-4). One jitted program
runs the prefill (the whole prompt into the cache) and a `lax.scan` of single-token steps.
`generate` returns each new token and its log-probability under the model (before temperature);
temperature 0 is greedy. `load` reads a run's or a Hugging Face model's weights onto the mesh; `Text`
turns prompts into token ids with the tokenizer the run recorded.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tokenizers import Tokenizer

from jaxdist.checkpoint import run_params
from jaxdist.checkpoint.storage import checkpoint_dir
from jaxdist.data import chat, run_tokenizer
from jaxdist.distributed import mesh as mesh_mod
from jaxdist.distributed import sharding
from jaxdist.errors import JaxdistError
from jaxdist.hf import export, mapping, tensors
from jaxdist.hf.export import generation_config
from jaxdist.hf.hub import local_dir
from jaxdist.hf.mapping import read_json
from jaxdist.models.resolve import compute_dtype


def sample(logits_BV, key, temperature: float, top_p: float):
    """-> (token_B, logprob_B): the chosen token and its log-probability before temperature."""

    logp_BV = jax.nn.log_softmax(logits_BV, axis=-1)
    if temperature == 0:
        token_B = jnp.argmax(logits_BV, axis=-1)
    else:
        scaled_BV = logits_BV / temperature
        if top_p < 1:  # nucleus: the smallest set of most likely tokens whose probability reaches top_p
            probs_BV = jax.nn.softmax(scaled_BV, axis=-1)
            sorted_BV = jnp.sort(probs_BV, axis=-1)[:, ::-1]
            before_BV = jnp.cumsum(sorted_BV, axis=-1) - sorted_BV  # mass of strictly likelier tokens
            cutoff_B = jnp.min(jnp.where(before_BV < top_p, sorted_BV, 1.0), axis=-1, keepdims=True)
            scaled_BV = jnp.where(probs_BV >= cutoff_B, scaled_BV, -jnp.inf)
        token_B = jax.random.categorical(key, scaled_BV, axis=-1)
    return token_B, jnp.take_along_axis(logp_BV, token_B[:, None], axis=-1)[:, 0]


def decode_program(graphdef, cfg, new_tokens: int, temperature: float, top_p: float):
    """(params, tokens_BP, pad_B, key) -> (new_BN, logprobs_BN), jitted."""

    m = cfg.model
    dtype = compute_dtype(m)

    @jax.jit
    def run(params, tokens_BP, pad_B, key):
        model = nnx.merge(graphdef, params)
        B, P = tokens_BP.shape
        S = P + new_tokens
        slots_S = jnp.arange(S)
        valid_BS = slots_S[None, :] >= pad_B[:, None]  # padding never attended to
        cache_k, cache_v = model.empty_cache(B, S, dtype)  # the architecture's (MLA: the latent)
        positions_BP = jnp.maximum(jnp.arange(P)[None, :] - pad_B[:, None], 0)
        mask_BPS = valid_BS[:, None, :] & (slots_S[None, None, :] <= jnp.arange(P)[None, :, None])
        logits_BPV, ck, cv = model.decode(tokens_BP, positions_BP, cache_k, cache_v, 0, mask_BPS)
        keys = jax.random.split(key, new_tokens)
        token_B, logp_B = sample(logits_BPV[:, -1], keys[0], temperature, top_p)

        def step(carry, i):
            token_B, ck, cv = carry
            slot = P + i
            mask_B1S = (valid_BS & (slots_S[None, :] <= slot))[:, None, :]
            logits_B1V, ck, cv = model.decode(token_B[:, None], (slot - pad_B)[:, None], ck, cv, slot, mask_B1S)
            nxt_B, logp_B = sample(logits_B1V[:, 0], keys[i + 1], temperature, top_p)
            return (nxt_B, ck, cv), (nxt_B, logp_B)

        _, (rest_NB, rest_logp_NB) = jax.lax.scan(step, (token_B, ck, cv), jnp.arange(new_tokens - 1))
        new_BN = jnp.concatenate([token_B[:, None], rest_NB.T], axis=1)
        return new_BN, jnp.concatenate([logp_B[:, None], rest_logp_NB.T], axis=1)

    return run


def generation_rules(cfg) -> dict:
    """The run's rules with the batch replicated: a few prompts need not divide the data axes."""

    return {**sharding.make_rules(cfg.mesh.rules), "batch": ()}


def load(run_dir: str | None, hf_dir: str | None, mesh_text: str):
    """-> (cfg, params on the mesh, graphdef, mesh, source dir for tokenizer/eos)."""

    mesh = mesh_mod.mesh_from_string(mesh_text)
    if mesh.shape["pp"] > 1:
        raise JaxdistError(f"--mesh {mesh_text}: generation does not pipeline; use dp/fsdp/tp axes only")
    if hf_dir:
        folder = local_dir(hf_dir)  # a directory, or a Hub id through the Hugging Face cache
        cfg = mapping.hf_config(None, [], folder, mesh_text)
        export.generation_config(folder)  # its EOS ids: checked before the weights are read
        params, model = tensors.import_params(folder, cfg, mesh, generation_rules(cfg))
        return cfg, params, model.graphdef, mesh, folder
    if run_dir is None:
        raise JaxdistError("generation reads a model: pass a run directory or --hf")
    export.generation_config(checkpoint_dir(Path(run_dir))[0].parent / tensors.SOURCE)  # the imported model's
    got = run_params.read_run(Path(run_dir), mesh, generation_rules, log=lambda m: print(m, file=sys.stderr))
    return got.cfg, got.params, got.model.graphdef, mesh, got.run_dir / "hf_source"


class Text:
    """Prompt text <-> token ids: the tokenizer the run recorded (`jaxdist.data.run_tokenizer`), else the
    run's data.tokenizer or the imported model's tokenizer.json, else bytes (the byte-level model)."""

    def __init__(self, cfg, source: Path, recorded=None):
        self.tokenizer, self.bos_ids = None, None  # bos_ids: the recorded training rule, when there is one
        self.vocab, self.unknown = cfg.model.vocab_size, False
        if recorded is not None and recorded.kind == "tokenizer":
            self.tokenizer, self.bos_ids = recorded.tok.tokenizer, tuple(recorded.bos_ids)
            self.folder = recorded.tok.file.parent  # its chat template, for --chat
            self.usable = True
            return
        path = getattr(cfg.data, "tokenizer", "") or ""
        path = Path(path) if path else source
        if path.is_dir():
            path = path / "tokenizer.json"
        self.folder = path.parent if path.is_file() else None  # its chat template, for --chat
        if path.is_file():
            try:
                self.tokenizer = Tokenizer.from_file(str(path))
            except Exception as e:  # the Rust side raises plain Exceptions for bad JSON
                raise JaxdistError(
                    f"{path} is not a tokenizers JSON file ({str(e).splitlines()[0][:120]}); restore the "
                    "run's tokenizer.json"
                ) from None
        elif recorded is not None and recorded.kind == "unknown":
            self.unknown = True  # raw token files: nothing says what the ids are
        self.usable = self.tokenizer is not None or (cfg.model.vocab_size >= 256 and not self.unknown)

    def encode(self, text: str) -> list[int]:
        if not self.usable:
            why = (
                "the run trained on token files without a tokenizer (set data.tokenizer to train with one)"
                if self.unknown
                else f"the model has {self.vocab} tokens (fewer than bytes) and no tokenizer.json was found"
            )
            raise JaxdistError(f"--prompt needs a tokenizer: {why}; pass --prompt-tokens")
        if self.tokenizer is None:
            return list(text.encode("utf-8"))
        if self.bos_ids is not None:  # the training rule: the recorded prefix, then the text's own tokens
            return [*self.bos_ids, *self.tokenizer.encode(text, add_special_tokens=False).ids]
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str | None:
        if not self.usable:
            return None
        if self.tokenizer:
            return self.tokenizer.decode(ids)
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def chat_prompts(text: Text, messages: list[str]) -> list[list[int]]:
    """Each user message rendered with the tokenizer folder's chat template, ready for the answer
    (as transformers' `apply_chat_template(..., add_generation_prompt=True)`)."""
    if not messages:
        return []
    if text.folder is None:
        raise JaxdistError("--chat needs the model's tokenizer folder (with its chat template); use --prompt")

    try:
        ct = chat.load(str(text.folder))
    except JaxdistError as e:
        if "no chat template" not in str(e):
            raise
        # chat.load's fix names prepare's --chat-template, which generate does not have
        raise JaxdistError(
            f"{text.folder} has no chat template (chat_template.jinja or tokenizer_config.json's chat_template); "
            "copy the model's chat_template.jinja into it, or use --prompt"
        ) from None
    return [chat.prompt_ids(ct, [{"role": "user", "content": m}]) for m in messages]


def eos_ids(source: Path, recorded=None) -> set[int]:
    ids: set[int] = set()
    if recorded is not None and recorded.eos_id is not None:
        ids.add(int(recorded.eos_id))

    generation = generation_config(source) or {}  # checked: JSON, token ids that are ids
    config = source / "config.json"
    for value in (
        generation.get("eos_token_id"),
        read_json(config, "config.json").get("eos_token_id") if config.is_file() else None,
    ):
        ids |= {i for i in (value if isinstance(value, list) else [value]) if isinstance(i, int)}
    return ids


def recorded_tokenizer(run_dir: str | None):
    """The tokenizer a run dir recorded (checked), None for --hf or a run dir from before recording."""
    if not run_dir:
        return None

    directory, _ = checkpoint_dir(Path(run_dir))
    return run_tokenizer.of_run(directory.parent)


def window(cfg, source: Path, hf: bool) -> int:
    """The most positions the model is meant for: config.json's max_position_embeddings (an HF model,
    or the one a run was imported from), else the window the run was trained at."""

    path = source / "config.json"
    declared = read_json(path, "config.json").get("max_position_embeddings") if path.is_file() else None
    declared = declared if isinstance(declared, int) and declared > 0 else None
    if hf:
        return declared or cfg.model.seq_len
    return max(cfg.model.seq_len, declared or 0)


def check_lengths(prompts: list[list[int]], new_tokens: int, limit: int) -> None:
    longest = max(len(p) for p in prompts)
    if longest + new_tokens > limit:
        raise JaxdistError(
            f"a prompt of {longest} tokens + --max-new-tokens {new_tokens} = {longest + new_tokens} positions, "
            f"more than the {limit} this model is meant for (its training window / max_position_embeddings); "
            "shorten the prompt or lower --max-new-tokens"
        )


def cut_at_eos(tokens: list[int], logprobs: list[float], stop: set[int]):
    """Keep the tokens up to and including the first EOS."""
    cut = next((i + 1 for i, t in enumerate(tokens) if t in stop), len(tokens))
    return tokens[:cut], logprobs[:cut]


def generate(
    cfg,
    params,
    graphdef,
    mesh,
    prompts: list[list[int]],
    new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
):
    """-> (new tokens (B, N), logprobs (B, N), seconds compiling, seconds running) as numpy."""

    V = cfg.model.vocab_size
    for p in prompts:
        if not p or min(p) < 0 or max(p) >= V:
            raise JaxdistError(f"prompt {p[:8]}... must be non-empty with token ids in [0, {V}); check the prompt")
    P = max(len(p) for p in prompts)
    tokens = np.zeros((len(prompts), P), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, P - len(p) :] = p
    pad = np.array([P - len(p) for p in prompts], np.int32)
    run = decode_program(graphdef, cfg, new_tokens, temperature, top_p)
    key = jax.random.key(seed)

    with sharding.activate(mesh, generation_rules(cfg)):  # the layers' constraints, batch replicated
        t0 = time.perf_counter()
        compiled = run.lower(params, tokens, pad, key).compile()
        t1 = time.perf_counter()
        new, logp = jax.device_get(compiled(params, tokens, pad, key))
        t2 = time.perf_counter()
    return np.asarray(new), np.asarray(logp), t1 - t0, t2 - t1
