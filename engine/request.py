"""The engine's public contract: what goes in (`Request`) and what comes out (`TokenDelta`).

Everything here is plain data (dataclasses with slots) so it crosses process boundaries
(Ray actors, pickling) cheaply. Only `app/sse.py` turns deltas into bytes on the wire.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from engine.errors import InvalidRequest
from engine.structured.grammar import Grammar

_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
_TOKEN_ID_MAX = 2**31 - 1
_INT_PARAMS = ("max_tokens", "top_k", "min_tokens", "logprobs", "seed")
_FLOAT_PARAMS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class RequestClass(StrEnum):
    """Under the default step order interactive requests are scheduled before bulk ones
    (policies/step_order.py); bulk never starves."""

    INTERACTIVE = "interactive"
    BULK = "bulk"


class FinishReason(StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached (or the model's context is full)
    ABORT = "abort"  # the client left or the request was cancelled
    ERROR = "error"  # the engine failed on this request


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """Per-request decoding options. `validate()` raises `InvalidRequest(param, message)`.

    `temperature == 0` means greedy. `top_k <= 0` and `top_p == 1` disable those filters.
    `stop` strings never appear in the output text; `stop_token_ids` and EOS end the request
    with finish reason "stop" unless `ignore_eos` (EOS only) or `min_tokens` says otherwise.
    `logprobs=None` returns none; `logprobs=k` returns the sampled token's logprob and the
    top-k alternatives (k may be 0).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    skip_special_tokens: bool = True
    grammar: Grammar | None = None  # the output must match it (`engine.structured`)

    def validate(self) -> None:
        """Reject every value the engine cannot process, naming the parameter.

        Numbers must be real (ints where counts are meant; bools are not numbers here) and
        finite. `seed` must fit torch's generator: an integer in [-2**63, 2**64 - 1].
        `stop_token_ids` must be integers in [0, 2**31 - 1].
        """
        for param in _INT_PARAMS:
            value = getattr(self, param)
            if not (value is None and param in ("seed", "logprobs")) and not _is_int(value):
                raise InvalidRequest(param, f"{param} must be an integer")
        for param in _FLOAT_PARAMS:
            value = getattr(self, param)
            if not (_is_int(value) or isinstance(value, float)) or not math.isfinite(value):
                raise InvalidRequest(param, f"{param} must be a finite number")
        checks = (
            ("max_tokens", self.max_tokens >= 1, "must be at least 1"),
            ("temperature", 0.0 <= self.temperature <= 100.0, "must be in [0, 100]"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("top_k", self.top_k >= -1, "must be -1, 0 (off) or positive"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            # Below 0.01 a penalised logit overflows float32 (inf logits sample garbage).
            (
                "repetition_penalty",
                0.01 <= self.repetition_penalty <= 10.0,
                "must be in [0.01, 10]",
            ),
            ("min_tokens", 0 <= self.min_tokens <= self.max_tokens, "must be in [0, max_tokens]"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "must be in [0, 20]"),
            (
                "seed",
                self.seed is None or _SEED_MIN <= self.seed <= _SEED_MAX,
                "must be an integer in [-2**63, 2**64 - 1]",
            ),
            (
                "stop_token_ids",
                all(_is_int(t) and 0 <= t <= _TOKEN_ID_MAX for t in self.stop_token_ids),
                "must be integers in [0, 2**31 - 1]",
            ),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
            ("ignore_eos", isinstance(self.ignore_eos, bool), "must be a boolean"),
            (
                "skip_special_tokens",
                isinstance(self.skip_special_tokens, bool),
                "must be a boolean",
            ),
        )
        for param, ok, message in checks:
            if not ok:
                raise InvalidRequest(param, f"{param} {message}")
        if self.grammar is not None:
            if not isinstance(self.grammar, Grammar):
                raise InvalidRequest("response_format", "the output grammar is malformed")
            self.grammar.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def clock_base() -> float:
    """This host's monotonic clock less its wall clock: the same in every process of one host,
    another on another host (monotonic time counts from each host's boot)."""
    return time.monotonic() - time.time()


@dataclass(slots=True)
class Request:
    """One generation request as the engine receives it (already tokenized).

    `arrival_time` and `deadline` are on the monotonic clock of the process that made the
    request. A caller that sends it to another process stamps `sender_clock` (its
    `clock_base()`); the receiver calls `to_local_clock()` before using either time."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_class: RequestClass = RequestClass.INTERACTIVE
    arrival_time: float = field(default_factory=time.monotonic)
    tags: dict[str, str] = field(default_factory=dict)
    deadline: float | None = None  # monotonic seconds; past it the request is aborted
    # The reader wants the output only once it is complete (a batch line): it comes as one
    # delta at the end, not one per step (no frames, no decoding, no merging per token).
    whole_output: bool = False
    sender_clock: float | None = None  # the sender's clock_base() as it sent the request

    def to_local_clock(self) -> None:
        """Move `arrival_time` and `deadline` from the sender's monotonic clock onto this
        process's. Without it a replica on another host would compare times of two clocks
        that differ by the hosts' uptimes (queue times, the step order's keys, deadlines);
        the transit between them stays counted, to the accuracy of the hosts' wall clocks."""
        if self.sender_clock is None:
            return
        shift = clock_base() - self.sender_clock
        self.arrival_time += shift
        if self.deadline is not None:
            self.deadline += shift
        self.sender_clock = None


@dataclass(slots=True)
class Timings:
    """Monotonic timestamps (seconds, engine process clock) of one request's life."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None

    @property
    def queue_s(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def prefill_s(self) -> float | None:
        if self.first_scheduled is None or self.first_token is None:
            return None
        return self.first_token - self.first_scheduled

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def decode_s(self) -> float | None:
        if self.first_token is None or self.finished is None:
            return None
        return self.finished - self.first_token

    def as_dict(self) -> dict[str, float | None]:
        return {
            "queue_s": self.queue_s,
            "prefill_s": self.prefill_s,
            "ttft_s": self.ttft_s,
            "decode_s": self.decode_s,
            "e2e_s": None if self.finished is None else self.finished - self.arrival,
        }


@dataclass(slots=True)
class TokenLogprob:
    """The sampled token's logprob and the top alternatives, most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class TokenDelta:
    """What one engine step produced for one request.

    `token_ids` are the new tokens; `text` the new text (which may lag the tokens while a
    multi-byte character or a possible stop string is held back). `finish_reason` is set on
    the last delta only. Counters are totals so far.
    """

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    timings: Timings | None = None
    error: str | None = None
    num_draft_tokens: int = 0  # speculative drafts verified so far (totals, like the counters)
    num_accepted_tokens: int = 0  # of those, accepted

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def merge_deltas(deltas: Sequence[TokenDelta]) -> TokenDelta:
    """Consecutive deltas of one request as one: the last one's counters, timings and finish
    reason; token ids, text and logprobs concatenated. Used wherever a reader lags the
    producer (the engine's output slot, the HTTP layer's fan-in)."""
    if len(deltas) == 1:
        return deltas[0]
    last = deltas[-1]
    logprobs = None
    if any(d.logprobs is not None for d in deltas):
        logprobs = [lp for d in deltas for lp in (d.logprobs or ())]
    return TokenDelta(
        request_id=last.request_id,
        token_ids=[t for d in deltas for t in d.token_ids],
        text="".join(d.text for d in deltas),
        finish_reason=last.finish_reason,
        logprobs=logprobs,
        num_prompt_tokens=last.num_prompt_tokens,
        num_output_tokens=last.num_output_tokens,
        num_cached_tokens=last.num_cached_tokens,
        timings=last.timings,
        error=next((d.error for d in reversed(deltas) if d.error), None),
        num_draft_tokens=last.num_draft_tokens,
        num_accepted_tokens=last.num_accepted_tokens,
    )
