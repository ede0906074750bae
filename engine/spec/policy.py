"""The speculation-length decision: how many drafts each decoding sequence carries next step.

The family lives with the engine (which calls it every step); its policies live in
`policies/speculation.py` and are chosen by name (`EngineConfig.speculative.policy`). The
engine reports what it measures, and the policy learns from live traffic:

* `observe_step`: each step's wall time without proposing (schedule, forward, verify,
  emit), its batch size and token count, and per sequence how many drafts it carried and how
  many the target accepted;
* `observe_draft`: each call to the proposer: batch size, the most drafts asked of one
  sequence (= draft forwards for a draft model), and its wall time.

Thread: the engine thread only (no locking).
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field

from engine.sequence import Sequence
from engine.stats import MAX_SPEC_TOKENS
from policies.base import Policy


@dataclass(slots=True, frozen=True)
class Verified:
    """One sequence's drafts in one step: proposed, and accepted by the target."""

    request_id: str
    proposed: int
    accepted: int


@dataclass(slots=True, frozen=True)
class StepObservation:
    batch_size: int  # sequences that sampled
    num_tokens: int  # tokens computed in the step's forward, drafts included
    seconds: float  # the step's wall time, proposing excluded
    verified: list[Verified] = field(default_factory=list)


@dataclass(slots=True, frozen=True)
class DraftObservation:
    batch_size: int  # sequences drafted for
    max_tokens: int  # the most drafts asked of one sequence
    seconds: float


class SpeculationPolicy(Policy, family=True):
    """Picks 0..`max_tokens` drafts per sequence; 0 for all = no speculation this step."""

    def __init__(self, max_tokens: int = MAX_SPEC_TOKENS) -> None:
        if not 0 <= max_tokens <= MAX_SPEC_TOKENS:
            raise ValueError(f"max_tokens must be in [0, {MAX_SPEC_TOKENS}], got {max_tokens}")
        self.max_tokens = max_tokens

    @abstractmethod
    def num_tokens(self, seqs: list[Sequence]) -> dict[str, int]:
        """Drafts per request id for the sequences about to decode (absent = 0)."""

    def observe_step(self, obs: StepObservation) -> None:  # optional hook
        """A step ran (with or without drafts)."""

    def observe_draft(self, obs: DraftObservation) -> None:  # optional hook
        """The proposer ran."""

    def forget(self, request_id: str) -> None:  # optional hook
        """The request ended."""
