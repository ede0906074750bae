"""Prompts → token ids, bounded before the work starts and never on the event loop.

Tokenizing a few megabytes takes seconds; on the event loop that would freeze every other
stream of the process. So a prompt is first measured: when its UTF-8 length divided by the
longest token of the tokenizer (in UTF-8 bytes, `prompt_byte_limit`) already exceeds the
context, it cannot fit and is refused with 400 `context_length_exceeded` without tokenizing.
What passes is encoded in a worker thread (fast tokenizers release the GIL), unless it is so
small that the thread hop would cost more than the encoding (`INLINE_CHARS`).

The bound holds only where every token covers at most its own text: byte-level BPE or
byte-fallback vocabularies. A normalizer may compose characters (NFC/NFKC shrink text up to
3×), so a tokenizer with one gets `NORMALIZER_SLACK`; a tokenizer that can drop text or map
a whole word to one unknown token (WordPiece, whitespace pre-tokenizers) gets no byte bound.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from app.openai.chat import render_chat
from app.openai.errors import bad_request
from app.openai.schemas import ChatMessage

T = TypeVar("T")

INLINE_CHARS = 16 * 1024  # below this, encoding inline is cheaper than a thread hop
NORMALIZER_SLACK = 4


def prompt_byte_limit(tokenizer: Any, max_model_len: int) -> int | None:
    """UTF-8 bytes past which a prompt cannot fit in `max_model_len` tokens, or None when
    this tokenizer allows no such bound. Walks the vocabulary once (call once per model)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    pre = json.dumps(spec.get("pre_tokenizer"))
    lossless = (spec.get("model") or {}).get("byte_fallback") is True or '"ByteLevel"' in pre
    if not lossless:
        return None
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    longest = max((len(t.encode("utf-8", "surrogatepass")) for t in tokens if t), default=0)
    if longest == 0:
        return None
    slack = 1 if backend.normalizer is None else NORMALIZER_SLACK
    return longest * slack * max_model_len


def check_fits(text: str, limit: int | None, max_model_len: int, param: str) -> None:
    """400 `context_length_exceeded` when `text` cannot fit, measured without tokenizing."""
    if limit is None or len(text) * 4 <= limit:  # 4 ≥ UTF-8 bytes per character
        return
    size = len(text.encode("utf-8"))
    if size > limit:
        raise bad_request(
            f"the prompt is {size} bytes long, more than fits in this model's maximum context "
            f"length of {max_model_len} tokens even at the longest token",
            param,
            "context_length_exceeded",
        )


async def encode_text(
    tokenizer: Any, text: str, limit: int | None, max_model_len: int, param: str
) -> list[int]:
    """A completion prompt's ids (special tokens added as the tokenizer does)."""
    check_fits(text, limit, max_model_len, param)
    return await _off_loop(len(text), lambda: list(tokenizer.encode(text)))


async def encode_chat(
    tokenizer: Any,
    messages: Sequence[ChatMessage],
    limit: int | None,
    max_model_len: int,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """A chat prompt's ids: the chat template rendered, measured, then encoded."""
    size = sum(_chars(m.content) for m in messages) + (len(json.dumps(tools)) if tools else 0)

    def work() -> list[int]:
        text = render_chat(tokenizer, messages, tools)
        check_fits(text, limit, max_model_len, "messages")
        return list(tokenizer.encode(text, add_special_tokens=False))

    return await _off_loop(size, work)


def _chars(content: str | list[dict[str, Any]] | None) -> int:
    if isinstance(content, str):
        return len(content)
    parts = content or []
    return sum(len(p["text"]) for p in parts if isinstance(p.get("text"), str))


async def _off_loop(size: int, work: Callable[[], T]) -> T:
    if size < INLINE_CHARS:
        return work()
    return await asyncio.to_thread(work)
