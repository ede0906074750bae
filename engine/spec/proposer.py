"""The seam for speculative decoding: a `Proposer` guesses the next tokens of sequences.

After each step the engine asks the proposer for drafts for the sequences that decode next;
the scheduler schedules them with the sequence's next token (budget and KV permitting, never
preempting anyone for them), the runner computes them in the same forward, and the sampler
keeps the prefix the target model agrees with (`engine.sample.rejection`), so output follows
the target's distribution whatever the proposer says. A wrong draft only costs compute.

Contract: `propose` must not mutate the sequences. It may skip any sequence (no entry = no
drafts). Draft token ids must lie in the target's vocabulary; `probs`, when given, are the
distributions `[len(token_ids), vocab]` the drafts were drawn from (None means the proposer
chose them deterministically: point masses). A proposer that raises costs the step its
speculation, never a request.
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
    def propose(self, seqs: list[Sequence]) -> dict[str, Draft]:
        """Drafts for some of `seqs` (each about to decode), keyed by request id."""
        ...


class NoopProposer:
    """Proposes nothing: plain decoding, at the cost of an empty dict per step."""

    def propose(self, seqs: list[Sequence]) -> dict[str, Draft]:
        return {}
