"""Field types with their checks attached: `Annotated[int, Range(1)]`, `Literal[...]` choices."""

from __future__ import annotations

import dataclasses
import typing
from typing import Annotated, Any, Literal


@dataclasses.dataclass(frozen=True)
class Range:
    """A field's allowed interval, checked by `validate` (floats must also be finite)."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def holds(self, v) -> bool:
        return (self.lo is None or (v > self.lo if self.lo_open else v >= self.lo)) and (
            self.hi is None or (v < self.hi if self.hi_open else v <= self.hi)
        )

    def __str__(self) -> str:
        lo = "" if self.lo is None else f"{'>' if self.lo_open else '>='} {self.lo:g}"
        hi = "" if self.hi is None else f"{'<' if self.hi_open else '<='} {self.hi:g}"
        return " and ".join(x for x in (lo, hi) if x)


class YamlWord(str):
    """A YAML 1.1 boolean word other than true/false (`off`, `on`, `yes`, `no`), kept as written: a
    bool field reads it as the bool, any other field as the word (`reduce.method: off` is reported as
    `off`, not False)."""

    truth: bool

    def __new__(cls, text: str, truth: bool):
        word = super().__new__(cls, text)
        word.truth = truth
        return word


Positive = Annotated[int, Range(1)]
NonNegative = Annotated[int, Range(0)]
PositiveFloat = Annotated[float, Range(0, lo_open=True)]
NonNegativeFloat = Annotated[float, Range(0)]
Fraction = Annotated[float, Range(0, 1)]  # [0, 1]


def _base(tp: Any) -> tuple[Any, Range | None]:
    """(underlying type, its Range) of a field type: Annotated[int, Range(1)] -> (int, Range(1))."""
    if typing.get_origin(tp) is Annotated:
        base, *meta = typing.get_args(tp)
        return base, next((m for m in meta if isinstance(m, Range)), None)
    return tp, None


def _type_name(tp: Any) -> str:
    tp = _base(tp)[0]
    if typing.get_origin(tp) is Literal:
        return " | ".join(map(str, typing.get_args(tp)))
    return getattr(tp, "__name__", str(tp))


def _field_types(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)
