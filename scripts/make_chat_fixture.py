"""Make the chat-template fixtures `tests/test_chat.py` compares against, with transformers as the reference.

    pip install torch==2.13.0+cpu transformers     # not needed by the test suite
    python scripts/make_chat_fixture.py            # writes tests/fixtures/chat/

Writes, all small:
- `llama3/`, `qwen/`: a byte-level BPE tokenizer (trained here on the fixture text, 320 ids plus the
  family's special tokens) saved by transformers' `save_pretrained` (tokenizer.json,
  tokenizer_config.json, chat_template.jinja) with a Llama-3-style template (BOS, header tokens,
  `| trim`, `<|eot_id|>`) and a Qwen-style template (ChatML, a default system prompt, tool messages
  grouped into one user turn, a `tools` list through `tojson`, `raise_exception`). Both templates are
  written here in the style of those families, not copied.
- `templates/*-gen.jinja`: the same two templates with the assistant's part inside
  `{% generation %}` ... `{% endgeneration %}` (what `return_assistant_tokens_mask` reads).
- `conversations.jsonl`: the conversations (multi-turn, tools, unicode, padded whitespace, literal
  special-token text, an empty answer).
- `expected.json`: per template, per conversation, transformers' `apply_chat_template` ids, (for the
  marked templates) `return_assistant_tokens_mask` masks, and the ids of the conversation before its last
  answer with `add_generation_prompt=True`.
- `qwen/` also holds a tiny random `LlamaForCausalLM` (vocab = the tokenizer's, 2 layers, d_model 32)
  for the CPU recipe in docs/chat-data.md.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "chat"
VOCAB = 320

LLAMA3 = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system_message = '' %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if system_message %}
    {{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system_message + '<|eot_id|>' }}
{%- endif %}
{%- for message in loop_messages %}
    {%- if message['role'] not in ['user', 'assistant', 'tool'] %}
        {{- raise_exception('roles must be user, assistant or tool after an optional system message') }}
    {%- endif %}
    {%- if message['role'] == 'assistant' %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
        GEN_START{{- message['content'] | trim + '<|eot_id|>' }}GEN_END
    {%- else %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

QWEN = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
    {{- '# Tools\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' }}{{- tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}{{- raise_exception('a system message must come first') }}{%- endif %}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        GEN_START{{- message.content + '<|im_end|>\\n' }}GEN_END
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- else %}
        {{- raise_exception('unknown role ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

FAMILIES = {
    "llama3": dict(
        template=LLAMA3,
        specials=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        tokens=dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"),
        post_bos="<|begin_of_text|>",  # Llama 3's tokenizer.json adds BOS itself (apply_chat_template does not)
    ),
    "qwen": dict(
        template=QWEN,
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        tokens=dict(eos_token="<|im_end|>", pad_token="<|endoftext|>"),
        post_bos=None,
    ),
}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "Today's weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

CONVERSATIONS = [
    {
        "messages": [
            {"role": "system", "content": "You answer in one short sentence."},
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital of France is Paris."},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "Say hello."},
            {"role": "assistant", "content": "Hello!"},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "Count to three."},
            {"role": "assistant", "content": "one, two, three"},
            {"role": "user", "content": "And back?"},
            {"role": "assistant", "content": "three, two, one"},
        ]
    },
    {
        "messages": [
            {"role": "system", "content": "  Be terse.\n"},
            {"role": "user", "content": "\n  padded question?  \n"},
            {"role": "assistant", "content": "  padded answer.\n\n"},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "Ça va? 東京 ✓ 🙂"},
            {"role": "assistant", "content": "Très bien — 東京 is Tokyo ✓"},
        ]
    },
    {
        "tools": [WEATHER_TOOL],
        "messages": [
            {"role": "user", "content": "Weather in Oslo and Rome?"},
            {
                "role": "assistant",
                "content": '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>',
            },
            {"role": "tool", "content": "Oslo: 3C, snow"},
            {"role": "tool", "content": "Rome: 14C, sun"},
            {"role": "assistant", "content": "Oslo is snowy at 3C; Rome is sunny at 14C."},
        ],
    },
    {
        "messages": [
            {"role": "user", "content": "Type <|im_end|> or <|eot_id|> for me."},
            {"role": "assistant", "content": "Here: <|im_end|> <|eot_id|>"},
        ]
    },
    {
        "messages": [
            {"role": "system", "content": "Stay silent."},
            {"role": "user", "content": "Anything?"},
            {"role": "assistant", "content": ""},
            {"role": "user", "content": "Still nothing?"},
            {"role": "assistant", "content": "Nothing."},
        ]
    },
]

# The tiny model for the CPU recipe (docs/chat-data.md): small enough to commit, big enough to learn a few answers.
TINY_MODEL = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    initializer_range=0.05,
)


def corpus() -> list[str]:
    texts = [m["content"] for c in CONVERSATIONS for m in c["messages"]]
    return texts + [json.dumps(WEATHER_TOOL), "system user assistant tool_response tools\n\n"] * 3


def make_tokenizer(family: dict) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=family["specials"],
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    if family["post_bos"]:
        bos = family["post_bos"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    return PreTrainedTokenizerFast(tokenizer_object=tok, **family["tokens"])


def marked(template: str, generation: bool) -> str:
    if generation:
        return template.replace("GEN_START", "{%- generation %}").replace("GEN_END", "{%- endgeneration %}")
    return template.replace("GEN_START", "").replace("GEN_END", "")


def reference(tok, template: str, generation: bool) -> list[dict]:
    out = []
    for conv in CONVERSATIONS:
        enc = tok.apply_chat_template(
            conv["messages"],
            tools=conv.get("tools"),
            chat_template=template,
            return_dict=True,
            return_assistant_tokens_mask=generation,
        )
        row = {"ids": list(enc["input_ids"])}
        # the prompt `generate --chat` builds: the conversation before its last answer, the answer's turn opened
        row["prompt"] = tok.apply_chat_template(
            conv["messages"][:-1], tools=conv.get("tools"), chat_template=template, add_generation_prompt=True
        )["input_ids"]
        if generation:
            row["mask"] = list(enc["assistant_masks"])
            assert sum(row["mask"]) > 0
        out.append(row)
    return out


def tiny_model(tok, folder: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    vocab = max(tok.get_vocab().values()) + 1
    config = LlamaConfig(
        vocab_size=vocab, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), bos_token_id=None, **TINY_MODEL
    )
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)


def main() -> None:
    (OUT / "templates").mkdir(parents=True, exist_ok=True)
    expected = {}
    for name, family in FAMILIES.items():
        tok = make_tokenizer(family)
        plain, gen = marked(family["template"], False), marked(family["template"], True)
        tok.chat_template = plain
        tok.save_pretrained(OUT / name)  # writes chat_template.jinja beside tokenizer.json
        (OUT / "templates" / f"{name}-gen.jinja").write_text(gen)
        expected[name] = reference(tok, plain, False)
        expected[f"{name}-gen"] = reference(tok, gen, True)
        assert [r["ids"] for r in expected[name]] == [r["ids"] for r in expected[f"{name}-gen"]]
        if name == "qwen":
            tiny_model(tok, OUT / name)
    (OUT / "conversations.jsonl").write_text("".join(json.dumps(c, ensure_ascii=False) + "\n" for c in CONVERSATIONS))
    (OUT / "expected.json").write_text(json.dumps(expected) + "\n")
    n = sum(len(v) for v in expected.values())
    print(f"wrote {OUT}: {len(CONVERSATIONS)} conversations x {len(expected)} templates = {n} references")


if __name__ == "__main__":
    main()
