"""Prompt lookup: propose what followed the latest earlier occurrence of the sequence's last
n tokens (n from `max_ngram` down to `min_ngram`), in its own prompt and output. No model, no
state: it pays off when answers quote their context (summaries, code edits, RAG), and costs a
scan of the sequence per step otherwise. Drafts are point masses (`probs` None).
"""

from __future__ import annotations

from engine.sequence import Sequence
from engine.spec.proposer import Draft


def lookup(tokens: list[int], k: int, min_ngram: int, max_ngram: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier match of the longest suffix n-gram."""
    size = len(tokens)
    for n in range(min(max_ngram, size - 1), min_ngram - 1, -1):
        pattern = tokens[size - n :]
        first = pattern[0]
        # Latest start i < size - n with tokens[i:i+n] == pattern, scanning backwards.
        i = size - n - 1
        while i >= 0:
            if tokens[i] == first and tokens[i : i + n] == pattern:
                follow = tokens[i + n : i + n + k]
                if follow:
                    return follow
            i -= 1
    return []


class PromptLookupProposer:
    def __init__(self, min_ngram: int = 1, max_ngram: int = 3) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.min_ngram, self.max_ngram = min_ngram, max_ngram

    def propose(self, seqs: list[Sequence], num_tokens: dict[str, int]) -> dict[str, Draft]:
        out = {}
        for seq in seqs:
            k = num_tokens.get(seq.request_id, 0)
            if k <= 0:
                continue
            found = lookup(seq.token_ids, k, self.min_ngram, self.max_ngram)
            if found:
                out[seq.request_id] = Draft(found)
        return out

    def forget(self, request_id: str) -> None:
        pass
