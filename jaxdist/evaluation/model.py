"""lm-eval's model interface (`lm_eval.api.model.TemplateLM`) on jaxdist's sharded model.

lm-eval does the task logic; this class answers its three request kinds the way its `hf` backend
does (`lm_eval/models/huggingface.py`), so the scores agree with it:
- `loglikelihood` (context, continuation): lm-eval's own `_encode_pair` splits the tokens; the last
  `max_length + 1` tokens of context + continuation are scored, the continuation's log-probability
  summed and `is_greedy` set when every continuation token is the argmax;
- `loglikelihood_rolling` (a document): lm-eval's rolling windows of `max_length` tokens, each token
  predicted once, the first after the prefix token;
- `generate_until` (context, gen_kwargs): the context left-truncated to `max_length - max_gen_toks`,
  decoded with the KV cache (greedy unless `do_sample`), cut at the EOS token and at the first stop
  sequence (lm-eval's `postprocess_generated_text`).
Requests are sorted longest first and run `batch_size` at a time on the programs of
`jaxdist.evaluation.programs` (fixed batch, bucketed lengths). The prefix token of an empty context is
the tokenizer's BOS (a run's recorded prefix, or tokenizer_config.json's `bos_token`), else its EOS, as
the `hf` backend's `prefix_token_id`.
"""

from __future__ import annotations

import json
from pathlib import Path

from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from tokenizers import Tokenizer

from jaxdist.data import chat
from jaxdist.data import tokenizer as tokenizer_mod
from jaxdist.errors import JaxdistError
from jaxdist.evaluation.programs import Programs
from jaxdist.inference import decode

MAX_GEN_TOKS = 256  # lm-eval's default when a task names none (the hf backend's)


class Tokens:
    """Text <-> ids as lm-eval's hf backend sees them: a tokenizers.Tokenizer (its post-processor adds
    special tokens unless told not to), or bytes for a byte-level model; the BOS and EOS ids."""

    def __init__(self, tokenizer, eos_id: int, bos_id: int | None, chat_folder: Path | None):
        if tokenizer is not None:  # a copy that reads special-token text as those tokens, as transformers does
            tokenizer = Tokenizer.from_str(tokenizer.to_str())  # (a chat template's markers must become their ids)
            tokenizer.encode_special_tokens = False
        self.tokenizer, self.eos_id, self.bos_id, self.chat_folder = tokenizer, eos_id, bos_id, chat_folder

    def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        if self.tokenizer is None:
            return list(text.encode("utf-8"))
        special = True if add_special_tokens is None else add_special_tokens
        return self.tokenizer.encode(text, add_special_tokens=special).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def tokens_of(cfg, source: Path, recorded) -> Tokens:
    """The run's recorded tokenizer (with its EOS and BOS rule), else the model folder's tokenizer.json
    with config.json / generation_config.json / tokenizer_config.json's ids, else bytes."""
    if recorded is not None and recorded.kind == "tokenizer":
        tok = recorded.tok.tokenizer
        bos = recorded.bos_ids[-1] if recorded.bos_ids else None
        return Tokens(tok, int(recorded.eos_id), bos, recorded.tok.file.parent)
    if recorded is not None and recorded.kind == "unknown":
        raise JaxdistError(
            "the run trained on token files without a tokenizer, so task text cannot be encoded; "
            "train with data.tokenizer (or a prepared folder) to evaluate it"
        )
    path = Path(cfg.data.tokenizer) if getattr(cfg.data, "tokenizer", "") else source
    file = path / "tokenizer.json" if path.is_dir() else path
    tok = _read_tokenizer(file) if file.is_file() else None
    if tok is None and cfg.model.vocab_size < 256:
        raise JaxdistError(
            f"no tokenizer.json beside the model and its {cfg.model.vocab_size} tokens are fewer than bytes; "
            "put the model's tokenizer.json in its folder"
        )
    folder = file.parent if file.is_file() else None
    side = {n: _json(source / n) for n in ("config.json", "generation_config.json", "tokenizer_config.json")}
    eos = recorded.eos_id if recorded is not None and recorded.eos_id is not None else None
    for name in ("generation_config.json", "config.json"):
        value = side[name].get("eos_token_id")
        if eos is None and value is not None:
            eos = value[0] if isinstance(value, list) else value
    if eos is None and tok is not None:
        eos = next((tok.token_to_id(n) for n in tokenizer_mod.EOS_NAMES if tok.token_to_id(n) is not None), None)
    if eos is None:
        eos = 0 if tok is None else None  # a byte-level model: the separator byte ends documents
    if eos is None:
        raise JaxdistError(f"{file} names no end-of-text token; set eos_token_id in {source / 'config.json'}")
    bos_text = side["tokenizer_config.json"].get("bos_token")
    bos_text = bos_text.get("content") if isinstance(bos_text, dict) else bos_text
    bos = tok.token_to_id(bos_text) if tok is not None and isinstance(bos_text, str) else None
    return Tokens(tok, int(eos), bos, folder)


def _read_tokenizer(file: Path):
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # the Rust side raises plain Exceptions for bad JSON
        raise JaxdistError(
            f"{file} is not a tokenizers JSON file ({str(e).splitlines()[0][:120]}); restore it"
        ) from None


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        raise JaxdistError(f"{path} is not readable JSON; restore it from the model's source") from None


