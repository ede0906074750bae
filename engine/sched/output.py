"""The scheduler's per-step output: which tokens of which sequences are computed this step.

There is no prefill phase: every scheduled sequence catches `num_computed_tokens` (tokens
whose K/V sit in the cache) up towards `num_tokens`. A chunk that reaches the end samples one
new token; a chunk that stops short (chunked prefill) samples nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sequence import Sequence


@dataclass(slots=True)
class ScheduledChunk:
    """`num_tokens` tokens of `seq`, starting at position `start`, computed this step."""

    seq: Sequence
    start: int
    num_tokens: int

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
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks
