"""Engine `TokenLogprob`s in the two OpenAI shapes.

Chat: `{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`.
Completions: `{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}` where
`text_offset` is the character offset of each token in the choice's text so far.
`-inf` (a token the sampler ruled out) is written as -9999.0: JSON has no infinity.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from engine.request import TokenLogprob

TokenText = Callable[[int], str]
FLOOR = -9999.0


def _finite(logprob: float) -> float:
    return logprob if logprob > FLOOR else FLOOR


def _entry(token_text: TokenText, token_id: int, logprob: float) -> dict[str, Any]:
    text = token_text(token_id)
    return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(token_text: TokenText, logprobs: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    """The `content` list of a chat choice's `logprobs`."""
    out = []
    for lp in logprobs:
        entry = _entry(token_text, lp.token_id, lp.logprob)
        entry["top_logprobs"] = [_entry(token_text, tid, tlp) for tid, tlp in lp.top]
        out.append(entry)
    return out


def completion_logprobs(
    token_text: TokenText, logprobs: Sequence[TokenLogprob], offset: int
) -> tuple[dict[str, Any], int]:
    """A completion choice's `logprobs` starting at character `offset`, and the next offset."""
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top: list[dict[str, float]] = []
    offsets: list[int] = []
    for lp in logprobs:
        text = token_text(lp.token_id)
        tokens.append(text)
        token_logprobs.append(_finite(lp.logprob))
        top.append({token_text(tid): _finite(tlp) for tid, tlp in lp.top})
        offsets.append(offset)
        offset += len(text)
    shaped = {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }
    return shaped, offset
