"""The scheduler's per-step output: which tokens of which sequences are computed this step.

There is no prefill phase: every scheduled sequence catches `num_computed_tokens` (tokens
whose K/V sit in the cache) up towards `num_tokens`. A chunk that reaches the end samples;
a chunk that stops short (chunked prefill) samples nothing.

Speculative tokens are just more tokens to catch up (vLLM's `num_tokens_with_spec`): a
sampling chunk may carry `spec_token_ids`, drafts computed after the sequence's real tokens.
It yields `len(spec_token_ids) + 1` rows of logits and, after verification, 1 to
`len(spec_token_ids) + 1` new tokens; only the accepted drafts' K/V stay valid.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sequence import Sequence


@dataclass(slots=True)
class ScheduledChunk:
    """`num_tokens` tokens of `seq`, starting at position `start`, computed this step, then
    the drafts `spec_token_ids` at the positions that follow (only on a sampling chunk)."""

    seq: Sequence
    start: int
    num_tokens: int
    spec_token_ids: tuple[int, ...] = ()

    @property
    def num_tokens_with_spec(self) -> int:
        return self.num_tokens + len(self.spec_token_ids)

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the sequence and so yields a new token."""
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens_with_spec for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks
