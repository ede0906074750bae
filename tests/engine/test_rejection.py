"""Verification of draft tokens by the sampler: greedy prefix matching, exact rejection
sampling (the output follows the target distribution whatever the drafts are)."""

from __future__ import annotations

import itertools

import pytest
import torch

from engine.request import Request, SamplingParams
from engine.sample.sampler import Sampler
from engine.sequence import Sequence

V = 8
EOS = (7,)
_ids = itertools.count()


def make_seq(outputs: list[int] | None = None, **sampling: object) -> Sequence:
    seq = Sequence.from_request(Request(f"v{next(_ids)}", [0, 1, 2], SamplingParams(**sampling)))
    seq.token_ids.extend(outputs or [])
    return seq


def sampler(seed: int = 0) -> Sampler:
    return Sampler(vocab_size=V, eos_token_ids=EOS, seed=seed)


def peaked(argmaxes: list[int]) -> torch.Tensor:
    logits = torch.zeros(len(argmaxes), V)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return logits


def test_greedy_keeps_the_agreeing_prefix_then_the_targets_token() -> None:
    targets = [3, 4, 5, 6]  # the target's argmax at each of 3 draft positions + the bonus
    logits = peaked(targets * 3)
    seqs = [make_seq(temperature=0.0) for _ in range(3)]
    drafts = [(3, 4, 5), (3, 0, 5), (1, 4, 5)]
    out = sampler().sample(logits, seqs, drafts)
    assert [r.token_ids for r in out] == [[3, 4, 5, 6], [3, 4], [3]]
    assert [r.num_accepted for r in out] == [3, 1, 0]
    # Mixed with a sequence without drafts (one row) and logprobs (the processed path).
    seqs = [make_seq(temperature=0.0, logprobs=2), make_seq(temperature=0.0)]
    out = sampler().sample(peaked([3, 4, 2]), seqs, [(3,), ()])
    assert [r.token_ids for r in out] == [[3, 4], [2]]
    assert out[0].logprobs is not None
    assert [lp.token_id for lp in out[0].logprobs] == [3, 4]


def test_every_verified_position_gets_penalties_and_bans_as_if_decoded_one_by_one() -> None:
    """Verifying k right drafts yields what k+1 plain steps would have, penalties included."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, V, generator=g)
    logits[:, 2] += 2.0  # a favourite that penalties must push away after it repeats
    params = dict(
        temperature=0.0, frequency_penalty=1.5, presence_penalty=0.5, min_tokens=4, logprobs=1
    )
    seq = make_seq(**params)
    plain = []
    for j in range(5):  # one token per step, plain
        r = sampler().sample(logits[j : j + 1], [seq])[0]
        plain.append((r.token_ids[0], r.logprobs[0].logprob))
        seq.token_ids.append(r.token_ids[0])
    assert EOS[0] not in [t for t, _ in plain[:4]]
    fresh = make_seq(**params)
    out = sampler().sample(logits, [fresh], [tuple(t for t, _ in plain[:4])])[0]
    assert out.token_ids == [t for t, _ in plain]
    assert [lp.logprob for lp in out.logprobs] == pytest.approx([lp for _, lp in plain])


def _filtered_target(row: torch.Tensor, temperature: float, top_k: int, top_p: float):
    """The target distribution written out directly: softmax(x / T), top-k, then top-p."""
    p = torch.softmax(row / temperature, -1)
    order = p.argsort(descending=True)
    keep = torch.zeros(V, dtype=torch.bool)
    mass = 0.0
    for rank, t in enumerate(order.tolist()):
        if (top_k and rank >= top_k) or mass >= top_p:
            break
        keep[t] = True
        mass += float(p[t])
    p = torch.where(keep, p, torch.zeros_like(p))
    return p / p.sum()


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 4, 1.0), (1.3, 0, 0.8)]
)
@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_rejection_sampling_follows_the_target_distribution(
    temperature: float, top_k: int, top_p: float, with_draft_probs: bool
) -> None:
    n = 10_000
    row = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, 0.3, 0.9])
    p = _filtered_target(row, temperature, top_k, top_p)
    # Drafts from a distribution far from the target (mass on tokens the target dislikes).
    q = torch.softmax(-row, -1)
    g = torch.Generator().manual_seed(11)
    draft_ids = torch.multinomial(q, n, replacement=True, generator=g).tolist()
    seqs = [make_seq(temperature=temperature, top_k=top_k, top_p=top_p) for _ in range(n)]
    logits = row.expand(2 * n, V)  # 1 draft: 2 rows per sequence
    probs = [q.unsqueeze(0) for _ in range(n)] if with_draft_probs else None
    out = sampler(seed=5).sample(logits, seqs, [(d,) for d in draft_ids], probs)
    first = torch.tensor([r.token_ids[0] for r in out])
    freq = torch.bincount(first, minlength=V).float() / n
    bound = 4.5 * torch.sqrt(p * (1 - p) / n) + 1e-3
    assert ((freq - p).abs() <= bound).all(), (freq, p)
    # Accepted drafts are followed by a bonus token, which also follows the target.
    accepted = [r.token_ids[1] for r in out if r.num_accepted == 1]
    assert 300 < len(accepted) < n
    bonus = torch.bincount(torch.tensor(accepted), minlength=V).float() / len(accepted)
    assert ((bonus - p).abs() <= 4.5 * torch.sqrt(p * (1 - p) / len(accepted)) + 1e-3).all()


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.6, 3, 1.0), (1.5, 0, 0.7)]
)
def test_every_position_of_a_draft_run_follows_the_target(
    temperature: float, top_k: int, top_p: float
) -> None:
    """Three drafts per sequence, each drawn from its own `q` as a draft model would: the
    token at every position (accepted draft, residual draw or bonus) follows the target,
    among the runs that reach that position."""
    n, k = 6000, 3
    g = torch.Generator().manual_seed(7)
    rows = torch.randn(k + 1, V, generator=g) * 1.5  # a different target at each position
    p = [_filtered_target(rows[j], temperature, top_k, top_p) for j in range(k + 1)]
    q = torch.softmax(torch.randn(k, V, generator=g), -1)  # drafts from elsewhere
    draft_ids = torch.stack([torch.multinomial(q[j], n, True, generator=g) for j in range(k)], 1)
    seqs = [make_seq(temperature=temperature, top_k=top_k, top_p=top_p) for _ in range(n)]
    logits = rows.repeat(n, 1)
    drafts = [tuple(d) for d in draft_ids.tolist()]
    out = sampler(seed=9).sample(logits, seqs, drafts, [q] * n)
    for j in range(k + 1):
        reached = [r.token_ids[j] for r in out if len(r.token_ids) > j]
        assert len(reached) > 100
        freq = torch.bincount(torch.tensor(reached), minlength=V).float() / len(reached)
        bound = 4.5 * torch.sqrt(p[j] * (1 - p[j]) / len(reached)) + 2e-3
        assert ((freq - p[j]).abs() <= bound).all(), (j, freq, p[j])


def test_seeded_verification_is_reproducible_and_batch_independent() -> None:
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))

    def run(batch_noise: int) -> list[int]:
        s = sampler(seed=batch_noise)
        target = make_seq(temperature=1.0, seed=42)
        target.request.request_id = "t"
        others = [make_seq(temperature=1.0) for _ in range(batch_noise)]
        rows = torch.cat([logits, torch.randn(batch_noise, V)])
        out = s.sample(rows, [target, *others], [(1, 2), *[() for _ in others]])
        return out[0].token_ids

    assert run(0) == run(3) == run(5)
