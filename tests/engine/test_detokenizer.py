from __future__ import annotations

import random

import pytest
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from engine.output.detokenizer import IncrementalDetokenizer
from tests.engine.tokenizer_fixture import (
    build_sentencepiece_tokenizer,
    build_tokenizer,
    sentences,
)

EOS = 1
MULTIBYTE_TEXTS = (
    "café crème brûlée, déjà vu à Zürich",
    "你好世界，東京の天気はどうですか？",
    "안녕하세요 🙂🚀 👨‍👩‍👧 🇫🇷 👍🏽",
    "unseen: 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 Ωmega ∑ ∞ 🦀 ǅ",
)


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return build_tokenizer()


def encode(tok: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def byte_tokens(tok: PreTrainedTokenizerFast, data: bytes) -> list[int]:
    """One token per byte (the byte-level alphabet), whatever merges exist."""
    alphabet = bytes_to_unicode()
    return [tok.convert_tokens_to_ids(alphabet[b]) for b in data]


def stream(
    detok: IncrementalDetokenizer, ids: list[int], rng: random.Random | None = None
) -> tuple[list[str], bool]:
    """Push `ids` in chunks of 1 (or random 1..4 with `rng`) until a stop string hits."""
    pieces, i = [], 0
    while i < len(ids):
        k = rng.randint(1, 4) if rng else 1
        result = detok.push(ids[i : i + k])
        pieces.append(result.text)
        i += k
        if result.stop_hit:
            return pieces, True
    return pieces, False


def reference(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    """Char by char: cut at the stop string that completes first (ties: the earliest start)."""
    for end in range(1, len(text) + 1):
        starts = [end - len(s) for s in stops if end >= len(s) and text[end - len(s) : end] == s]
        if starts:
            return text[: min(starts)], True
    return text, False


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_multibyte_text_streams_without_replacement_chars(tok, text: str) -> None:
    ids = encode(tok, text)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # characters do span tokens
    detok = IncrementalDetokenizer(tok, encode(tok, "hello"))
    pieces, _ = stream(detok, ids)
    pieces.append(detok.flush())
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) == text == detok.output_text


def test_incomplete_character_is_held_until_complete(tok) -> None:
    ids = byte_tokens(tok, "a你".encode())  # 'a', then 0xE4 0xBD 0xA0
    detok = IncrementalDetokenizer(tok, [])
    assert [detok.push([i]).text for i in ids] == ["a", "", "", "你"]
    # An incomplete character at the end becomes U+FFFD on flush, like a full decode.
    detok = IncrementalDetokenizer(tok, [])
    assert detok.push(byte_tokens(tok, b"x\xe4\xbd")).text == "x"
    assert detok.flush() == "\ufffd" == tok.decode(byte_tokens(tok, b"\xe4\xbd"))


def test_invalid_bytes_are_released_once_text_moves_on(tok) -> None:
    ids = byte_tokens(tok, b"\xe4ok\x80\xf0\x9f\x99\x82")  # bad lead, ok, stray byte, emoji
    detok = IncrementalDetokenizer(tok, [])
    pieces, _ = stream(detok, ids)
    pieces.append(detok.flush())
    assert "".join(pieces) == tok.decode(ids) == "\ufffdok\ufffd🙂"
    assert pieces[1] == "\ufffdo"  # emitted as soon as 'o' shows the lead byte was invalid


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_token_sequences_equal_full_decode(tok, skip_special_tokens: bool) -> None:
    rng = random.Random(skip_special_tokens)
    corpus = sentences(60, seed=5) + list(MULTIBYTE_TEXTS)
    for trial in range(300):
        if trial % 2:
            ids = [rng.randrange(len(tok)) for _ in range(rng.randint(0, 30))]
        else:
            ids = encode(tok, rng.choice(corpus))
            ids.insert(rng.randint(0, len(ids)), EOS)
        prompt = [rng.randrange(len(tok)) for _ in range(rng.randint(0, 8))]
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip_special_tokens)
        pieces, _ = stream(detok, ids, rng)
        pieces.append(detok.flush())
        want = tok.decode(ids, skip_special_tokens=skip_special_tokens)
        assert "".join(pieces) == want == detok.output_text, (prompt, ids)
        if "\ufffd" not in want:
            assert not any("\ufffd" in p for p in pieces)


def test_random_sequences_with_stop_strings_equal_truncated_decode(tok) -> None:
    rng = random.Random(7)
    corpus = sentences(60, seed=6) + list(MULTIBYTE_TEXTS)
    hits = 0
    for _ in range(300):
        text = rng.choice(corpus)
        ids = encode(tok, text) if rng.random() < 0.7 else [rng.randrange(300) for _ in range(20)]
        full = tok.decode(ids, skip_special_tokens=True)
        # Stops drawn from the text itself (so they do occur), plus some that may not.
        stops = []
        for _ in range(rng.randint(1, 3)):
            a = rng.randrange(max(len(full), 1))
            stops.append(full[a : a + rng.randint(1, 5)] or "zz")
        stops.append(rng.choice(["e ", "é", "🙂", "ab", "the", "。"]))
        detok = IncrementalDetokenizer(tok, [], stop=tuple(stops))
        pieces, hit = stream(detok, ids, rng)
        if not hit:
            pieces.append(detok.flush())
        want, want_hit = reference(full, tuple(stops))
        assert ("".join(pieces), hit) == (want, want_hit), (stops, ids)
        assert detok.output_text == want
        hits += hit
    assert hits > 200


