"""The demo tokenizer: byte-level BPE trained on the corpus, saved as a transformers directory.

Chat format (what `CHAT_TEMPLATE` renders and what training encodes, token for token)::

    <|bos|><|system|>...<|end|><|user|>...<|end|><|assistant|>...<|end|>

With tools, a first system message lists them (`Tools:` then one JSON object per line); an
assistant's tool calls are written as `<tool_call>{"name": ..., "arguments": ...}</tool_call>`
and a tool's result is a `<|tool|>...<|end|>` message (`demo.tools`).

`<|end|>` closes every message and is the EOS token, so generation stops at the end of the
assistant's message. `<|pad|>` (id 0) never occurs in real text: HF `generate` infers
attention masks from the pad id, so a pad id that is also a real prompt token corrupts
outputs (callers should still pass masks explicitly). Plain `encode(text)` prepends
`<|bos|>`; the chat template writes its own, and `apply_chat_template` adds no second one.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

PAD, BOS, END, SYSTEM, USER, ASSISTANT, TOOL = (
    "<|pad|>",
    "<|bos|>",
    "<|end|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|tool|>",
)
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, END, SYSTEM, USER, ASSISTANT, TOOL)
ROLE_TOKENS = MappingProxyType(
    {"system": SYSTEM, "user": USER, "assistant": ASSISTANT, "tool": TOOL}
)

CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if tools -%}"
    "{{- '<|system|>Tools:' -}}"
    "{%- for tool in tools -%}"
    "{{- '\n' + ((tool['function'] if tool['function'] is defined else tool) | tojson) -}}"
    "{%- endfor -%}"
    "{{- '<|end|>' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] -%}"
    "{{- raise_exception('unsupported role: ' + message['role']) -}}"
    "{%- endif -%}"
    "{%- if message['content'] is string -%}"
    "{%- set ns = namespace(content=message['content']) -%}"
    "{%- elif message['content'] -%}"
    "{%- set ns = namespace(content=message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('')) -%}"
    "{%- else -%}"
    "{%- set ns = namespace(content='') -%}"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' and message['tool_calls'] -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set fn = call['function'] if call['function'] is defined else call -%}"
    "{%- set ns.content = ns.content + '<tool_call>{\"name\": ' + (fn['name'] | tojson)"
    " + ', \"arguments\": ' + (fn['arguments'] | tojson) + '}</tool_call>' -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|' + message['role'] + '|>' + ns.content + '<|end|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 1024, max_length: int = 2048) -> Any:
    """Train byte-level BPE on `texts`; returns a transformers fast tokenizer.

    `vocab_size` counts the special tokens (ids 0..6 in `SPECIAL_TOKENS` order) and the 256
    byte symbols, so every string round-trips. Deterministic for the same texts in the
    same order.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, backend.token_to_id(BOS))],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=END,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        model_max_length=max_length,
    )


def save_tokenizer(tokenizer: Any, directory: Path) -> None:
    """`save_pretrained`, then make the config loadable by older transformers too: name the
    class `PreTrainedTokenizerFast` (v5 writes `TokenizersBackend`, unknown to v4) and keep
    the chat template inside tokenizer_config.json as well as in chat_template.jinja."""
    tokenizer.save_pretrained(str(directory))
    path = directory / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["chat_template"] = CHAT_TEMPLATE
    config["add_bos_token"] = True
    path.write_text(json.dumps(config, indent=2) + "\n")


def special_ids(tokenizer: Any) -> dict[str, int]:
    return {tok: int(tokenizer.convert_tokens_to_ids(tok)) for tok in SPECIAL_TOKENS}


def encode_chats(
    tokenizer: Any, chats: Sequence[Sequence[tuple[str, str]]]
) -> list[tuple[list[int], list[bool]]]:
    """Token ids of each chat rendered with `CHAT_TEMPLATE`, and per id whether it belongs
    to an assistant message (its content or its closing `<|end|>`).

    Encodes all message contents in one batch call, which is far faster than rendering and
    tokenizing chats one by one, and gives the same ids (special tokens split pre-tokenized
    text, so a message's tokens never depend on its neighbours).
    """
    ids = special_ids(tokenizer)
    contents = [content for chat in chats for _, content in chat]
    encoded = tokenizer.backend_tokenizer.encode_batch(contents, add_special_tokens=False)
    out: list[tuple[list[int], list[bool]]] = []
    k = 0
    for chat in chats:
        tokens, mask = [ids[BOS]], [False]
        for role, _ in chat:
            body = encoded[k].ids
            k += 1
            mine = role == "assistant"
            tokens += [ids[ROLE_TOKENS[role]], *body, ids[END]]
            mask += [False] + [mine] * (len(body) + 1)
        out.append((tokens, mask))
    return out
