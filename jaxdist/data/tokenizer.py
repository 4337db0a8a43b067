"""Real tokenizers (the `tokenizers` library): load a tokenizer.json or an HF model directory, decide
BOS/EOS the way the model's tokenizer config does, encode documents for packing, train a byte-level BPE.

The document rule (`Tok.encode_documents`): each document becomes `prefix + ids + [eos]`, where
- `prefix` is what the tokenizer itself puts before a single sequence: its post-processor's leading
  special tokens (Llama 2/3's tokenizer.json: BOS; GPT-2 style byte-level BPE: nothing), unless
  tokenizer_config.json says `add_bos_token` (true: [bos_token], false: nothing), as transformers does;
- `eos` always ends a document, so packed documents are separated by exactly one EOS (the boundary that
  `data.document_mask` cuts attention at). EOS is tokenizer_config.json's (or special_tokens_map.json's)
  `eos_token`; else a token the post-processor appends; else one of the usual names (`</s>`, ...).
Special-token text inside a document (a literal "<|endoftext|>") is encoded as plain text, never as
the special id, so documents cannot forge boundaries.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jaxdist.errors import JaxdistError

CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")
CHAT_TEMPLATE = "chat_template.jinja"  # travels with the tokenizer: generate --chat reads it from the run's copy
EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]")
TRAINED_EOS = "<|endoftext|>"


@dataclasses.dataclass(frozen=True)
class Tok:
    tokenizer: Tokenizer
    file: Path  # the tokenizer.json
    config: dict  # tokenizer_config.json merged over special_tokens_map.json ({} when absent)
    prefix: tuple[int, ...]  # ids put before every document (BOS or nothing)
    eos_id: int
    vocab_size: int  # largest id + 1

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.file.read_bytes()).hexdigest()

    @property
    def dtype(self) -> str:
        return smallest_dtype(self.vocab_size)

    def encode_documents(self, texts: list[str]) -> list[np.ndarray]:
        """Each text -> int64 ids `prefix + tokens + [eos]` (no special-token parsing of the text)."""
        encodings = self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        return [np.array([*self.prefix, *e.ids, self.eos_id], dtype=np.int64) for e in encodings]

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def smallest_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def _token_text(value) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise JaxdistError(f"cannot read {path} ({e}); give a valid tokenizer file or directory")
    if not isinstance(value, dict):
        raise JaxdistError(f"{path} is not a JSON object; give a valid tokenizer file or directory")
    return value


def _locate(path: str) -> tuple[Path, Path]:
    """PATH (a tokenizer.json or a directory holding one) -> (tokenizer file, folder of its config)."""
    p = Path(path).expanduser()
    if str(path).startswith("hf:") and not p.exists():
        repo = str(path)[3:]
        raise JaxdistError(
            f"tokenizer {path}: Hub ids are not read here (train --restore, generate --hf and convert take them); "
            f"give the model's local folder: `hf download {repo}` prints it"
        )
    if p.is_dir():
        if not (p / "tokenizer.json").is_file():
            raise JaxdistError(
                f"tokenizer directory {p} has no tokenizer.json; give a Hugging Face model "
                "folder with a fast tokenizer, or the tokenizer.json itself"
            )
        return p / "tokenizer.json", p
    if not p.is_file():
        raise JaxdistError(f"tokenizer {p} not found; give a tokenizer.json or a Hugging Face model folder")
    return p, p.parent


def _id_of(tokenizer, text: str | None, what: str, file: Path) -> int | None:
    if text is None:
        return None
    i = tokenizer.token_to_id(text)
    if i is None:
        raise JaxdistError(
            f"{what} {text!r} from the tokenizer config is not in {file}'s vocabulary; fix tokenizer_config.json"
        )
    return i


def load(path: str) -> Tok:
    """A tokenizer and its BOS/EOS rule (see the module docstring) from a file or an HF model folder."""
    file, folder = _locate(path)
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as e:  # the Rust side raises plain Exceptions for bad JSON or unknown models
        raise JaxdistError(
            f"{file} is not a tokenizers JSON file ({str(e).splitlines()[0][:120]}); "
            "give the tokenizer.json of a fast tokenizer"
        )
    tokenizer.encode_special_tokens = True  # document text never turns into special ids
    config: dict = {}
    for name in reversed(CONFIG_FILES):  # tokenizer_config.json wins over special_tokens_map.json
        if (folder / name).is_file():
            config.update(_read_json(folder / name))

    # What the post-processor adds around one sequence: its leading and trailing special ids.
    plain = tokenizer.encode("a", add_special_tokens=False).ids
    full = tokenizer.encode("a", add_special_tokens=True).ids
    start = next((i for i in range(len(full)) if full[i : i + len(plain)] == plain), 0)
    lead, trail = tuple(full[:start]), tuple(full[start + len(plain) :])

    bos_id = _id_of(tokenizer, _token_text(config.get("bos_token")), "bos_token", file)
    prefix: tuple[int, ...]
    if "add_bos_token" in config:
        if config["add_bos_token"] and bos_id is None:
            raise JaxdistError(f"tokenizer config in {folder} sets add_bos_token but no bos_token; add one")
        prefix = (bos_id,) if config["add_bos_token"] and bos_id is not None else ()
    else:
        prefix = lead

    eos_id = _id_of(tokenizer, _token_text(config.get("eos_token")), "eos_token", file)
    if eos_id is None and trail:
        eos_id = trail[-1]
    if eos_id is None:
        eos_id = next((tokenizer.token_to_id(n) for n in EOS_NAMES if tokenizer.token_to_id(n) is not None), None)
    if eos_id is None:
        raise JaxdistError(
            f"tokenizer {file} has no end-of-text token to separate documents; put a "
            'tokenizer_config.json with "eos_token" beside it'
        )
    vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
    return Tok(tokenizer, file, config, prefix, eos_id, vocab_size)


def check_vocab(tok: Tok, model_vocab: int, where: str) -> None:
    """The rule: every tokenizer id must have an embedding row (a larger, padded model vocab is fine)."""
    if tok.vocab_size > model_vocab:
        raise JaxdistError(
            f"{where} has {tok.vocab_size} token ids but model.vocab_size={model_vocab}; "
            f"set model.vocab_size={tok.vocab_size} (or more, e.g. a multiple of 128)"
        )


def train_bpe(texts: Iterable[str], vocab_size: int, length: int | None = None):
    """A byte-level BPE (GPT-2 style: no unknown tokens, exact round trip) trained on `texts`; its only
    special token, `<|endoftext|>` (id 0), ends documents."""
    if vocab_size < 257:
        raise JaxdistError(
            f"--train-tokenizer {vocab_size} is too small: a byte-level BPE needs 256 byte "
            "tokens + <|endoftext|>; use 257 or more (e.g. 4096, 32000)"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[TRAINED_EOS],
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=length)
    return tokenizer


def save_trained(tokenizer, folder: Path) -> None:
    """tokenizer.json plus a tokenizer_config.json that transformers' AutoTokenizer and `load` read."""
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": TRAINED_EOS,
        "bos_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def copy_files(tok: Tok, folder: Path) -> None:
    """Put the tokenizer beside prepared shards so the folder is itself a tokenizer folder with the same
    rule: its own config files verbatim, or (a bare tokenizer.json) a config recording the rule."""
    shutil.copyfile(tok.file, folder / "tokenizer.json")
    present = [n for n in CONFIG_FILES if (tok.file.parent / n).is_file()]
    for name in present:
        shutil.copyfile(tok.file.parent / name, folder / name)
    if (tok.file.parent / CHAT_TEMPLATE).is_file():
        shutil.copyfile(tok.file.parent / CHAT_TEMPLATE, folder / CHAT_TEMPLATE)
    if not present:
        rule = {
            "eos_token": tok.tokenizer.id_to_token(tok.eos_id),
            "add_bos_token": bool(tok.prefix),
            "bos_token": tok.tokenizer.id_to_token(tok.prefix[0]) if tok.prefix else None,
        }
        (folder / "tokenizer_config.json").write_text(json.dumps(rule, indent=2) + "\n")
