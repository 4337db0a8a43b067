"""The Jinja environment a chat template renders in: sandboxed as transformers does, and bounded in time and size.

A chat template comes with a downloaded model or a user's file: untrusted code. jinja2's
`ImmutableSandboxedEnvironment` (what `apply_chat_template` uses) stops it reaching Python's internals, but
not from running forever or filling memory: `{% for i in range(100000) %}{% for j in range(100000) %}`
ran for more than 200 s, and the 13 characters `{{ 'a' * 300000000 }}` took `prepare --chat` to 21 GB.
So every render here has
- a time limit (`RENDER_SECONDS`): the clock is read at every loop iteration (each `{% for %}`'s iterable
  is wrapped when the template is parsed), call, attribute or item access, operator, filter and output
  block, so no loop, recursion or chain of calls outlives it;
- a size limit (`RENDER_CHARS`) on what it makes: checked *before* the operation for `*`, `+`, `%`,
  `**` and the string methods and filters that take a width or a count (`center`, `ljust`, `indent`,
  `replace`, ...), after it for every value a call, filter or attribute returns, and on the text
  rendered so far;
- Python's own limits (recursion depth, jinja2's 100,000-item `range`) turned into the same one error.

`bounded(render)` runs a render under both limits; a breach raises `TemplateBound`, which callers turn
into their one-line error (a counted skip or a stop in `prepare --chat`, an error in `generate --chat`).
"""

from __future__ import annotations

import re
import time
from contextlib import contextmanager
from contextvars import ContextVar

import jinja2
import jinja2.nodes
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

RENDER_SECONDS = 2.0  # one conversation's rendering (a real template takes well under a millisecond)
RENDER_CHARS = 16 << 20  # characters one render may produce, or hold in one value (16 Mi: ~4M tokens)
MAX_POWER_BITS = 1 << 16  # an integer `**` result of more bits is refused (10**12 is 40 bits)
ITER = "jaxdist_bounded_iter"  # the global each {% for %}'s iterable is passed through
_PERCENT_WIDTH = re.compile(r"%[#0 +-]*(\d+|\*)?(?:\.(\d+|\*))?")  # '%0300000000d', '%*d'
_BRACE_WIDTH = re.compile(r"\{[^{}]*?:[^{}]*?(\d{5,})")  # '{:>300000000}'
WIDTH_FILTERS = ("center", "indent", "truncate", "wordwrap", "batch", "slice")  # a width or a count after the value
WIDTH_METHODS = ("center", "ljust", "rjust", "zfill", "expandtabs")
SIZED = (str, bytes, list, tuple, dict)
_limits: ContextVar[tuple[float, float] | None] = ContextVar("jaxdist_template_limits", default=None)


class TemplateBound(Exception):
    """A render went past the time or size limit (or Python's): the message says which."""


def check_time() -> None:
    limits = _limits.get()
    if limits is not None and time.monotonic() > limits[0]:
        raise TemplateBound(f"it ran longer than {limits[1]:g}s (a loop or recursion without end?)")


def check_size(value, what: str = "a value"):
    if isinstance(value, SIZED) and len(value) > RENDER_CHARS:
        raise TemplateBound(f"{what} of {len(value):,} items is over the limit of {RENDER_CHARS:,}")
    return value


def _would_exceed(n: int, what: str) -> None:
    if n > RENDER_CHARS:
        raise TemplateBound(f"{what} would make {n:,} characters, over the limit of {RENDER_CHARS:,}")


def _check_ints(args, what: str) -> None:
    """Integer arguments that are widths or counts: none may ask for more than the limit."""
    for a in args:
        if isinstance(a, int) and not isinstance(a, bool) and a > RENDER_CHARS:
            _would_exceed(a, what)


def _check_format(fmt, values, what: str) -> None:
    """A format string's widths and precisions ('%0300000000d', '%*d', '{:>300000000}')."""
    if not isinstance(fmt, str):
        return
    for width, precision in _PERCENT_WIDTH.findall(fmt):
        for n in (width, precision):
            if n.isdigit():
                _would_exceed(int(n), what)
            elif n == "*":
                _check_ints(values, what)
    for n in _BRACE_WIDTH.findall(fmt):
        _would_exceed(int(n), what)


def _check_join(sep, items, what: str) -> None:
    if isinstance(items, list | tuple) and all(isinstance(x, str) for x in items):
        _would_exceed(sum(map(len, items)) + len(str(sep)) * max(len(items) - 1, 0), what)


def _check_replace(s, old, new, what: str) -> None:
    if isinstance(s, str) and isinstance(old, str) and isinstance(new, str) and old:
        _would_exceed(len(s) + s.count(old) * max(len(new) - len(old), 0), what)


def _growth(op: str, left, right) -> int | None:
    """The size of `left op right` before computing it, where it can grow."""
    if op == "*":
        if isinstance(left, SIZED) and isinstance(right, int):
            return len(left) * max(right, 0)
        if isinstance(right, SIZED) and isinstance(left, int):
            return len(right) * max(left, 0)
    if op == "+" and isinstance(left, SIZED) and isinstance(right, SIZED):
        return len(left) + len(right)
    return None


