"""GRPO's reward functions: a registry of rule rewards, user functions from files, and the scoring call.

A reward function is called as TRL's `GRPOTrainer` calls one, so a TRL reward function works unchanged:
`NAME(prompts=[...], completions=[...], completion_ids=[...], **columns) -> list[float | None]`, one value
per completion; `prompts` and `completions` are strings (plain prompts) or message lists (conversational
prompts: each completion is `[{"role": "assistant", "content": text}]`), and every other column of the
prompt records comes as a list aligned with them (repeated over each group). `None` (and NaN) marks a
completion the function cannot score: as TRL, it leaves the group's statistics and gets advantage 0, and
the run counts it (`unscored`). A function that raises, or returns a wrong length or a non-number, stops
the run with one line naming it.

Names: a built-in below, or `FILE.py:NAME` (a user function); several with weights (`weights`), summed as
TRL's sum_then_normalize.
- `answer_match`: 1.0 when the completion's text, stripped, starts with the record's `answer` column
  (exact match of a verifiable answer), else 0.0;
- `digits`: the share of the completion's characters that are ASCII digits (a format rule).
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np

from jaxdist.errors import JaxdistError


def text_of(completion) -> str:
    """A completion's text: the string, or a conversational completion's assistant content."""
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    return str(completion)


def answer_match(prompts, completions, answer=None, **columns) -> list[float]:
    if answer is None:
        raise ValueError("answer_match needs an 'answer' column in the prompt records")
    return [float(text_of(c).strip().startswith(str(a).strip())) for c, a in zip(completions, answer)]


def digits(prompts, completions, **columns) -> list[float]:
    texts = [text_of(c) for c in completions]
    return [sum(ch.isascii() and ch.isdigit() for ch in t) / len(t) if t else 0.0 for t in texts]


BUILTIN: dict[str, Callable] = {"answer_match": answer_match, "digits": digits}


def load(name: str) -> Callable:
    """A built-in's name, or FILE.py:NAME -> the function (one-line errors for what is not there)."""
    if name in BUILTIN:
        return BUILTIN[name]
    path, sep, attr = name.rpartition(":")
    if not sep or not path.endswith(".py"):
        raise JaxdistError(
            f"reward {name!r} is neither a built-in ({', '.join(BUILTIN)}) nor FILE.py:NAME; name one of those"
        )
    if not Path(path).is_file():
        raise JaxdistError(f"reward {name}: {path} is not a file; give the path of the Python file that defines {attr}")
    spec = importlib.util.spec_from_file_location(f"jaxdist_reward_{Path(path).stem}", path)
    if spec is None or spec.loader is None:
        raise JaxdistError(f"reward {name}: {path} cannot be imported as Python; give a .py file that defines {attr}")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise JaxdistError(f"reward {name}: importing {path} failed ({type(e).__name__}: {e}); fix the file") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise JaxdistError(f"reward {name}: {path} defines no function {attr}; name a function the file defines")
    return fn


def score(
    functions: dict[str, Callable], weights: list[float], prompts: list, completions: list, columns: dict, ids=None
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """-> (weighted reward sum (N,), NaN where every function declined; {name: its rewards (N,)})."""
    n = len(completions)
    per = {}
    for name, fn in functions.items():
        try:
            got = fn(prompts=prompts, completions=completions, completion_ids=ids, **columns)
        except Exception as e:
            raise JaxdistError(
                f"reward function {name} raised {type(e).__name__}: {e}; fix it (it must not raise)"
            ) from None
        got = list(got) if isinstance(got, list | tuple | np.ndarray) else got
        if not isinstance(got, list) or len(got) != n:
            size = len(got) if isinstance(got, list) else type(got).__name__
            raise JaxdistError(
                f"reward function {name} returned {size} rewards for {n} completions; return one per completion"
            )
        values = []
        for v in got:
            if v is None:
                values.append(math.nan)
            elif isinstance(v, int | float | np.number) and not isinstance(v, bool):
                values.append(float(v))
            else:
                raise JaxdistError(f"reward function {name} returned {type(v).__name__} {v!r}; return floats (or None)")
        per[name] = np.asarray(values, np.float64)
    stacked = np.stack(list(per.values()), 1)
    total = np.nansum(stacked * np.asarray(weights, np.float64)[None, :], axis=1)
    total[np.isnan(stacked).all(1)] = math.nan  # unscorable: out of the group statistics, advantage 0
    return total, per
