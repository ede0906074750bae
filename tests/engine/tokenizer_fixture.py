"""Small tokenizers trained in-process (no hub), for detokenizer tests.

`build_tokenizer()` trains on a few hundred generated sentences that mix ASCII with accented
Latin, CJK, Hangul and emoji (including ZWJ sequences and flags), so multi-byte characters are
split across tokens in many ways. It is wrapped as a transformers `PreTrainedTokenizerFast`
with special tokens `<|bos|>`, `<|eos|>`, `<|pad|>` (ids 0, 1, 2). Built once per process.

`build_sentencepiece_tokenizer()` is the other family: Llama-2 style "▁" word marks with byte
fallback (`<0xE4>` tokens for characters outside the vocabulary), whose decoder strips the
leading space of the first token, so text depends on the previous token.
"""

from __future__ import annotations

import functools
import json
import random

from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>")

_WORDS = (
    "the", "order", "arrived", "late", "please", "refund", "my", "account", "password",
    "thanks", "hello", "subscription", "support", "ticket", "shipping", "invoice",
    "café", "résumé", "naïve", "déjà", "vu", "crème", "brûlée", "Straße", "Ærø", "façade",
    "señor", "mañana", "Zürich", "Łódź", "Ελληνικά", "Привет", "мир",
    "你好", "世界", "東京", "日本語", "中文", "谢谢",
    "こんにちは", "ありがとう", "한국어", "안녕하세요",
    "🙂", "🚀", "👍🏽", "🇫🇷", "👨‍👩‍👧", "🎉", "❤️", "☕",
)  # fmt: skip
_PUNCT = (".", "!", "?", ",", "…", "。", "！")


def sentences(n: int = 400, seed: int = 0) -> list[str]:
    """`n` pseudo-random sentences over the mixed-script word list."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = rng.choices(_WORDS, k=rng.randint(3, 12))
        out.append(" ".join(words) + rng.choice(_PUNCT))
    return out


@functools.cache
def build_tokenizer(vocab_size: int = 400) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(sentences(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIAL_TOKENS[0],
        eos_token=SPECIAL_TOKENS[1],
        pad_token=SPECIAL_TOKENS[2],
        clean_up_tokenization_spaces=False,
    )


@functools.cache
def build_sentencepiece_tokenizer(vocab_size: int = 400) -> PreTrainedTokenizerFast:
    specials = ["<unk>", "<s>", "</s>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials + byte_tokens,  # reserves their ids; made normal tokens below
        limit_alphabet=40,  # rarer characters fall back to bytes
        show_progress=False,
    )
    trained = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    trained.normalizer = normalizer
    trained.train_from_iterator(sentences(), trainer=trainer)
    model = json.loads(trained.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = Tokenizer(models.BPE(model["vocab"], merges, byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizer
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        clean_up_tokenization_spaces=False,
    )
