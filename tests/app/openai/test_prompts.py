"""Prompt size bound: never refuses a prompt that fits; off-loop encoding of large prompts."""

from __future__ import annotations

import asyncio
import itertools
import time

from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from app.openai.prompts import NORMALIZER_SLACK, encode_text, prompt_byte_limit
from tests.app.fakes import CORPUS, chat_tokenizer


def test_byte_limit_is_a_true_lower_bound_on_tokens():
    tokenizer = chat_tokenizer()
    limit = prompt_byte_limit(tokenizer, 1)  # bytes of the longest token
    assert limit is not None and limit > 1
    texts = [*CORPUS, "Hello there!" * 50, "🙂" * 40, "<|end|>" * 10, " " * 100, "x"]
    for text in texts:
        tokens = len(tokenizer.encode(text, add_special_tokens=False))
        assert tokens * limit >= len(text.encode()), text  # tokens ≥ bytes / longest
    assert prompt_byte_limit(tokenizer, 100) == 100 * limit


def test_tokenizers_that_can_drop_text_get_no_bound():
    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=wordpiece, unk_token="[UNK]")
    assert prompt_byte_limit(tokenizer, 100) is None
    plain = prompt_byte_limit(chat_tokenizer(), 100)
    normalized = chat_tokenizer()
    normalized.backend_tokenizer.normalizer = normalizers.NFKC()
    assert prompt_byte_limit(normalized, 100) == plain * NORMALIZER_SLACK  # type: ignore[operator]


async def test_a_large_prompt_is_encoded_off_the_event_loop():
    tokenizer = chat_tokenizer()
    text = "Hello there! " * 100_000  # ~1.3 MB: encoding takes a good fraction of a second
    ticks: list[float] = []

    async def tick() -> None:
        while True:
            ticks.append(time.monotonic())
            await asyncio.sleep(0.005)

    ticker = asyncio.create_task(tick())
    started = time.monotonic()
    ids = await encode_text(tokenizer, text, None, 10**7, "prompt")
    took = time.monotonic() - started
    ticker.cancel()
    assert ids == tokenizer.encode(text)
    gaps = [b - a for a, b in itertools.pairwise(ticks)]
    assert took > 0.1 and max(gaps) < max(0.1, took / 3), (took, max(gaps))
