"""`data.*`: where the tokens come from (`DataConfig`) and a mixture's sources and stages (`SourceConfig`,
`StageConfig`). Each field's `# comment` is its documentation."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Literal

from jaxdist.config.types import Positive, Range


@dataclasses.dataclass(frozen=True)
class SourceConfig:
    """One source of a mixture (`data.sources`): a name, what `data.path` accepts, a sampling weight."""

    name: str = ""  # logged as eval_loss/NAME; unique within data.sources
    path: str = ""  # what data.path accepts: a prepared folder, token files, a text glob or folder
    weight: float = 1.0  # relative share of the batch rows (> 0); normalised over the sources
    stream: bool = (
        False  # path holds raw documents (JSONL, Parquet, Arrow, text) tokenized while training (data/stream.py)
    )
    field: str = "text"  # stream: the JSONL / Parquet / Arrow field holding each document's text
    workers: Positive = 1  # stream: tokenizing grain worker processes (1: in the loader's reader thread)
    split_files: bool = False  # stream: process p of P reads only files p, p+P, ...; batches then depend on P


@dataclasses.dataclass(frozen=True)
class StageConfig:
    """From optimizer step `step` on, the mixture's weights are `weights` (`data.stages`)."""

    step: int = 0  # the first step these weights apply to (> 0; stages in increasing order)
    weights: dict[str, float] = dataclasses.field(default_factory=dict)  # source name -> weight (>= 0); unnamed: 0


@dataclasses.dataclass(frozen=True)
class DataConfig:
    source: Literal["text", "tokens"] = (
        "text"  # text: UTF-8 files as bytes (or data.tokenizer); tokens: flat token-id files
    )
    path: str = ""  # glob or folder (a prepare output: train/ + val/); empty with source=text: the stdlib
    token_dtype: Literal["auto", "uint16", "uint32"] = (
        "auto"  # token-id files (source=tokens); auto: a prepared folder's manifest, else uint16
    )
    eval_fraction: Annotated[float, Range(0, 1, hi_open=True)] = 0.02  # tail of the stream held out for eval
    separator: Annotated[int, Range(0, 255)] = 0  # byte placed between documents (text source)
    prefetch: Positive = 2  # batches prepared ahead by background threads
    tokenizer: str = ""  # tokenizer.json or HF model folder (text source); empty: byte tokens
    document_mask: bool = False  # attention stays inside each EOS-ended document; positions restart
    sources: list[SourceConfig] = dataclasses.field(
        default_factory=list
    )  # a mixture: [{name, path, weight}, ...] instead of data.path; rows drawn by weight; stream: true reads raw documents (docs/data.md)
    stages: list[StageConfig] = dataclasses.field(
        default_factory=list
    )  # [{step: S, weights: {name: w}}, ...]: from step S on, these weights (an annealing phase)
    on_exhausted: Literal["repeat", "stop"] = (
        "repeat"  # a mixture source read to its end: repeat it reshuffled, or stop (refused at start-up)
    )
