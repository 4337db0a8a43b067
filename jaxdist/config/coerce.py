"""One config value checked against its field's type and turned into it (`coerce`): Literal choices,
YAML's bool words, numbers, names, axis rules, weights, records; and the unknown-key error with its
nearest match (`unknown_key`)."""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any, Literal

from jaxdist.config.types import YamlWord, _base, _field_types, _type_name
from jaxdist.errors import JaxdistError

YAML_BOOL_WORDS = {False: "off", True: "on"}


def coerce(key: str, value: Any, tp: Any) -> Any:
    """Check `value` against the field type; ints are accepted for floats."""
    tp, _ = _base(tp)
    origin = typing.get_origin(tp)
    if isinstance(value, YamlWord):  # off / on / yes / no: the bool for a bool field, else the word
        value = value.truth if tp is bool else str(value)
    if origin is Literal:
        return _choice(key, value, typing.get_args(tp))
    if origin is dict:
        return _weights(key, value) if typing.get_args(tp)[1] is float else _axis_rules(key, value)
    if origin is list:
        (item,) = typing.get_args(tp)
        if item is float:
            return _numbers(key, value)
        return (
            _records(key, value, item)
            if isinstance(item, type) and dataclasses.is_dataclass(item)
            else _names(key, value)
        )
    return _scalar(key, value, tp)


def _choice(key: str, value: Any, allowed: tuple) -> Any:
    if isinstance(value, bool) and YAML_BOOL_WORDS[value] in allowed:
        value = YAML_BOOL_WORDS[value]  # YAML 1.1 reads a bare off / on as a bool
    if value not in allowed:
        close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise JaxdistError(f"{key}={value!r} is not one of {', '.join(map(str, allowed))}{hint}")
    return value


def _axis_rules(key: str, value: Any) -> dict:
    """{name: [mesh axes]}; a bare name is a one-axis list, None an empty one."""
    if not isinstance(value, dict):
        raise JaxdistError(f"{key} must be a mapping, got {value!r}; write it as {{name: [axes]}} in YAML")
    out = {}
    for k, v in value.items():
        v = [] if v is None else [v] if isinstance(v, str) else v
        if not isinstance(v, (list, tuple)) or not all(isinstance(a, str) for a in v):
            raise JaxdistError(f"{key}.{k} must be a list of mesh axis names, got {v!r}")
        out[str(k)] = list(v)
    return out


def _records(key: str, value: Any, cls: type) -> list:
    """A list of mappings, each one `cls` with its fields type-checked (data.sources, data.stages)."""
    value = [] if value is None else value
    if not isinstance(value, (list, tuple)):
        raise JaxdistError(f"{key} must be a list of mappings, got {value!r}; write it as [{{...}}, {{...}}]")
    out, hints = [], _field_types(cls)
    for i, item in enumerate(value):
        if dataclasses.is_dataclass(item) and not isinstance(item, type):
            item = dataclasses.asdict(item)
        if not isinstance(item, dict):
            raise JaxdistError(f"{key}[{i}] must be a mapping of {', '.join(hints)}, got {item!r}")
        for k in item:
            if k not in hints:
                raise unknown_key(f"{key}[{i}].{k}", [f"{key}[{i}].{h}" for h in hints])
        out.append(cls(**{k: coerce(f"{key}[{i}].{k}", v, hints[k]) for k, v in item.items()}))
    return out


def _weights(key: str, value: Any) -> dict:
    """{source name: weight}: a mapping of names to numbers."""
    if not isinstance(value, dict):
        raise JaxdistError(f"{key} must be a mapping of source names to weights, got {value!r}")
    return {str(k): _scalar(f"{key}.{k}", v, float) for k, v in value.items()}


def _names(key: str, value: Any) -> list:
    value = [value] if isinstance(value, str) else [] if value is None else value
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise JaxdistError(f"{key} must be a list of names, got {value!r}; write it as [a, b]")
    return list(value)


def _numbers(key: str, value: Any) -> list:
    value = [] if value is None else value if isinstance(value, (list, tuple)) else [value]
    return [_scalar(f"{key}[{i}]", v, float) for i, v in enumerate(value)]


def _scalar(key: str, value: Any, tp: type) -> Any:
    """int, float, str or bool: ints are accepted for floats, numeric strings (YAML's "1e-3") for numbers."""
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float) and isinstance(value, str):
        try:  # YAML reads "1e-3" as a string
            return tp(value)
        except ValueError:
            pass
    if tp is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # e.g. a path like 123 is fine
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise JaxdistError(
            f"{key} must be {_type_name(tp)}, got {value!r} ({type(value).__name__}); "
            f"fix the value in your config or override"
        )
    return value


def unknown_key(key: str, known: list[str]) -> JaxdistError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"did you mean '{close[0]}'?" if close else f"known keys: {', '.join(sorted(known))}"
    return JaxdistError(f"unknown config key '{key}': {hint}")
