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

import yaml

from jaxdist.data import arrays, data_rules, tokenizer
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
    tok: tokenizer.Tok | None = None  # when kind == "tokenizer"

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

    d = cfg.data
    if d.sources:  # a mixture: one vocabulary, so one tokenizer for every source
        runs = {src.name: of_config(data_rules.source_config(cfg, src)) for src in d.sources}
        kinds = {(r.kind, r.sha256) for r in runs.values()}
        if len(kinds) > 1:
            listing = ", ".join(f"{n}: {r.kind}{f' {r.sha256[:12]}' if r.sha256 else ''}" for n, r in runs.items())
            raise JaxdistError(
                f"the sources of data.sources were tokenized differently ({listing}); their token ids must mean the "
                "same text: prepare every source with one tokenizer"
            )
        return next(iter(runs.values()))
    manifest = arrays.prepared(d.path) if d.source == "tokens" and d.path else None
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


def check_same(run: RunTokenizer, run_dir: Path) -> None:
    """The data a run (re)starts on must come from the tokenizer its run dir recorded: resumed on a folder
    re-prepared with another one, its checkpoint's token ids would mean other text while generate and
    to-hf keep using the recorded tokenizer. Refused whatever --allow-config-change says (it accepts
    another data order, not another vocabulary)."""
    folder = Path(run_dir) / FOLDER
    try:
        info = json.loads((folder / INFO).read_text())
        before = (info["kind"], info.get("sha256"))
    except (OSError, ValueError, KeyError, TypeError):
        return  # no record yet (a new run), or an unreadable one: of_run reports that in its readers
    if before != (run.kind, run.sha256):
        was = f"{before[0]} (sha256 {str(before[1])[:8]}…)" if before[1] else before[0]
        now = f"{run.kind} (sha256 {str(run.sha256)[:8]}…)" if run.sha256 else run.kind
        raise JaxdistError(
            f"{folder} records the tokenizer this run trained with, {was}, but its data now comes from {now}"
            f"{' at ' + run.source if run.source else ''}: the checkpoint's token ids would mean other text "
            f"(--allow-config-change data accepts another data order, not another vocabulary); re-run prepare "
            f"with the run's tokenizer (--tokenizer {folder}), or start a new run from this one (--restore "
            f"{run_dir} checkpoint.params_only=true and another --run-dir)"
        )


def _unrecorded(run_dir: Path) -> RunTokenizer | None:
    """A run dir without `tokenizer/jaxdist-tokenizer.json`. Its token ids are known only for byte tokens
    (its config.yaml: text without a tokenizer) or from the Hugging Face model it was imported from
    (`hf_source/`, what readers then use). Otherwise no text is encoded, decoded or exported: guessing
    bytes for a model trained on a BPE's ids gave wrong text without a word."""
    run_dir = Path(run_dir)
    if (run_dir / "hf_source" / "tokenizer.json").is_file():
        return None  # the imported model's tokenizer
    try:
        data = yaml.safe_load((run_dir / "config.yaml").read_text()).get("data") or {}
    except (OSError, ValueError, AttributeError, yaml.YAMLError):
        return None  # not a run dir jaxdist wrote: the readers say so
    if data.get("source", "text") == "text" and not data.get("tokenizer"):
        return RunTokenizer("bytes")
    trained_on = f"data.tokenizer={data['tokenizer']}" if data.get("tokenizer") else f"data.path={data.get('path')}"
    raise JaxdistError(
        f"{run_dir / FOLDER} is missing (or its {INFO}): the run trained on token ids from {trained_on}, and "
        "without its tokenizer no text can be encoded, decoded or exported; restore the folder from a copy "
        "of the run (train writes it at start)"
    )


def of_run(run_dir: Path) -> RunTokenizer | None:
    """The tokenizer recorded in `run_dir`, checked; for a run dir without one, see `_unrecorded`."""
    folder = Path(run_dir) / FOLDER
    if not (folder / INFO).is_file():
        return _unrecorded(run_dir)
    try:
        info = json.loads((folder / INFO).read_text())
        kind = info["kind"]
    except (OSError, ValueError, KeyError, TypeError):
        raise JaxdistError(f"{folder / INFO} is unreadable; restore it from the run's tokenizer") from None
    if kind != "tokenizer":
        return RunTokenizer(kind, info.get("eos_id"), source=info.get("source", ""))
    run = _load(folder, f"{folder / INFO}", info.get("sha256"))
    return dataclasses.replace(run, eos_id=info.get("eos_id", run.eos_id), bos_ids=tuple(info.get("bos_ids", ())))
