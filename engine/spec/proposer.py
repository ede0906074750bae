"""The seam for speculative decoding: a `Proposer` guesses the next tokens of sequences.

After each step the engine asks the proposer for drafts for the sequences that decode next;
the scheduler schedules them with the sequence's next token (budget and KV permitting, never
preempting anyone for them), the runner computes them in the same forward, and the sampler
keeps the prefix the target model agrees with (`engine.sample.rejection`), so output follows
the target's distribution whatever the proposer says. A wrong draft only costs compute.

Contract: `propose(seqs, num_tokens)` gets the sequences to draft for with how many drafts
each may carry (at most; the speculation policy picks the numbers, engine/spec/policy.py). It
must not mutate the sequences. It may skip any sequence (no entry = no drafts) or propose
fewer. Draft token ids must lie in the target's vocabulary; `probs`, when given, are the
distributions `[len(token_ids), vocab]` the drafts were drawn from (None means the proposer
chose them deterministically: point masses). A proposer that raises costs the step its
speculation, never a request. `forget(request_id)` is called when a request ends (finished,
aborted or failed): a proposer that keeps per-request state (a draft model's KV) frees it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.sequence import Sequence


@dataclass(slots=True)
class Draft:
    token_ids: list[int]
    probs: torch.Tensor | None = None  # [len(token_ids), vocab], rows sum to 1


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], num_tokens: dict[str, int]) -> dict[str, Draft]:
        """Drafts for some of `seqs` (each about to decode), keyed by request id, at most
        `num_tokens[request_id]` each."""
        ...

    def forget(self, request_id: str) -> None:
        """The request ended: drop whatever is kept for it."""
        ...


class NoopProposer:
    """Proposes nothing: plain decoding."""

    def propose(self, seqs: list[Sequence], num_tokens: dict[str, int]) -> dict[str, Draft]:
        return {}

    def forget(self, request_id: str) -> None:
        pass
