"""Chat conversations -> token ids + loss mask, rendered with the model's own chat template as transformers does.

The template (found, read and compiled in jaxdist/data/chat_template.py: transformers' sandboxed Jinja2
environment with the `{% generation %}` tag) is rendered like `apply_chat_template`: the tokenizer's named
special tokens (`bos_token`, `eos_token`, ...) as variables, messages with None-valued keys dropped, the
generation blocks recording where the assistant's text lies. The text is then encoded as transformers encodes it: special-token text is parsed
(the template's `<|im_start|>` becomes its id) and the tokenizer adds nothing (`add_special_tokens=False`).

Loss mask (`encode(..., loss_on="assistant")`): a token is trained on when its characters overlap
- a `{% generation %}` block, when the template has them (transformers' `return_assistant_tokens_mask`,
  the same overlap rule), else
- the prefix rule: what an assistant message adds to the rendering. For assistant message i, the text
  between `render(messages[:i], add_generation_prompt=True)` and `render(messages[:i+1])` (the answer and
  whatever the template closes the turn with, e.g. `<|eot_id|>`), provided each is a prefix of the full
  rendering; a template that renders earlier turns differently once more follow (one that drops past
  reasoning, say) is refused for that conversation, with the fix (mark it with `{% generation %}`).
`loss_on="all"`: every token. Tested against transformers' ids and masks in tests/test_chat.py.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jinja2
import numpy as np
from tokenizers import Tokenizer

from jaxdist.data import template_sandbox
from jaxdist.data import tokenizer as tokenizer_mod
from jaxdist.data.chat_template import compile_template, read_template, token_bytes
from jaxdist.errors import JaxdistError

ROLES = ("system", "user", "assistant", "tool")
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
PROBE = [  # rendered once to choose a document boundary id the template never writes
    {"role": "system", "content": "s"},
    {"role": "user", "content": "u"},
    {"role": "assistant", "content": "a"},
]


class BadConversation(Exception):
    """One conversation cannot be used: `kind` (counted in the manifest) and `reason` (reported with its line)."""

    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind, self.reason = kind, reason


@dataclasses.dataclass(frozen=True)
class ChatTokenizer:
    tok: tokenizer_mod.Tok  # ids, vocabulary, EOS rule, sha256
    parser: Tokenizer  # parses special-token text, as transformers encodes a chat
    # compiled jinja2.Template of a BoundedEnvironment (Any: its Generation extension adds track_generation)
    template: Any
    source: str  # where the template came from
    text: str  # the template's text
    variables: dict  # bos_token, eos_token, ... as strings
    max_token_bytes: int | None = None  # bytes of text one token stands for at most (None: no bound, see token_bytes)

    @property
    def marks_generation(self) -> bool:
        return bool(GENERATION_TAG.search(self.text))


def load(path: str, template_file: str | None = None) -> ChatTokenizer:
    """The tokenizer at `path` (file or HF folder) with its chat template (or `template_file`)."""
    tok = tokenizer_mod.load(path)
    text, source = read_template(tok.file.parent, template_file)
    parser = Tokenizer.from_file(str(tok.file))  # special-token text parsed: the template's tokens
    variables = {n: v for n in SPECIAL_NAMES if (v := tokenizer_mod._token_text(tok.config.get(n))) is not None}
    return ChatTokenizer(
        tok, parser, compile_template(text, source), source, text, variables, token_bytes(tok.file, parser)
    )


# ------------------------------------------------------------------------------------------- rendering


def check_messages(record) -> tuple[list[dict], list | None]:
    """A JSONL record -> (messages, tools), or BadConversation naming what is wrong."""
    if not isinstance(record, dict) or not isinstance(record.get("messages"), list):
        raise BadConversation(
            "malformed", 'no "messages" list (expected {"messages": [{"role": ..., "content": ...}, ...]})'
        )
    messages = record["messages"]
    if not messages:
        raise BadConversation("malformed", "empty messages list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadConversation("malformed", f"message {i} is not an object")
        role = m.get("role")
        if role not in ROLES:
            raise BadConversation("unknown_role", f"message {i} has unknown role {role!r} (known: {', '.join(ROLES)})")
        content = m.get("content")
        # text, content blocks (a list: the template reads them), or none beside tool calls (OpenAI style)
        if not (isinstance(content, str | list) or (content is None and m.get("tool_calls"))):
            raise BadConversation("malformed", f"message {i} ({role}) has no content (a string or a list of blocks)")
        m = {k: v for k, v in m.items() if v is not None}  # as transformers: None-valued keys are dropped
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:  # as transformers: the reasoning under each of its names
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    if not any(m["role"] == "assistant" for m in out):
        raise BadConversation("no_assistant", "no assistant message (nothing to train on)")
    tools = record.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise BadConversation("malformed", '"tools" is not a list')
    return out, tools


def render(ct: ChatTokenizer, messages: list[dict], tools=None, add_generation_prompt: bool = False):
    """(text, generation spans [(start, stop) characters]), within the sandbox's time and size limits
    (jaxdist/data/template_sandbox.py); any failure of the template is BadConversation."""
    blocks: list[str] = []
    spans: list[tuple[int, int]] = []
    try:
        with template_sandbox.bounded(), ct.template.environment.track_generation(blocks, spans):
            template_sandbox.join_blocks(
                ct.template.generate(
                    messages=messages,
                    tools=tools,
                    documents=None,
                    add_generation_prompt=add_generation_prompt,
                    **ct.variables,
                ),
                blocks,
            )
    except template_sandbox.TemplateBound as e:
        raise BadConversation("template_limit", f"the chat template was stopped: {e}") from None
    except jinja2.TemplateError as e:
        raise BadConversation("template", f"the chat template refused it: {short(e)}") from None
    except Exception as e:  # untrusted code: whatever it raises is its failure on this conversation
        raise BadConversation("template", f"the chat template failed on it ({type(e).__name__}: {short(e)})") from None
    return "".join(blocks), spans


def short(e: Exception, limit: int = 200) -> str:
    """An exception's text on one line, at most `limit` characters (a template's error may quote a huge value)."""
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def prefix_spans(ct: ChatTokenizer, messages: list[dict], tools, text: str) -> list[tuple[int, int]]:
    """The prefix rule (module docstring): the characters each assistant message adds."""
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        try:  # i = 0: what the template writes before a first message (a default system prompt, BOS)
            before = render(ct, messages[:i], tools, add_generation_prompt=True)[0]
        except BadConversation as e:
            raise BadConversation(
                "prefix_rule",
                f"the template cannot render the conversation before assistant message {i} ({e.reason}), so the "
                "prefix rule cannot find its tokens; mark the assistant part with {% generation %} in the template",
            ) from None
        through = render(ct, messages[: i + 1], tools)[0]
        if not (text.startswith(through) and through.startswith(before)):
            raise BadConversation(
                "prefix_rule",
                f"the template renders the turns before assistant message {i} differently once it follows, so "
                "the prefix rule cannot find its tokens; mark the assistant part with {% generation %} in the template",
            )
        spans.append((len(before), len(through)))
    return spans


def overlap_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for every token whose characters overlap a span (transformers' rule for assistant masks)."""
    mask = np.zeros(len(offsets), np.uint8)
    spans = sorted(s for s in spans if s[1] > s[0])
    k = 0
    for t, (start, stop) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if stop > spans[k][0]:
            mask[t] = 1
    return mask


