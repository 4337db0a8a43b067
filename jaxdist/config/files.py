"""Config files: YAML (read as written) <- `section.key=value` overrides; shipped configs by name."""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from jaxdist.config.coerce import unknown_key
from jaxdist.config.keys import iter_keys
from jaxdist.config.schema import Config, _not_a_section, _section_types, from_dict
from jaxdist.config.types import YamlWord
from jaxdist.errors import JaxdistError


class _Loader(yaml.SafeLoader):
    """YAML without 1.1's base-60 numbers (`10:15` stays the string it looks like, not 615), and with
    `1e-3` read as the float it looks like (PyYAML wants `1.0e-3`)."""


_NUMBER_TAGS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
_Loader.yaml_implicit_resolvers = {
    ch: [(tag, rx) for tag, rx in resolvers if tag not in _NUMBER_TAGS]
    for ch, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:int",
    re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"),
    list("-+0123456789"),
)
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^(?:[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)?|[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)


class DuplicateKey(JaxdistError):
    pass


def _construct_bool(loader, node):
    text = loader.construct_scalar(node)
    return (
        text.lower() == "true" if text.lower() in ("true", "false") else YamlWord(text, text.lower() in ("yes", "on"))
    )


def _construct_mapping(loader, node, deep=False):
    """A mapping whose keys are unique: YAML's "last one wins" silently dropped the first value."""
    seen: dict = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        try:
            if key in seen:
                raise DuplicateKey(f"key {key!r} appears twice (lines {seen[key]} and {line}); keep one of them")
            seen[key] = line
        except TypeError:  # an unhashable key: PyYAML reports it itself
            pass
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_Loader.add_constructor("tag:yaml.org,2002:bool", _construct_bool)
_Loader.add_constructor("tag:yaml.org,2002:map", lambda loader, node: dict(_construct_mapping(loader, node, True)))


def yaml_load(text: str):
    return yaml.load(text, Loader=_Loader)


_SOURCE_ROOT = Path(__file__).resolve().parents[2]
# The shipped configs: configs/ of a source checkout, else the copy installed as jaxdist/configs.
CONFIGS_DIR = (
    _SOURCE_ROOT / "configs"
    if (_SOURCE_ROOT / "pyproject.toml").is_file()
    else Path(__file__).resolve().parents[1] / "configs"
)
DEFAULT_CONFIG = "tiny"


def parse_override(text: str) -> tuple[str, str, Any]:
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise JaxdistError(f"override '{text}' is not of the form section.key=value (e.g. optim.lr=1e-3)")
    key, value = text.split("=", 1)
    section, name = key.split(".", 1)
    try:
        parsed = yaml_load(value) if value != "" else ""
    except yaml.YAMLError:
        parsed = value
    return section, name, parsed


def find(name_or_path: str | Path | None) -> Path:
    """A config file: an existing path, or the name of a shipped config (`llama3-8b`), from anywhere."""
    if name_or_path is None or name_or_path == "":
        name_or_path = DEFAULT_CONFIG
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = CONFIGS_DIR / f"{path.stem if path.suffix in ('.yaml', '.yml') else path.name}.yaml"
    if (path.parent == Path(".") or path.parts[:1] == ("configs",)) and shipped.is_file():
        return shipped
    names = ", ".join(shipped_configs())
    raise JaxdistError(
        f"config file {name_or_path} not found; pass --config with an existing YAML path or "
        f"a shipped config name ({names})"
    )


def shipped_configs() -> list[str]:
    return sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml"))


def _put(raw: dict, path: list[str], value: Any) -> None:
    """raw[a][b][c] = value, making the sections on the way (reduce.topk.dgc=off: the key dgc of the
    section reduce.topk); a section written as nothing (`reduce:`) is an empty one."""
    *sections, last = path
    for part in sections:
        if not isinstance(raw.get(part), dict):
            raw[part] = {}
        raw = raw[part]
    raw[last] = value


def load(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """defaults <- YAML at `path` (a path or a shipped config name; default tiny) <- overrides like
    'train.steps=10'."""
    path = find(path)
    try:
        raw = yaml_load(path.read_text(encoding="utf-8")) or {}
    except DuplicateKey as e:
        raise JaxdistError(f"config file {path}: {e}") from None
    except UnicodeDecodeError as e:
        raise JaxdistError(f"config file {path} is not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    except yaml.YAMLError as e:
        raise JaxdistError(f"config file {path} is not valid YAML ({str(e).splitlines()[0]}); fix its syntax")
    if not isinstance(raw, dict):
        raise JaxdistError(f"config file {path} must be a mapping of sections (model:, train:, ...)")
    for name, values in raw.items():
        if name in _section_types() and values is not None and not isinstance(values, dict):
            raise _not_a_section(name, values, f" in {path}")
    given: dict[str, Any] = {}
    for text in overrides:
        section, name, value = parse_override(text)
        if section not in _section_types():
            raise unknown_key(f"{section}.{name}", [k for k, _ in iter_keys()])
        _put(raw, [section, *name.split(".")], value)
        key = f"{section}.{name}"
        if key in given and given[key] != value:  # the last wins, as for a repeated flag; said, not silent
            print(f"warning: {key} is given twice ({given[key]!r}, then {value!r}); using {value!r}", file=sys.stderr)
        given[key] = value
    return from_dict(raw)


def dump(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
