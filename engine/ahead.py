"""Async scheduling (`EngineConfig.async_scheduling`, on for CUDA engines): a step launched
before the previous step's tokens are read back.

A step whose rows need no token history (`engine.sample.sampler.device_pickable`; no drafts,
no grammar) is launched and its tokens picked on the device without reading them back; the
engine's call returns the *previous* such step's deltas, read back only after this step is
queued behind it. Each of its sequences that goes on gets a `PLACEHOLDER` token at once, so
the next `schedule()` gives it its next position, whose input the runner takes from this
step's token tensor on the device (`feed`). While the device computes step N, the host reads
back N - 1, emits its deltas, schedules and prepares N + 1: the device never waits for the
host between steps. The scheduler counts a launched step's chunks as computed at launch
(`Scheduler.advance`) and caches full blocks once their tokens are real (`commit`). A
sequence that stops at step N was given a row in N + 1 already: that row is wasted and
ignored. One whose next token certainly ends it (length) gives its seat and blocks back at
launch (`Scheduler.release`).

Outputs are those of the synchronous engine: the same tokens, stops and deltas. Three
differences, none in what a request generates: unseeded random draws differ (as any run's
do); an abort reports the tokens sent, not one still on the device; and a sequence that
stopped leaves one more full block in the prefix cache when its spare row completed it (valid
K/V), so a later prompt repeating its text may hit one block more. A launched step that fails
on the device ends its requests and makes the engine forget its prefix cache (blocks are
cached at launch, before the failure can show).

`StepsAhead` holds the launched step and decides who goes ahead; the engine lands it
(`LLMEngine._land`), since landing is its ordinary output path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.runner.model_runner import Feed
from engine.sample.sampler import Sampler, device_pickable
from engine.sched.output import ScheduledChunk, SchedulerOutput
from engine.sched.scheduler import Scheduler
from engine.sequence import PLACEHOLDER, Sequence, SequenceStatus

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Launched:
    """A step launched with its tokens still on the device."""

    out: SchedulerOutput
    chunks: list[ScheduledChunk]  # the sampling chunks: one token each, in row order
    rows: dict[str, int]  # request id -> row of `tokens`
    tokens: torch.Tensor  # [len(chunks)] int64 on the device
    host: torch.Tensor  # where they are copied to (pinned), or `tokens` itself on the CPU
    copied: torch.cuda.Event | None  # recorded after that copy (GPU)

    def read(self) -> list[int]:
        """The step's tokens; waits for the device to finish this step, not the next."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.host[: len(self.chunks)].tolist()


class StepsAhead:
    """The launched step of one engine, and the rules of who goes ahead (module doc).
    `constrained(request_id)`: whether a request's tokens follow a grammar."""

    def __init__(
        self,
        scheduler: Scheduler,
        sampler: Sampler,
        max_model_len: int,
        constrained: Callable[[str], bool],
        *,
        device: torch.device,
        max_num_seqs: int,
    ):
        self.scheduler = scheduler
        self.sampler = sampler
        self.max_model_len = max_model_len
        self.constrained = constrained
        self.launched: Launched | None = None
        # Two pinned landing places for launched steps' tokens, taken in turn, each with the
        # event recorded after its copy (GPU).
        self._hosts: list[tuple[torch.Tensor, torch.cuda.Event]] = []
        if device.type == "cuda":
            self._hosts = [
                (torch.empty(max_num_seqs, dtype=torch.int64, pin_memory=True), torch.cuda.Event())
                for _ in range(2)
            ]

    def feed(self) -> Feed | None:
        """What the next step's placeholder inputs are read from on the device."""
        launched = self.launched
        return (launched.rows, launched.tokens) if launched is not None else None

    def take(self) -> Launched | None:
        """The launched step, to land (None when there is none)."""
        launched, self.launched = self.launched, None
        return launched

    def can_launch(self, chunks: list[ScheduledChunk]) -> bool:
        """Whether every sampling row of the step can be picked on the device."""
        for c in chunks:
            seq = c.seq
            if (
                c.spec_token_ids
                or not device_pickable(seq.sampling, seq.num_output_tokens)
                or self.constrained(seq.request_id)
            ):
                return False
        return True

    def pick(self, logits: torch.Tensor, chunks: list[ScheduledChunk]) -> torch.Tensor | None:
        """The step's tokens on the device (None when picking raised)."""
        try:
            return self.sampler.pick(logits, [c.seq for c in chunks])
        except Exception:  # e.g. a seed the generator rejects: each chunk alone, on the host
            logger.exception("picking on the device failed; sampling this step on the host")
            return None

    def launch(
        self, out: SchedulerOutput, chunks: list[ScheduledChunk], tokens: torch.Tensor
    ) -> None:
        """Hold a launched step, and give each sequence that goes on its placeholder."""
        copied = None
        host = tokens
        if self._hosts:
            self._hosts.reverse()  # the other one may still be read by the engine's landing
            host, copied = self._hosts[0]
            host[: len(chunks)].copy_(tokens, non_blocking=True)
            copied.record()
        rows = {}
        for row, chunk in enumerate(chunks):
            seq = chunk.seq
            rows[seq.request_id] = row
            if seq.status is not SequenceStatus.RUNNING:
                continue
            if self._ends_with_next_token(seq):
                self.scheduler.release(seq)  # seat and blocks back now, as if landed
            elif self._goes_on(seq):
                seq.token_ids.append(PLACEHOLDER)
        self.launched = Launched(out, chunks, rows, tokens, host, copied)

    def ending(self, request_id: str) -> bool:
        """Whether the request's last token is launched: a synchronous engine would have
        finished it already."""
        seq = self.scheduler.get(request_id)
        return seq is not None and seq.status is SequenceStatus.ENDING

    def _ends_with_next_token(self, seq: Sequence) -> bool:
        """Whether the token `seq` is about to receive certainly ends it (length)."""
        return (
            seq.num_output_tokens + 1 >= seq.sampling.max_tokens
            or seq.num_tokens + 1 >= self.max_model_len
        )

    def _goes_on(self, seq: Sequence) -> bool:
        """Whether `seq`, about to receive a token that does not certainly end it, gets its
        next position scheduled before that token is known: not when its next row needs the
        token history."""
        return device_pickable(seq.sampling, seq.num_output_tokens + 1) and not self.constrained(
            seq.request_id
        )
