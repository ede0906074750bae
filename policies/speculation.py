"""Speculation-length policies (the family is `engine.spec.policy.SpeculationPolicy`).

* `fixed`: every decoding sequence carries `max_tokens` drafts, always.
* `adaptive` (default): picks the number that maximises expected tokens per second, learned
  from live traffic. With per-draft acceptance `a` (drafts are accepted in a run, so a
  sequence with `k` drafts yields `(1 - a^(k+1)) / (1 - a)` tokens), a step time
  `t(N) = c0 + c1 * N` fitted on measured steps (`N` = tokens in the forward) and a draft
  forward time `d(B) = e0 + e1 * B` fitted on measured proposals (`B` = sequences), a step
  with `k` drafts per sequence takes `t(B * (k + 1)) + k * d(B)`. The policy takes the `k`
  with the best tokens / time for the batch (0 turns speculation off: a big batch, where
  verifying costs more than it yields, or drafts that keep being rejected), then trims each
  sequence's own count to the drafts whose expected gain `a_r^j` pays for their verify cost
  `c1` at the batch's rate. Acceptance is estimated per request, shrunk towards the global
  estimate while a request is young; all estimates decay, so they follow the traffic. While
  speculation is off, one step in `probe_every` drafts 2 tokens to keep acceptance current.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.sequence import Sequence
from engine.spec.policy import (
    DraftObservation,
    SpeculationPolicy,
    StepObservation,
)
from policies.base import register


@register("fixed")
class FixedLength(SpeculationPolicy):
    def num_tokens(self, seqs: list[Sequence]) -> dict[str, int]:
        if self.max_tokens == 0:
            return {}
        return {s.request_id: self.max_tokens for s in seqs}


@dataclass(slots=True)
class _Acceptance:
    """Decayed counts of accepted drafts and of rejections (runs that stopped short)."""

    accepted: float = 0.0
    rejected: float = 0.0

    def add(self, proposed: int, accepted: int, decay: float) -> None:
        self.accepted = self.accepted * decay + accepted
        self.rejected = self.rejected * decay + (1.0 if accepted < proposed else 0.0)

    def rate(self, prior: float, weight: float) -> float:
        """Per-draft acceptance: the run's geometric MLE, shrunk towards `prior`."""
        return (self.accepted + weight * prior) / (self.accepted + self.rejected + weight)


@dataclass(slots=True)
class _LinearFit:
    """Exponentially weighted least squares fit of y = a + b * x."""

    decay: float
    s0: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self.s0 = self.s0 * d + 1.0
        self.sx = self.sx * d + x
        self.sy = self.sy * d + y
        self.sxx = self.sxx * d + x * x
        self.sxy = self.sxy * d + x * y

    def coefficients(self, default_slope: float) -> tuple[float, float] | None:
        """(a, b) with a, b >= 0; `default_slope` while every x seen is (nearly) the same."""
        if self.s0 < 1.0:
            return None
        mean_x, mean_y = self.sx / self.s0, self.sy / self.s0
        var = self.sxx / self.s0 - mean_x * mean_x
        if var <= 1e-9 * max(1.0, mean_x * mean_x):
            b = default_slope
        else:
            b = max(0.0, (self.sxy / self.s0 - mean_x * mean_y) / var)
        a = max(0.0, mean_y - b * mean_x)
        if a == 0.0 and b == 0.0:
            return None
        return a, b


@register("adaptive")
class AdaptiveLength(SpeculationPolicy):
    def __init__(
        self,
        max_tokens: int = 8,
        prior_acceptance: float = 0.7,
        request_weight: float = 4.0,
        decay: float = 0.98,
        probe_every: int = 64,
    ) -> None:
        super().__init__(max_tokens)
        self.prior_acceptance = prior_acceptance
        self.request_weight = request_weight
        self.decay = decay
        self.probe_every = probe_every
        self._global = _Acceptance()
        self._requests: dict[str, _Acceptance] = {}
        self._step = _LinearFit(decay)  # step seconds vs tokens in the forward
        self._draft = _LinearFit(decay)  # seconds per draft forward vs batch size
        self._steps_off = 0
        self.last_choice = 0  # the batch's k at the last decision (for stats and tests)

    # -- learning ----------------------------------------------------------------------------

    def observe_step(self, obs: StepObservation) -> None:
        if obs.num_tokens > 0:
            self._step.add(obs.num_tokens, obs.seconds)
        for v in obs.verified:
            if v.proposed <= 0:
                continue
            self._global.add(v.proposed, v.accepted, self.decay)
            state = self._requests.get(v.request_id)
            if state is None:
                state = self._requests[v.request_id] = _Acceptance()
            state.add(v.proposed, v.accepted, 1.0)

    def observe_draft(self, obs: DraftObservation) -> None:
        if obs.max_tokens > 0 and obs.batch_size > 0:
            self._draft.add(obs.batch_size, obs.seconds / obs.max_tokens)

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def acceptance(self, request_id: str | None = None) -> float:
        """The estimated per-draft acceptance of a request (None: of the traffic)."""
        g = self._global.rate(self.prior_acceptance, 2.0)
        if request_id is None:
            return g
        state = self._requests.get(request_id)
        return g if state is None else state.rate(g, self.request_weight)

    # -- deciding ----------------------------------------------------------------------------

    def num_tokens(self, seqs: list[Sequence]) -> dict[str, int]:
        if not seqs or self.max_tokens == 0:
            return {}
        batch = len(seqs)
        step = self._step.coefficients(default_slope=0.0)
        if step is None:  # nothing measured yet: speculate moderately to start learning
            k = min(4, self.max_tokens)
            self.last_choice = k
            return {s.request_id: k for s in seqs}
        c0, c1 = step
        draft = self._draft.coefficients(default_slope=0.0)
        per_forward = (draft[0] + draft[1] * batch) if draft else 0.25 * (c0 + c1 * batch)
        rates = [min(self.acceptance(s.request_id), 0.995) for s in seqs]

        def throughput(k: int) -> float:
            tokens = sum(_expected_tokens(a, k) for a in rates)
            seconds = c0 + c1 * batch * (k + 1) + k * per_forward
            return tokens / seconds if seconds > 0 else 0.0

        best = max(range(self.max_tokens + 1), key=throughput)
        if best == 0:
            self._steps_off += 1
            if self.probe_every and self._steps_off % self.probe_every == 0:
                best = min(2, self.max_tokens)
            self.last_choice = best
            if best == 0:
                return {}
            return {s.request_id: best for s in seqs}
        self._steps_off = 0
        self.last_choice = best
        rate = throughput(best)
        out = {}
        for s, a in zip(seqs, rates, strict=True):
            k = best
            # A draft at position j adds a^j expected tokens for c1 of verify time.
            while k > 0 and (a**k) < c1 * rate:
                k -= 1
            if k:
                out[s.request_id] = k
        return out


def _expected_tokens(a: float, k: int) -> float:
    """Tokens a sequence yields from `k` drafts with per-draft acceptance `a` (a run)."""
    if k == 0:
        return 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)
