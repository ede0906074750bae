"""Incremental detokenization with stop strings: token ids in, final text out.

Two stages, each of which may hold text back:

1. **UTF-8 safety** (vLLM's prefix-offset/read-offset technique). Only a short window of ids is
   decoded each push: `ids[prefix_offset:]`, minus the text of `ids[prefix_offset:read_offset]`
   (already emitted; decoded with it so that tokenizers whose text depends on the previous token,
   such as SentencePiece's leading space, come out right). A trailing run of U+FFFD means a
   multi-byte character is still incomplete: the text before it is emitted, the run is held until
   a later token completes it. Once a window decodes cleanly, the window slides forward. Cost per
   push is two decodes of a few tokens, independent of the output length.
2. **Stop strings.** A stop string is matched across token boundaries; the text from its start
   on is dropped and `stop_hit` is reported. Text that might be the start of a stop string is
   held until it is disambiguated. When several stop strings appear, the one that *completes
   first* in the text wins (ties: the one starting first), so the result does not depend on how
   the text is split into tokens.

Invariant (tested on random token sequences): the concatenation of all `push(...).text` plus
`flush()` equals `tokenizer.decode(output_ids, skip_special_tokens=...)` truncated at the first
stop string, for byte-level BPE tokenizers (GPT-2, Llama 3, Qwen). Valid text never yields
U+FFFD; invalid bytes yield the same U+FFFD the full decode has. SentencePiece tokenizers with
byte fallback (Llama 2, Mistral) read the output after the prompt: the text equals
`decode(prompt + output)[len(decode(prompt)):]` for valid text, so the first word keeps its
leading space, as in vLLM (a plain decode of the output alone strips it); with invalid bytes
their byte-fallback decoder is not prefix-stable and the text is best effort.
`clean_up_tokenization_spaces` is never applied (transformers skips it for BPE anyway).

The engine calls `flush()` when a request ends for any reason other than a stop string (EOS,
length, abort): it releases held text. The ending token (EOS) is pushed like any other; with
`skip_special_tokens` its text is empty.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 5  # prompt tokens decoded as context for the first output token (as vLLM)
_TRIM_AT = 1024  # drop ids before the window once this many have piled up


@dataclass(slots=True)
class DetokenizerResult:
    text: str  # newly final text (possibly empty)
    stop_hit: bool  # a stop string ended the text; nothing more will be emitted

    def __iter__(self) -> Iterator[Any]:
        """Unpacks as `text, stop_hit = detok.push(ids)`."""
        return iter((self.text, self.stop_hit))


def _decoder_for(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """The cheapest exact decode: the Rust tokenizer itself when there is one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None and type(tokenizer).__module__.startswith("tokenizers"):
        backend = tokenizer  # a bare `tokenizers.Tokenizer`
    if backend is not None:
        return functools.partial(backend.decode, skip_special_tokens=skip_special_tokens)
    return functools.partial(
        tokenizer.decode,
        skip_special_tokens=skip_special_tokens,
        clean_up_tokenization_spaces=False,
    )