def encode(ct: ChatTokenizer, record, loss_on: str = "assistant", max_tokens: int | None = None):
    """One conversation (a JSONL record) -> (ids int64, loss mask uint8), or BadConversation. All its renders
    share one time limit; with `max_tokens`, a rendering too long in bytes to fit is refused before it is
    encoded (a 10 MB message took 3.5 GB and 23 s to encode and then be refused)."""
    messages, tools = check_messages(record)
    with template_sandbox.bounded():
        text, spans = render(ct, messages, tools)
        if max_tokens is not None and ct.max_token_bytes is not None:
            size = len(text.encode("utf-8", errors="surrogatepass"))
            if size > max_tokens * ct.max_token_bytes:
                raise BadConversation(
                    "too_long",
                    f"it renders to {size:,} bytes, more than {max_tokens:,} tokens of this tokenizer can hold (at "
                    f"most {ct.max_token_bytes} bytes each)",
                )
        encoding = ct.parser.encode(text, add_special_tokens=False)
        ids = np.asarray(encoding.ids, np.int64)
        if loss_on == "all":
            return ids, np.ones(len(ids), np.uint8)
        if not ct.marks_generation:
            spans = prefix_spans(ct, messages, tools, text)
    mask = overlap_mask(encoding.offsets, spans)
    if not mask.any():
        raise BadConversation("no_assistant", "its assistant messages render to no tokens (nothing to train on)")
    return ids, mask


def prompt_ids(ct: ChatTokenizer, messages: list[dict], tools=None) -> list[int]:
    """The ids of `messages` with the assistant's turn opened, for generation."""
    for i, m in enumerate(messages):  # a command-line argument that was not UTF-8 holds its bytes as surrogates
        try:
            str(m.get("content", "")).encode("utf-8")
        except UnicodeEncodeError as e:
            raise JaxdistError(f"chat message {i + 1} is not UTF-8 text (at character {e.start}); give UTF-8") from None
    try:
        text, _ = render(ct, messages, tools, add_generation_prompt=True)
    except BadConversation as e:
        raise JaxdistError(f"cannot build a chat prompt with {ct.source}: {e.reason}") from None
    return ct.parser.encode(text, add_special_tokens=False).ids


def boundary_id(ct: ChatTokenizer) -> int:
    """The id that ends each conversation in the packed stream (`data.document_mask` cuts attention there): the
    tokenizer's EOS, else the first usual end-of-text or pad token, that the template does not write itself
    (Qwen's EOS `<|im_end|>` ends every turn, so its `<|endoftext|>` is used)."""
    candidates = [ct.tok.eos_id]
    for text in (*tokenizer_mod.EOS_NAMES, ct.variables.get("pad_token")):
        if text is not None and (i := ct.parser.token_to_id(text)) is not None:
            candidates.append(i)
    written: set[int] = set()
    for probe in (PROBE, PROBE[1:]):  # some templates refuse a system message
        try:
            written |= set(ct.parser.encode(render(ct, probe)[0], add_special_tokens=False).ids)
            break
        except BadConversation as e:
            if e.kind == "template_limit":  # slow or huge on three one-letter messages: the template, not the data
                raise JaxdistError(
                    f"chat template {ct.source}: {e.reason} on a 3-message probe; fix the template"
                ) from None
            continue
    for i in candidates:
        if i not in written:
            return i
    raise JaxdistError(
        f"every end-of-text token of {ct.tok.file} occurs inside a rendered chat, so none can separate "
        "conversations; add one (e.g. <|endoftext|>) to the tokenizer"
    )
