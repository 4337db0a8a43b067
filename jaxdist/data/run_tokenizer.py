"""The tokenizer a run was trained with, recorded in its run dir so every reader uses the same one.

At start-up the trainer resolves what its token ids mean (`of_config`): a prepared folder's tokenizer
(checked against the sha256 its manifest records), `data.tokenizer`, byte tokens (text without a
tokenizer), or nothing known (raw token files). It records that in `<run_dir>/tokenizer/`: the
tokenizer files (a folder `tokenizer.load` reads) and `jaxdist-tokenizer.json` (kind, EOS and BOS ids,
sha256, where it came from). `generate` encodes and decodes with it and stops at its EOS; `convert
to-hf` writes its files and its `eos_token_id`. A missing or corrupt tokenizer file is one line, in
every command.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from jaxdist.data import tokenizer
from jaxdist.errors import JaxdistError

FOLDER = "tokenizer"  # <run_dir>/tokenizer/
INFO = "jaxdist-tokenizer.json"


@dataclasses.dataclass(frozen=True)
class RunTokenizer:
    kind: str  # "tokenizer", "bytes" (token id = byte) or "unknown" (raw token files, no tokenizer named)
    eos_id: int | None = None
    bos_ids: tuple[int, ...] = ()
    sha256: str | None = None
    source: str = ""  # where it came from (a prepared folder, data.tokenizer, a Hugging Face model)
    tok: object = None  # tokenizer.Tok when kind == "tokenizer"

    def info(self) -> dict:
        return {
            "kind": self.kind,
            "eos_id": self.eos_id,
            "bos_ids": list(self.bos_ids),
            "sha256": self.sha256,
            "source": self.source,
        }


def byte_tokens(cfg) -> bool:
    """Token id = byte: the text source without a tokenizer (the only case bits/byte is meaningful)."""
    return cfg.data.source == "text" and not cfg.data.tokenizer


def _load(path: str | Path, what: str, sha256: str | None = None) -> RunTokenizer:
    tok = tokenizer.load(str(path))
    digest = tok.sha256
    if sha256 is not None and digest != sha256:
        raise JaxdistError(
            f"{tok.file} does not match the sha256 {what} recorded for it (changed or corrupted since); "
            "restore the file or re-run prepare"
        )
    return RunTokenizer("tokenizer", tok.eos_id, tuple(tok.prefix), digest, str(path), tok)


def of_config(cfg) -> RunTokenizer:
    """What this config's token ids mean, every file checked (a JaxdistError in one line otherwise)."""
    # deferred: grain, jax load on first use, not when python -m jaxdist.convert, python -m jaxdist.generate, python -m jaxdist.train starts
    from jaxdist.data import loader

    d = cfg.data
    manifest = loader.prepared(d.path) if d.source == "tokens" and d.path else None
    if manifest is not None:
        folder = Path(d.path).expanduser()
        run = _load(folder, f"{folder}/manifest.json", manifest.get("tokenizer", {}).get("sha256"))
        return dataclasses.replace(run, eos_id=int(manifest["eos_id"]), bos_ids=tuple(manifest.get("prefix_ids", [])))
    if d.tokenizer:
        return _load(d.tokenizer, "data.tokenizer")
    return RunTokenizer("bytes" if byte_tokens(cfg) else "unknown")


def record(run: RunTokenizer, run_dir: Path) -> Path:
    """Write `<run_dir>/tokenizer/` (files, then the info that makes it count). Kept if already there:
    a resumed run keeps the tokenizer it started with."""
    folder = Path(run_dir) / FOLDER
    if (folder / INFO).is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    if run.tok is not None:
        tokenizer.copy_files(run.tok, folder)
    (folder / INFO).write_text(json.dumps(run.info(), indent=2) + "\n")
    return folder


def of_run(run_dir: Path) -> RunTokenizer | None:
    """The tokenizer recorded in `run_dir`, checked; None for a run dir from before it was recorded."""
    folder = Path(run_dir) / FOLDER
    if not (folder / INFO).is_file():
        return None
    try:
        info = json.loads((folder / INFO).read_text())
        kind = info["kind"]
    except (OSError, ValueError, KeyError, TypeError):
        raise JaxdistError(f"{folder / INFO} is unreadable; restore it from the run's tokenizer") from None
    if kind != "tokenizer":
        return RunTokenizer(kind, info.get("eos_id"), source=info.get("source", ""))
    run = _load(folder, f"{folder / INFO}", info.get("sha256"))
    return dataclasses.replace(run, eos_id=info.get("eos_id", run.eos_id), bos_ids=tuple(info.get("bos_ids", ())))
