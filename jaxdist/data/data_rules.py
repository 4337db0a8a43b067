"""What a config's data settings decide before anything is read: the source a prepared folder implies
(`data.source=tokens`), the token dtype read (the manifest decides), the id that ends a document (where
`data.document_mask` cuts attention), the config that reads one mixture source, and a batch row's width."""

from __future__ import annotations

from pathlib import Path

import jax

from jaxdist.config import Config
from jaxdist.data import prefprep, tokenizer
from jaxdist.data.arrays import prepared
from jaxdist.errors import JaxdistError


def source_of_prepared(cfg: Config, log=print) -> Config:
    """`data.path` naming a prepared folder decides the source: its token shards, never its files as text."""
    if cfg.data.source == "text" and cfg.data.path and prepared(cfg.data.path) is not None:
        if jax.process_index() == 0:
            log(f"data.path={cfg.data.path} is a prepared folder: training on its token shards (data.source=tokens)")
        return cfg.replace(data=dict(source="tokens"))
    return cfg


def resolve_token_dtype(cfg: Config) -> Config:
    """`cfg` with data.token_dtype as it is read: a prepared folder's manifest decides (another explicit
    value is an error), plain token files take uint16 for auto, and a text source reads no token
    files (auto). config.yaml then records what was read, and runs are never told apart by a dtype
    that had no effect."""
    d = cfg.data
    if d.sources:  # each source's own rule, when it is read (read_source)
        return cfg
    if d.source != "tokens":
        want = "auto"
    elif (manifest := prepared(d.path)) is not None:
        want = manifest["dtype"]
        if d.token_dtype not in ("auto", want):
            raise JaxdistError(
                f"data.token_dtype={d.token_dtype} contradicts {Path(d.path) / 'manifest.json'}, which records "
                f"{want}; drop data.token_dtype (a prepared folder's manifest decides)"
            )
    else:
        want = "uint16" if d.token_dtype == "auto" else d.token_dtype
    return cfg if want == d.token_dtype else cfg.replace(data=dict(token_dtype=want))


def mask_eos(cfg: Config) -> int | None:
    """The EOS id `data.document_mask` cuts attention at (what `step.build_program` takes as `eos_id`),
    or None when the mask is off."""
    return document_eos(cfg) if cfg.data.document_mask else None


def document_eos(cfg: Config) -> int:
    """The id that ends a document in this config's token stream (for `data.document_mask`); a mixture's
    sources must agree on it."""
    d = cfg.data
    if d.sources:
        ids = {src.name: document_eos(source_config(cfg, src)) for src in d.sources}
        if len(set(ids.values())) > 1:
            listing = ", ".join(f"{n}: {i}" for n, i in ids.items())
            raise JaxdistError(
                f"data.document_mask=true but the sources of data.sources end documents with different ids "
                f"({listing}); prepare them with one tokenizer"
            )
        return next(iter(ids.values()))
    if d.source == "text" and not d.tokenizer:
        return d.separator
    manifest = prepared(d.path) if d.source == "tokens" else None
    if manifest is not None:
        return int(manifest["eos_id"])
    if d.tokenizer:
        return tokenizer.load(d.tokenizer).eos_id
    raise JaxdistError(
        "data.document_mask=true needs the end-of-document id of these token files: set "
        "data.tokenizer, or make them with python -m jaxdist.data prepare"
    )


def source_config(cfg: Config, src) -> Config:
    """The config that reads one source of data.sources as data.path reads a path."""
    one = cfg.replace(data=dict(path=src.path, sources=[], stages=[], on_exhausted="repeat"))
    return resolve_token_dtype(source_of_prepared(one, log=lambda *a, **k: None))


def row_width(cfg: Config) -> int:
    """Tokens in one batch row: a window of model.seq_len + 1, or a preference pair's two of them."""
    return prefprep.record_length(cfg.model.seq_len) if prefprep.paired(cfg) else cfg.model.seq_len + 1
