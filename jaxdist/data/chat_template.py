"""A chat template found, read and compiled as transformers does, and the most text one token stands for.

The template is the tokenizer folder's `chat_template.jinja` (what transformers 4.43+ saves), else
`tokenizer_config.json`'s `chat_template` (a string, or a list of named templates: "default"), or a file
given explicitly (`read_template`). It is compiled like `apply_chat_template`'s (`compile_template`): a
sandboxed Jinja2 environment (jaxdist/data/template_sandbox.py) with `trim_blocks` and `lstrip_blocks`,
the `loopcontrols` extension, `raise_exception`, a `tojson` that does not escape HTML, `strftime_now`, and
the `{% generation %}` tag recording where the assistant's text lies (`Generation`). Rendering and
encoding a conversation: jaxdist/data/chat.py.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.ext import Extension

from jaxdist.data import template_sandbox
from jaxdist.errors import JaxdistError

MAX_TEMPLATE_BYTES = 1 << 20  # a chat template file (real ones are a few KB)


def read_template(folder: Path, override: str | None = None) -> tuple[str, str]:
    """(template text, where it came from)."""
    if override:
        path = Path(override).expanduser()
        if not path.is_file():
            raise JaxdistError(f"--chat-template {path} not found; give a Jinja file")
        return _template_text(path), str(path)
    if (folder / "chat_template.jinja").is_file():
        return _template_text(folder / "chat_template.jinja"), str(folder / "chat_template.jinja")
    config_file = folder / "tokenizer_config.json"
    value = json.loads(_template_text(config_file)).get("chat_template") if config_file.is_file() else None
    if isinstance(value, list):  # [{"name": ..., "template": ...}, ...]: the default one
        value = next((t.get("template") for t in value if isinstance(t, dict) and t.get("name") == "default"), None)
    if not isinstance(value, str) or not value:
        raise JaxdistError(
            f"{folder} has no chat template (no chat_template.jinja, no chat_template in tokenizer_config.json); "
            "pass --chat-template FILE.jinja"
        )
    return value, f"{config_file}:chat_template"


def _template_text(path: Path) -> str:
    """A template (or the tokenizer_config.json holding one): at most MAX_TEMPLATE_BYTES of UTF-8."""
    size = path.stat().st_size
    if size > MAX_TEMPLATE_BYTES:
        raise JaxdistError(
            f"{path} is {size:,} bytes, more than a chat template's limit of {MAX_TEMPLATE_BYTES:,}; give the model's own"
        )
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise JaxdistError(
            f"{path} is not UTF-8 (byte {raw[e.start]:#04x} at offset {e.start}); save it as UTF-8"
        ) from None


class Generation(Extension):
    """The `{% generation %}` tag: records the character span of its output in the text rendered so far."""

    tags = {"generation"}

    def __init__(self, environment):
        super().__init__(environment)
        self.tracking: ContextVar[tuple[list, list] | None] = ContextVar("jaxdist_generation", default=None)
        environment.extend(track_generation=self.track)

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_span"), [], [], body).set_lineno(lineno)

    def _span(self, caller):
        text = caller()
        state = self.tracking.get()
        if state is not None:  # the blocks yielded so far are the text before this one
            blocks, spans = state
            start = sum(len(b) for b in blocks)
            spans.append((start, start + len(text)))
        return text

    @contextmanager
    def track(self, blocks: list, spans: list):
        token = self.tracking.set((blocks, spans))
        try:
            yield
        finally:
            self.tracking.reset(token)


def compile_template(text: str, where: str):
    """The Jinja environment transformers renders chat templates in (see the module docstring)."""

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = template_sandbox.BoundedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = template_sandbox.bounded_filter("tojson", tojson)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(text)
    except jinja2.TemplateSyntaxError as e:
        raise JaxdistError(f"chat template {where} line {e.lineno}: {e.message}; fix the template") from None
    except RecursionError:  # nesting deeper than the parser's recursion
        raise JaxdistError(f"chat template {where} nests too deeply to parse; fix the template") from None


SAFE_NORMALIZERS = ("NFC", "NFKC", "NFD", "NFKD", "Prepend", "Replace")


def token_bytes(file: Path, parser) -> int | None:
    """An upper bound on the bytes of text one token stands for, so that a rendering too long to fit a window is
    refused before it is encoded: 4 x the longest token's own UTF-8 text (Unicode normalization composes at
    most 3 code points into one). None where a token can stand for any amount of text: a model without a
    byte-level or byte-fallback path (an unknown-word token), or a normalizer that may delete text."""
    try:
        spec = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    model = spec.get("model") or {}
    byte_level = '"ByteLevel"' in json.dumps(spec.get("pre_tokenizer")) or model.get("byte_fallback") is True

    def safe(n) -> bool:
        if n is None:
            return True
        if n.get("type") == "Sequence":
            return all(safe(x) for x in n.get("normalizers") or [])
        return n.get("type") in SAFE_NORMALIZERS and (n.get("type") != "Replace" or bool(n.get("content")))

    if not byte_level or not safe(spec.get("normalizer")):
        return None
    return 4 * max(len(t.encode("utf-8", errors="surrogatepass")) for t in parser.get_vocab(with_added_tokens=True))