class JaxdistLM(TemplateLM):
    """lm-eval's LM on `Programs` (weights on the mesh) and `Tokens`."""

    def __init__(self, programs: Programs, tokens: Tokens, max_length: int, batch_size: int = 8, seed: int = 0):
        super().__init__()
        self.programs, self.tokens, self._max_length = programs, tokens, max_length
        self.batch_size, self.seed = batch_size, seed
        self._chat = None

    @property
    def eot_token_id(self) -> int:
        return self.tokens.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tokens.bos_id if self.tokens.bos_id is not None else self.tokens.eos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return "jaxdist"

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokens.encode(string, add_special_tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        rows = []
        for _, context_enc, continuation_enc in requests:
            whole = (context_enc + continuation_enc)[-(self.max_length + 1) :]
            rows.append((whole, len(continuation_enc)))
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        out: list = [None] * len(rows)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            for i, answer in zip(
                chunk, self.programs.score([rows[i] for i in chunk], self.batch_size, self.max_length)
            ):
                out[i] = answer
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for k, (string,) in enumerate(req.args for req in requests):
            for window in lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(string),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            ):
                windows.append((None, *lm_utils.make_disjoint_window(window)))
                owner.append(k)
        sums = [0.0] * len(requests)
        for k, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows)):
            sums[k] += logprob
        for req, total in zip(requests, sums):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return sums

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        args = [req.args for req in requests]
        groups: dict[str, list[int]] = {}
        for i, (_, gen_kwargs) in enumerate(args):
            if not isinstance(gen_kwargs, dict):
                raise JaxdistError(
                    f"a task's generation_kwargs must be a mapping, got {gen_kwargs!r}; fix the task YAML"
                )
            groups.setdefault(json.dumps(gen_kwargs, sort_keys=True, default=str), []).append(i)
        out: list = [None] * len(args)
        eos_text = self.tokens.decode([self.eot_token_id], skip_special_tokens=False)
        for members in groups.values():
            kwargs = normalize_gen_kwargs(args[members[0]][1], MAX_GEN_TOKS)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            new = int(kwargs.pop("max_gen_toks"))
            if not 0 < new < self.max_length:
                raise JaxdistError(
                    f"a task asks for {new} new tokens but the model's window is {self.max_length}; "
                    "set generation_kwargs.max_gen_toks below it in the task"
                )
            temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
            top_p = float(kwargs.get("top_p", 1.0)) if temperature else 1.0
            prompts = {i: self.tok_encode(args[i][0])[-(self.max_length - new) :] for i in members}
            order = sorted(members, key=lambda i: (-len(prompts[i]), args[i][0]))
            for start in range(0, len(order), self.batch_size):
                chunk = order[start : start + self.batch_size]
                new_tokens = self.programs.generate(
                    [prompts[i] for i in chunk],
                    self.batch_size,
                    self.max_length - new,
                    new,
                    temperature,
                    top_p,
                    self.seed,
                )
                for i, toks in zip(chunk, new_tokens.tolist()):
                    toks = toks[: toks.index(self.eot_token_id)] if self.eot_token_id in toks else toks
                    text = postprocess_generated_text(self.tokens.decode(toks), until, None)
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", args[i], text)
        return out

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if self._chat is None:
            if self.tokens.chat_folder is None:
                raise JaxdistError(
                    "--apply-chat-template needs the model's tokenizer folder with its chat template; drop the flag"
                )
            try:
                self._chat = chat.load(str(self.tokens.chat_folder))
            except JaxdistError as e:
                if "no chat template" not in str(e):
                    raise
                raise JaxdistError(  # chat.load's fix names prepare's --chat-template, which eval does not have
                    f"--apply-chat-template: {self.tokens.chat_folder} has no chat template (chat_template.jinja or "
                    "tokenizer_config.json's chat_template); copy the model's chat_template.jinja into it"
                ) from None
        try:
            text, _ = chat.render(self._chat, chat_history, None, add_generation_prompt=add_generation_prompt)
        except chat.BadConversation as e:
            raise JaxdistError(f"cannot build a chat prompt: {e.reason}") from None
        return text

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The template text, which lm-eval records in its results (None when not asked for)."""
        if not chat_template:
            return None
        if self._chat is None:
            self.apply_chat_template([{"role": "user", "content": ""}])  # loads self._chat
        return self._chat.text if self._chat is not None else None


def from_source(run_dir: str | None, hf: str | None, mesh_text: str, batch_size: int, seed: int = 0) -> JaxdistLM:
    """A run dir (or one of its checkpoints) or a Hugging Face model, its weights read onto the mesh."""
    recorded = decode.recorded_tokenizer(run_dir)  # checked before the weights are read
    cfg, params, graphdef, mesh, source = decode.load(run_dir, hf, mesh_text)
    tokens = tokens_of(cfg, source, recorded)
    programs = Programs(cfg, params, graphdef, mesh, decode.generation_rules(cfg))
    return JaxdistLM(programs, tokens, decode.window(cfg, source, bool(hf)), batch_size, seed)