def _common_prefix_length(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class _StopMatcher:
    """Finds stop strings in a text stream, holding back a possible partial match."""

    __slots__ = ("_held", "_max_hold", "_stops")

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._max_hold = max((len(s) for s in self._stops), default=1) - 1
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text now final, whether a stop string was found)."""
        if not self._stops:
            return text, False
        s = self._held + text
        best: tuple[int, int] | None = None  # (end, start) of the first-completing match
        for stop in self._stops:
            # `s` held no complete match before this feed, so a stop's first occurrence is also
            # its earliest-ending one.
            start = s.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < best):
                best = (start + len(stop), start)
        if best is not None:
            self._held = ""
            return s[: best[1]], True
        keep = self._hold_length(s)
        self._held = s[len(s) - keep :]
        return s[: len(s) - keep], False

    def release(self) -> str:
        held, self._held = self._held, ""
        return held

    def _hold_length(self, s: str) -> int:
        """Length of the longest suffix of `s` that is a proper prefix of some stop string."""
        for k in range(min(len(s), self._max_hold), 0, -1):
            tail = s[-k:]
            if any(stop.startswith(tail) for stop in self._stops):
                return k
        return 0


class IncrementalDetokenizer:
    """Turns one request's output token ids into text, a push at a time (see module doc)."""

    __slots__ = (
        "_decode",
        "_emitted_in_window",
        "_finished",
        "_ids",
        "_pieces",
        "_prefix_offset",
        "_prefix_text",
        "_read_offset",
        "_stops",
        "stop_hit",
    )

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        stop: tuple[str, ...] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._decode = _decoder_for(tokenizer, skip_special_tokens)
        context, context_text = self._prompt_context(prompt_token_ids)
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = context_text  # decode(ids[prefix_offset:read_offset])
        self._emitted_in_window = 0  # chars past `_prefix_text` already emitted
        self._stops = _StopMatcher(stop)
        self._pieces: list[str] = []
        self._finished = False
        self.stop_hit = False

    def _prompt_context(self, prompt_token_ids: Sequence[int]) -> tuple[list[int], str]:
        """The longest prompt suffix (at most a few tokens) that decodes without U+FFFD: a
        suffix cut mid-character (or mid byte-fallback group) would garble the first output."""
        n = min(len(prompt_token_ids), _CONTEXT_TOKENS)
        for start in range(len(prompt_token_ids) - n, len(prompt_token_ids)):
            context = list(prompt_token_ids[start:])
            text = self._decode(context)
            if _REPLACEMENT not in text:
                return context, text
        return [], ""

    @property
    def output_text(self) -> str:
        """All text emitted so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def finished(self) -> bool:
        """True after a stop string or `flush()`; later pushes emit nothing."""
        return self._finished

    def push(self, token_ids: Sequence[int]) -> DetokenizerResult:
        """Add new output tokens; return the text that became final and whether it stopped."""
        if self._finished or not token_ids:
            return DetokenizerResult("", self.stop_hit)
        self._ids.extend(token_ids)
        text, hit = self._stops.feed(self._decode_window(final=False))
        if hit:
            self.stop_hit = self._finished = True
        if text:
            self._pieces.append(text)
        return DetokenizerResult(text, hit)

    def push_each(self, token_ids: list[int]) -> tuple[str, list[int], bool]:
        """`push` a run one token at a time, so that a stop string ends it at the token that
        completed it: (new text, tokens kept, stop string hit)."""
        pieces = []
        for i, token in enumerate(token_ids):
            piece, stop_hit = self.push([token])
            pieces.append(piece)
            if stop_hit:
                return "".join(pieces), token_ids[: i + 1], True
        return "".join(pieces), token_ids, False

    def flush(self) -> str:
        """Release all held text (incomplete characters decode to U+FFFD, as in a full decode).

        Call when the request ends for a reason other than a stop string. Held text is still
        checked for stop strings, so the output stays the full decode truncated at a stop.
        """
        if self._finished:
            return ""
        text, hit = self._stops.feed(self._decode_window(final=True))
        if not hit:
            text += self._stops.release()
        self.stop_hit = hit
        self._finished = True
        if text:
            self._pieces.append(text)
        return text

    def _decode_window(self, final: bool) -> str:
        full = self._decode(self._ids[self._prefix_offset :])
        if full.startswith(self._prefix_text):
            tail = full[len(self._prefix_text) :]
        elif final:
            tail = full[_common_prefix_length(full, self._prefix_text) :]
        else:
            # Byte-fallback tokenizers re-render earlier bytes while a character is incomplete;
            # wait until the window decodes consistently again.
            return ""
        end = len(tail.rstrip(_REPLACEMENT))
        if end < len(tail) and not final:
            out = tail[self._emitted_in_window : end]
            self._emitted_in_window = max(self._emitted_in_window, end)
            return out
        out = tail[self._emitted_in_window :]
        self._advance()
        return out

    def _advance(self) -> None:
        """The window decoded cleanly: its new tokens become the next window's prefix."""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        self._emitted_in_window = 0
        if self._prefix_offset >= _TRIM_AT:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
