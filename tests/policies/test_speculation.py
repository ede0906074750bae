"""Speculation-length policies: `fixed`, and `adaptive` learning from measured steps."""

from __future__ import annotations

import pytest

from engine.request import Request, SamplingParams
from engine.sequence import Sequence
from engine.spec.policy import DraftObservation, SpeculationPolicy, StepObservation, Verified
from policies.base import create
from policies.speculation import AdaptiveLength, FixedLength


def seqs(n: int) -> list[Sequence]:
    return [Sequence.from_request(Request(f"r{i}", [1, 2, 3], SamplingParams())) for i in range(n)]


def feed(
    policy: AdaptiveLength,
    batch: list[Sequence],
    k: int,
    accepted: dict[str, int] | int,
    step_s: float,
    draft_s: float,
) -> None:
    """One measured step of `batch` with `k` drafts each."""
    verified = [
        Verified(
            s.request_id,
            k,
            accepted if isinstance(accepted, int) else accepted.get(s.request_id, k),
        )
        for s in batch
    ]
    policy.observe_step(StepObservation(len(batch), len(batch) * (k + 1), step_s, verified))
    if k:
        policy.observe_draft(DraftObservation(len(batch), k, draft_s))


def cost_model(policy: AdaptiveLength, batch: list[Sequence], accept, c0, c1, d) -> None:
    """Steps at several draft counts under a step time of c0 + c1 * tokens, drafts d each."""
    for _ in range(30):
        for k in (0, 2, 4, 8):
            tokens = len(batch) * (k + 1)
            feed(policy, batch, k, accept(k), c0 + c1 * tokens, d * k)


def test_registered_by_name() -> None:
    assert {"fixed", "adaptive"} <= set(SpeculationPolicy.available())
    assert isinstance(create(SpeculationPolicy, "adaptive", max_tokens=5), AdaptiveLength)
    with pytest.raises(ValueError):
        FixedLength(max_tokens=9)


def test_fixed_always_proposes_the_max() -> None:
    assert FixedLength(max_tokens=3).num_tokens(seqs(2)) == {"r0": 3, "r1": 3}
    assert FixedLength(max_tokens=0).num_tokens(seqs(2)) == {}


def test_adaptive_starts_moderately_before_it_has_measured_anything() -> None:
    assert set(AdaptiveLength().num_tokens(seqs(3)).values()) == {4}


def test_adaptive_drafts_long_when_verifying_is_cheap_and_drafts_are_right() -> None:
    policy = AdaptiveLength(max_tokens=8)
    batch = seqs(1)
    cost_model(policy, batch, lambda k: k, c0=3e-3, c1=2e-5, d=2e-4)
    assert policy.acceptance() > 0.95
    assert policy.num_tokens(batch) == {"r0": 8}


def test_adaptive_turns_off_for_a_big_batch_and_comes_back_for_a_small_one() -> None:
    policy = AdaptiveLength(max_tokens=8, probe_every=0)
    big = seqs(32)
    # Compute-bound: each token in the forward costs as much as a tenth of the fixed cost,
    # and drafts are right only half the time.
    cost_model(policy, big, lambda k: k // 2, c0=3e-3, c1=3e-4, d=1e-3)
    assert policy.num_tokens(big) == {}
    assert policy.last_choice == 0
    assert policy.num_tokens(big[:1])["r0"] > 0  # one sequence: speculation pays again


def test_adaptive_trims_requests_whose_drafts_keep_failing() -> None:
    policy = AdaptiveLength(max_tokens=8)
    batch = seqs(2)
    accept = {"r0": 8, "r1": 0}  # r0's drafts are always right, r1's never
    for _ in range(40):
        feed(policy, batch, 8, accept, 4e-3 + 2e-4 * 18, 1e-3)
        feed(policy, batch, 0, 0, 4e-3 + 2e-4 * 2, 0.0)
    assert policy.acceptance("r0") > 0.9 and policy.acceptance("r1") < 0.2
    chosen = policy.num_tokens(batch)
    assert chosen.get("r0", 0) >= 6
    assert chosen.get("r1", 0) <= 1
    policy.forget("r1")
    assert policy.acceptance("r1") == policy.acceptance()


def test_adaptive_probes_now_and_then_while_off() -> None:
    policy = AdaptiveLength(max_tokens=8, probe_every=4)
    batch = seqs(16)
    cost_model(policy, batch, lambda k: 0, c0=3e-3, c1=3e-4, d=1e-3)
    picks = [policy.num_tokens(batch) for _ in range(8)]
    assert sum(1 for p in picks if p) == 2 and all(set(p.values()) == {2} for p in picks if p)