class _BoundedIter:
    """A `{% for %}`'s iterable: the clock is read at every item. Keeps len() for `loop.length`."""

    def __init__(self, iterable):
        self.iterable = iterable

    def __iter__(self):
        for x in self.iterable:
            check_time()
            yield x

    def __len__(self):
        return len(self.iterable)


def _bounded_iter(iterable):
    check_time()
    if isinstance(iterable, jinja2.Undefined):
        return iterable  # the template's own error ("'x' is undefined") when it iterates
    return _BoundedIter(iterable)


def bounded_filter(name: str, fn):
    what = f"the filter {name}"

    def run(*args, **kwargs):
        check_time()
        plain = [a for a in args if not isinstance(a, jinja2.runtime.Context | jinja2.nodes.EvalContext)]
        if name in WIDTH_FILTERS:
            _check_ints([*plain[1:], *kwargs.values()], what)
        elif name == "format" and plain:
            _check_format(plain[0], [*plain[1:], *kwargs.values()], what)
        elif name == "replace" and len(plain) >= 3:
            _check_replace(plain[0], plain[1], plain[2], what)
        elif name == "join" and plain:
            _check_join(
                plain[1] if len(plain) > 1 else kwargs.get("d", ""),
                list(plain[0]) if isinstance(plain[0], list | tuple) else None,
                what,
            )
        return check_size(fn(*args, **kwargs), f"the filter {name}'s result")

    for attr in ("jinja_pass_arg",):  # pass_context / pass_environment / pass_eval_context markers
        if hasattr(fn, attr):
            setattr(run, attr, getattr(fn, attr))
    return run


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' sandbox, with the clock and the size checked everywhere a template can spend them."""

    intercepted_binops = frozenset({"*", "+", "%", "**", "//"})

    def __init__(self, **options):
        super().__init__(**options)
        self.globals[ITER] = _bounded_iter
        self.filters = {name: bounded_filter(name, fn) for name, fn in self.filters.items()}

    def _parse(self, source, name, filename):
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(nodes.For):  # every loop reads the clock at each item
            loop.iter = nodes.Call(nodes.Name(ITER, "load"), [loop.iter], [], None, None, lineno=loop.lineno)
        return tree

    def call_binop(self, context, op, left, right):
        check_time()
        if (n := _growth(op, left, right)) is not None:
            _would_exceed(n, f"'{op}'")
        if op == "%":
            _check_format(left, right if isinstance(right, tuple) else (right,), "'%' formatting")
        big = op == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1
        if big and isinstance(right, int) and right * abs(left).bit_length() > MAX_POWER_BITS:
            raise TemplateBound(f"{left} ** {right} would be over {MAX_POWER_BITS:,} bits")
        return check_size(super().call_binop(context, op, left, right), f"the result of '{op}'")

    def call(__self, __context, __obj, *args, **kwargs):
        check_time()
        method = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
        owner, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
        if isinstance(owner, str):  # a string method: widths, counts, what it joins or replaces
            what = f"str.{name}"
            if name in WIDTH_METHODS:
                _check_ints([*args, *kwargs.values()], what)
            elif name in ("format", "format_map"):
                _check_format(owner, args, what)
            elif name == "replace" and len(args) >= 2:
                _check_replace(owner, args[0], args[1], what)
            elif name == "join" and args:
                _check_join(owner, args[0], what)
        for a in (*args, *kwargs.values()):
            check_size(a, "an argument")
        return check_size(super().call(__context, __obj, *args, **kwargs), "a call's result")

    def getattr(self, obj, attribute):
        check_time()
        return check_size(super().getattr(obj, attribute), f"the attribute {attribute}")

    def getitem(self, obj, argument):
        check_time()
        return check_size(super().getitem(obj, argument), "an item")


@contextmanager
def bounded(seconds: float | None = None):
    """Renders inside are limited to `seconds` (RENDER_SECONDS) in all; Python's own limits become
    TemplateBound too."""
    seconds = RENDER_SECONDS if seconds is None else seconds
    outer = _limits.get()  # inside another bounded render (a conversation's several): its deadline holds
    token = _limits.set(outer or (time.monotonic() + seconds, seconds))
    try:
        yield
    except RecursionError:
        raise TemplateBound("it recursed too deeply") from None
    except MemoryError:
        raise TemplateBound("it ran out of memory") from None
    except OverflowError as e:  # jinja2's range of more than 100,000 items, an int too large for a float
        raise TemplateBound(f"a number is too large ({e})") from None
    finally:
        _limits.reset(token)


def join_blocks(blocks, into: list) -> None:
    """Append the template's output blocks to `into`, checking the time and the running size at each."""
    size = 0
    for block in blocks:
        size += len(block)
        if size > RENDER_CHARS:
            raise TemplateBound(f"its output is over the limit of {RENDER_CHARS:,} characters")
        check_time()
        into.append(block)
