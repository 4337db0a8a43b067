"""Documentation generated from the dataclasses: `--help` and docs/configuration.md's key reference."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import textwrap
import tokenize

from jaxdist.config.schema import Config, _is_section, _section_types
from jaxdist.config.types import _base, _field_types, _type_name
from jaxdist.errors import JaxdistError


@functools.cache  # parsed once per process: --help and the docs table read every section
def field_docs(cls: type) -> dict[str, str]:
    """Each field's `# comment` in the class source (wherever the formatter wrapped it): the one place a
    key is documented."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").replace("noqa", "").strip()
    docs = {}
    cls_node = ast.parse(source).body[0]
    if not isinstance(cls_node, ast.ClassDef):
        raise TypeError(f"{cls!r}: field comments are read from a class definition")
    for node in cls_node.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            lines = range(node.lineno, (node.end_lineno or node.lineno) + 1)
            docs[node.target.id] = " ".join(comments[i] for i in lines if i in comments)
    return docs


def iter_keys():
    """(section.key, field type, default, doc) for every config key, in declaration order."""
    for section in dataclasses.fields(Config):
        yield from _section_keys(section.name, _section_types()[section.name])


def _section_keys(name: str, cls):
    """The keys of one section, a section inside it (reduce.topk) by its own keys after the section's."""
    docs, defaults = field_docs(cls), cls()
    types = _field_types(cls)
    for key, tp in types.items():
        if not _is_section(tp):
            yield f"{name}.{key}", (tp, getattr(defaults, key), docs.get(key, ""))
    for key, tp in types.items():
        if _is_section(tp):
            yield from _section_keys(f"{name}.{key}", tp)


def _describe_type(tp) -> str:
    base, rng = _base(tp)
    return _type_name(base) + (f" ({rng})" if rng else "")


def keys_help() -> str:
    """Every config key with its type, default and doc, for `--help`."""
    lines = ["config keys (override as section.key=value):"]
    for key, (tp, default, doc) in iter_keys():
        lines.append(f"  {key} = {default!r}  [{_describe_type(tp)}]  {doc}".rstrip())
    return "\n".join(lines)


def keys_markdown() -> str:
    """The key reference table of docs/configuration.md."""
    rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for key, (tp, default, doc) in iter_keys():
        t = _describe_type(tp).replace("|", "\\|")
        rows.append(f"| `{key}` | {t} | `{default!r}` | {doc.replace('|', '/')} |")
    return "\n".join(rows)


START, END = "<!-- config-keys:start -->\n", "\n<!-- config-keys:end -->"


def with_reference(page: str | None, name: str = "the page") -> str:
    """`page` with the table between its config-keys marks replaced by today's `keys_markdown()`."""
    if page is None or START not in page or END not in page.split(START, 1)[1]:
        raise JaxdistError(f"{name} has no '{START.strip()}' ... '{END.strip()}' marks; add them where the table goes")
    head, rest = page.split(START, 1)
    return head + START + keys_markdown() + END + rest.split(END, 1)[1]
