"""Engine-side state of one request: its tokens, KV blocks, status and timings.

There is no prefill phase: every scheduled sequence catches `num_computed_tokens` (tokens
whose K/V sit in the cache) up towards `num_tokens` (see `engine.sched.output`). Speculative
tokens are more tokens to catch up: `spec_token_ids` are the drafts a proposer made for the
sequence's next step (never part of `token_ids` until the target accepts them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto
from typing import TYPE_CHECKING

from engine.request import (
    FinishReason,
    Request,
    RequestClass,
    SamplingParams,
    Timings,
    TokenDelta,
    TokenLogprob,
)

if TYPE_CHECKING:
    import torch


# A token sampled on the device and not read back yet (engine `async_scheduling`): the last
# entry of `token_ids` while a step that computes it is launched; never emitted, never hashed.
PLACEHOLDER = -1


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    # Its last token is being computed by a launched step (async scheduling): no seat, no
    # blocks, finished when that token lands (`Scheduler.release`).
    ENDING = auto()
    FINISHED = auto()


@dataclass(slots=True, eq=False)
class Sequence:
    request: Request
    token_ids: list[int]  # prompt + generated so far
    num_prompt_tokens: int
    timings: Timings
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    # Set once by the scheduler's `add` (engine/sched/order.py): lower is served first.
    order_key: tuple[float, float, int] = (0.0, 0.0, 0)
    finish_reason: FinishReason | None = None
    # Drafts for the next step and, optionally, the proposer's distributions `[k, vocab]`
    # they were drawn from (None: point masses). Replaced by the engine after every step.
    spec_token_ids: list[int] = field(default_factory=list)
    spec_probs: torch.Tensor | None = None
    num_draft_tokens: int = 0  # drafts verified for this request, in all steps
    num_accepted_tokens: int = 0  # of those, accepted by the target

    @classmethod
    def from_request(cls, request: Request) -> Sequence:
        return cls(
            request=request,
            token_ids=list(request.prompt_token_ids),
            num_prompt_tokens=len(request.prompt_token_ids),
            timings=Timings(arrival=request.arrival_time),
        )

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def sampling(self) -> SamplingParams:
        return self.request.sampling

    @property
    def request_class(self) -> RequestClass:
        return self.request.request_class

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def delta(
        self,
        token_ids: list[int],
        text: str,
        reason: FinishReason | None,
        logprobs: list[TokenLogprob] | None = None,
    ) -> TokenDelta:
        """A delta of these new tokens, with the request's counts and timings as they stand."""
        return TokenDelta(
            request_id=self.request_id,
            token_ids=token_ids,
            text=text,
            finish_reason=reason,
            logprobs=logprobs,
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=self.num_output_tokens,
            num_cached_tokens=self.num_cached_tokens,
            timings=self.timings,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
        )