def test_stop_string_across_token_boundaries(tok) -> None:
    ids = byte_tokens(tok, b"one two STOP three")
    detok = IncrementalDetokenizer(tok, [], stop=("STOP",))
    results = [detok.push([i]) for i in ids[:12]]
    assert "".join(r.text for r in results) == "one two "
    assert [r.stop_hit for r in results] == [False] * 11 + [True]
    assert detok.push(ids[12:]).text == ""  # nothing after the stop
    assert detok.flush() == ""
    assert detok.output_text == "one two "


def test_stop_string_inside_one_multi_token_push_and_in_a_multibyte_char(tok) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=("世界",))
    text, stop_hit = detok.push(encode(tok, "你好世界, more text"))
    assert (text, stop_hit) == ("你好", True)


def test_stop_string_at_the_very_start(tok) -> None:
    detok = IncrementalDetokenizer(tok, encode(tok, "prompt"), stop=("Hel",))
    pieces, hit = stream(detok, byte_tokens(tok, b"Hello"))
    assert hit and pieces == ["", "", ""]
    assert detok.output_text == ""


def test_overlapping_stop_candidates(tok) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=("abc", "ab"))
    pieces, hit = stream(detok, byte_tokens(tok, b"xxabcd"))
    assert hit and "".join(pieces) == "xx"
    assert len(pieces) == 4  # "ab" completes at the 4th token, before "abc" could
    # The stop completing first wins even when another would start earlier.
    detok = IncrementalDetokenizer(tok, [], stop=("abcd", "c"))
    pieces, hit = stream(detok, byte_tokens(tok, b"zabcd"))
    assert hit and "".join(pieces) == "zab"


def test_partial_stop_is_held_then_released(tok) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=("STOP",))
    assert [detok.push([i]).text for i in byte_tokens(tok, b"aST")] == ["a", "", ""]
    assert detok.push(byte_tokens(tok, b"x")).text == "STx"  # disambiguated: not a stop
    assert detok.push(byte_tokens(tok, b"S")).text == ""
    assert detok.flush() == "S"  # the request ended for another reason
    assert detok.output_text == "aSTxS"
    assert not detok.stop_hit and detok.finished


def test_special_tokens_skipped_or_kept(tok) -> None:
    ids = [*encode(tok, "done"), EOS]
    skipping = IncrementalDetokenizer(tok, [])
    assert "".join(stream(skipping, ids)[0]) + skipping.flush() == "done"
    keeping = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    assert "".join(stream(keeping, ids)[0]) + keeping.flush() == "done<|eos|>"


def test_sentencepiece_byte_fallback_keeps_leading_space_and_never_splits_chars() -> None:
    sp = build_sentencepiece_tokenizer()
    rng = random.Random(3)
    corpus = sentences(40, seed=8) + list(MULTIBYTE_TEXTS)
    split_chars = 0
    for text in corpus:
        ids = encode(sp, text)
        split_chars += sum(t.startswith("<0x") for t in sp.convert_ids_to_tokens(ids))
        prompt = encode(sp, rng.choice(corpus))
        detok = IncrementalDetokenizer(sp, prompt)
        pieces, _ = stream(detok, ids, rng)
        pieces.append(detok.flush())
        # The output's first word keeps its space, as it reads after the prompt.
        want = sp.decode(prompt + ids)[len(sp.decode(prompt)) :]
        assert want.startswith(" ") and "".join(pieces) == want
        assert not any("\ufffd" in p for p in pieces)
    assert split_chars > 50  # byte-fallback tokens were exercised


class _CountingBackend:
    """Wraps a Rust tokenizer, recording how many ids each decode call sees."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.sizes: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.sizes.append(len(ids))
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)


class _CountingTokenizer:
    def __init__(self, tok: PreTrainedTokenizerFast) -> None:
        self.backend_tokenizer = _CountingBackend(tok.backend_tokenizer)


def test_work_per_token_does_not_grow_with_output_length(tok) -> None:
    counting = _CountingTokenizer(tok)
    ids = encode(tok, " ".join(sentences(60, seed=3)))
    assert len(ids) > 1500
    detok = IncrementalDetokenizer(counting, encode(tok, "a long prompt here"))
    for i in ids:
        detok.push([i])
    assert detok.output_text == tok.decode(ids)
    sizes = counting.backend_tokenizer.sizes
    assert len(sizes) <= 2 * len(ids) + 1
    assert max(sizes) <= 12
