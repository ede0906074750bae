"""The engine's side of speculative decoding: which sequences carry drafts into a step, and
what verification made of them.

`LLMEngine` holds one `Speculation` when its proposer is not the no-op one and calls it at
two points of each step: `propose` at the start of the step that verifies the drafts (for
the sequences the previous step left decoding), and `observe` / `count` once the step has
sampled. The speculation-length policy decides how many drafts each sequence gets; the
proposer supplies them. A proposer that fails, or a draft outside the vocabulary, costs
speculation only, never a request.

Who speculates: interactive requests; bulk ones only with `SpeculativeConfig.bulk`, and even
then not while an interactive request decodes (drafting and verifying bulk sequences
lengthens every step an interactive one shares). Never a randomly sampled request with a
`seed`: which tokens rejection sampling keeps depends on the drafts, and those depend on
how many the policy asks for (from every request's recent steps) and on the proposer's own
draws, so its output would not repeat with its seed. (A greedy request's output is the
target's argmax with drafts or without.)

Counters go to the engine's `EngineCounters` (shared), so `engine.counters` shows them.
Engine thread only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection

from engine.config import SpeculativeConfig
from engine.request import RequestClass, SamplingParams
from engine.sample.sampler import GREEDY_EPS, SampleResult
from engine.sched.output import ScheduledChunk, SchedulerOutput
from engine.sched.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus
from engine.spec.policy import (
    MAX_SPEC_TOKENS,
    DraftObservation,
    SpeculationPolicy,
    StepObservation,
    Verified,
)
from engine.spec.proposer import Draft, Proposer
from engine.stats import EngineCounters, SpecStats

logger = logging.getLogger("engine.llm_engine")


class Speculation:
    def __init__(
        self,
        config: SpeculativeConfig,
        proposer: Proposer,
        policy: SpeculationPolicy,
        counters: EngineCounters,
        vocab_size: int,
    ) -> None:
        self.config = config
        self.proposer = proposer
        self.policy = policy
        self.counters = counters
        self.vocab_size = vocab_size

    def propose(self, seqs: list[Sequence], scheduler: Scheduler) -> None:
        """Replace the drafts of `seqs` (about to decode) with the proposer's, as many as the
        policy asks."""
        clear_drafts(seqs)
        if not self.config.bulk or any(s.request_class is RequestClass.INTERACTIVE for s in seqs):
            seqs = [s for s in seqs if s.request_class is RequestClass.INTERACTIVE]
        seqs = [s for s in seqs if not seeded_random(s.sampling)]
        if not seqs:
            return
        wanted = self.policy.num_tokens(seqs)
        asked = [s for s in seqs if wanted.get(s.request_id, 0) > 0]
        if not asked:
            return
        started = time.perf_counter()
        try:
            drafts = self.proposer.propose(asked, wanted)
        except Exception:
            logger.exception("the proposer failed; decoding without drafts this step")
            drafts = {}
        seconds = time.perf_counter() - started
        self.counters.propose_seconds += seconds
        self.policy.observe_draft(
            DraftObservation(len(asked), max(wanted[s.request_id] for s in asked), seconds)
        )
        for request_id, draft in drafts.items():
            target = scheduler.get(request_id)
            if target is None or target.status is not SequenceStatus.RUNNING:
                continue
            kept = self._checked(draft, wanted.get(request_id, 0))
            if kept is not None:
                target.spec_token_ids, target.spec_probs = list(kept.token_ids), kept.probs

    def _checked(self, draft: Draft, k: int) -> Draft | None:
        """`draft` cut to `k` tokens, or None when it is empty or not of this vocabulary."""
        if len(draft.token_ids) > k:
            draft = Draft(draft.token_ids[:k], None if draft.probs is None else draft.probs[:k])
        vocab = self.vocab_size
        if not draft.token_ids or not all(0 <= t < vocab for t in draft.token_ids):
            return None
        if draft.probs is not None and tuple(draft.probs.shape) != (len(draft.token_ids), vocab):
            return None
        return draft

    def count(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """One sequence's drafts of this step: `proposed`, of which `accepted` were kept."""
        c = self.counters
        c.num_drafts += 1
        c.draft_tokens += proposed
        c.accepted_tokens += accepted
        for j in range(min(accepted, MAX_SPEC_TOKENS)):
            c.accepted_per_pos[j] += 1
        seq.num_draft_tokens += proposed
        seq.num_accepted_tokens += accepted

    def observe(
        self,
        out: SchedulerOutput,
        chunks: list[ScheduledChunk],
        results: list[SampleResult | str],
        seconds: float,
        forced: Collection[str],
    ) -> None:
        """Tell the policy what this step cost and what verification kept (drafts the
        grammar forced, `forced`, are not the proposer's and do not count)."""
        verified = [
            Verified(c.seq.request_id, len(c.spec_token_ids), r.num_accepted)
            for c, r in zip(chunks, results, strict=True)
            if c.spec_token_ids and not isinstance(r, str) and c.seq.request_id not in forced
        ]
        if verified:
            self.counters.verify_seconds += seconds
        self.policy.observe_step(
            StepObservation(len(chunks), out.num_batched_tokens, seconds, verified)
        )

    def forget(self, request_id: str) -> None:
        self.policy.forget(request_id)
        try:
            self.proposer.forget(request_id)
        except Exception:
            logger.exception("the proposer failed to forget %s", request_id)

    def stats(self) -> SpecStats:
        c = self.counters
        return SpecStats(
            num_drafts=c.num_drafts,
            num_draft_tokens=c.draft_tokens,
            num_accepted_tokens=c.accepted_tokens,
            accepted_per_pos=tuple(c.accepted_per_pos),
            propose_seconds=c.propose_seconds,
            verify_seconds=c.verify_seconds,
            proposer_up=int(getattr(self.proposer, "available", True)),
        )


def seeded_random(sp: SamplingParams) -> bool:
    """A randomly sampled request with a seed: it decodes without drafts (module doc)."""
    return sp.seed is not None and sp.temperature >= GREEDY_EPS


def clear_drafts(seqs: list[Sequence]) -> None:
    for seq in seqs:
        if seq.spec_token_ids:
            seq.spec_token_ids, seq.spec_probs = [], None
