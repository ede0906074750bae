from __future__ import annotations

import itertools

import pytest
import torch

from engine.request import Request, SamplingParams
from engine.sample.filters import top_p_drop
from engine.sample.penalties import bans_tokens
from engine.sample.sampler import Sampler, device_pickable
from engine.sequence import Sequence

V = 10
EOS = (9,)
_ids = itertools.count()


def make_seq(
    prompt: list[int] | None = None,
    outputs: list[int] | None = None,
    request_id: str | None = None,
    **sampling: object,
) -> Sequence:
    rid = request_id if request_id is not None else f"r{next(_ids)}"
    seq = Sequence.from_request(Request(rid, list(prompt or [0, 1]), SamplingParams(**sampling)))
    seq.token_ids.extend(outputs or [])
    return seq


def make_sampler(seed: int | None = 0) -> Sampler:
    return Sampler(vocab_size=V, eos_token_ids=EOS, seed=seed)


def rand_logits(n: int, seed: int = 0, vocab: int = V) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def tokens(results) -> list[int]:
    return [r.token_ids[0] for r in results]


def counts(results, vocab: int = V) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens(results)), minlength=vocab)


def test_greedy_is_argmax_fast_and_slow_path() -> None:
    logits = rand_logits(6)
    expected = logits.argmax(-1).tolist()
    fast = [make_seq(temperature=0.0) for _ in range(6)]
    assert tokens(make_sampler().sample(logits, fast)) == expected
    # logprobs force the processed path; a near-zero temperature is still greedy.
    slow = [make_seq(temperature=1e-7, logprobs=1) for _ in range(6)]
    assert tokens(make_sampler().sample(logits, slow)) == expected
    assert (
        tokens(make_sampler().sample(logits.bfloat16(), fast))
        == logits.bfloat16().argmax(-1).tolist()
    )


def test_padded_vocab_columns_are_ignored() -> None:
    # A padded LM head: extra columns with huge logits must never be chosen.
    logits = torch.cat([rand_logits(6), torch.full((6, 4), 100.0)], dim=1)
    greedy = [make_seq(temperature=0.0) for _ in range(3)]
    sampled = [make_seq(temperature=1.0, logprobs=3) for _ in range(3)]
    out = make_sampler().sample(logits, greedy + sampled)
    assert tokens(out)[:3] == logits[:3, :V].argmax(-1).tolist()
    assert all(t < V for t in tokens(out))
    assert all(t < V for r in out[3:] for t, _ in r.logprobs[0].top)


def test_temperature_sampling_matches_softmax() -> None:
    n, temp = 6000, 0.7
    base = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, 0.2, -1.0, 1.5, -2.0, 0.8])
    seqs = [make_seq(temperature=temp) for _ in range(n)]
    observed = counts(make_sampler(seed=123).sample(base.expand(n, V), seqs)).float()
    expected = torch.softmax(base / temp, -1) * n
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 30.0, (chi2, observed, expected)  # 9 dof: p(chi2 > 30) ~ 4e-4


def test_top_k_top_p_min_p_never_pick_excluded_tokens() -> None:
    n = 3000
    probs = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.05, 0.02, 0.01, 0.01, 0.005, 0.005])
    logits = probs.log().expand(n, V)
    cases = {
        "top_k": (dict(top_k=3), {0, 1, 2}),
        "top_p": (dict(top_p=0.7), {0, 1, 2}),  # mass before token 3 is 0.80 >= 0.7
        "top_p_small": (dict(top_p=0.6), {0, 1}),  # smallest set reaching 0.6 is {0, 1}
        "min_p": (dict(min_p=0.3), {0, 1, 2}),  # floor 0.12 keeps 0.40, 0.25, 0.15
        "all": (dict(top_k=4, top_p=0.5, min_p=0.01), {0, 1}),
    }
    for name, (params, allowed) in cases.items():
        seqs = [make_seq(temperature=1.0, **params) for _ in range(n)]
        seen = set(tokens(make_sampler(seed=1).sample(logits, seqs)))
        assert seen == allowed, name


def _reference_nucleus(probs: torch.Tensor, top_p: float) -> set[int]:
    order = probs.argsort(descending=True).tolist()
    kept, mass = set(), 0.0
    for t in order:
        if mass >= top_p:
            break
        kept.add(t)
        mass += float(probs[t])
    return kept


@pytest.mark.parametrize("scale", [0.5, 6.0])  # flat (full sort) and peaked (top candidates)
def test_top_p_keeps_exactly_the_nucleus(scale: float) -> None:
    vocab, n = 2000, 24
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(4)) * scale
    top_ps = [0.3 + 0.65 * i / n for i in range(n)]
    drop = top_p_drop(logits, top_ps)
    for i in range(n):
        kept = set(torch.nonzero(~drop[i]).flatten().tolist())
        assert kept == _reference_nucleus(logits[i].softmax(-1), top_ps[i]), i
    seqs = [make_seq(temperature=1.0, top_p=p) for p in top_ps]
    sampler = Sampler(vocab_size=vocab, eos_token_ids=EOS, seed=0)
    for _ in range(5):
        for i, r in enumerate(sampler.sample(logits, seqs)):
            assert not drop[i, r.token_ids[0]]


def test_per_row_filters_do_not_leak_across_the_batch() -> None:
    n = 400
    logits = torch.zeros(2 * n, V)  # uniform
    logits[:, 4] = 0.1  # token 4 is the single best
    seqs = [make_seq(temperature=1.0, top_k=1) for _ in range(n)] + [
        make_seq(temperature=1.0) for _ in range(n)
    ]
    out = tokens(make_sampler().sample(logits, seqs))
    assert set(out[:n]) == {4}
    assert len(set(out[n:])) == V


def test_penalties_match_hand_computation() -> None:
    row = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 1.0, 0.0, -0.5, 0.25, 1.5])
    penalized = make_seq(
        prompt=[0, 1],
        outputs=[1, 2, 2],
        temperature=0.0,
        repetition_penalty=1.5,
        frequency_penalty=0.3,
        presence_penalty=0.2,
        logprobs=V,
    )
    expected = row.clone()
    expected[0] = 2.0 / 1.5  # in the prompt: repetition only
    expected[1] = -1.0 * 1.5 - 0.3 * 1 - 0.2  # negative: multiplied; once in the output
    expected[2] = 0.5 / 1.5 - 0.3 * 2 - 0.2  # twice in the output
    # Neighbours with other penalties (or none) in the same batch.
    plain = make_seq(prompt=[0, 1], outputs=[1, 2, 2], temperature=0.0, logprobs=V)
    freq_only = make_seq(prompt=[3], outputs=[3, 5, 5, 5], frequency_penalty=-0.5, logprobs=V)
    expected_freq = row.clone()
    expected_freq[3] += 0.5
    expected_freq[5] += 1.5
    results = make_sampler().sample(row.expand(3, V), [plain, penalized, freq_only])
    for result, want_logits in zip(results, (row, expected, expected_freq), strict=True):
        got = dict(result.logprobs[0].top)
        want = torch.log_softmax(want_logits, -1)
        assert sorted(got) == list(range(V))
        for t in range(V):
            assert got[t] == pytest.approx(float(want[t]), abs=1e-5)
    assert results[1].token_ids[0] == int(expected.argmax())
    assert penalized.token_ids == [0, 1, 1, 2, 2]  # not mutated


def test_repetition_penalty_can_change_the_greedy_choice() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.5] + [-5.0] * (V - 3)])
    plain = make_seq(prompt=[1], temperature=0.0)
    penalized = make_seq(prompt=[1], temperature=0.0, repetition_penalty=2.0)
    assert tokens(make_sampler().sample(logits.expand(2, V), [plain, penalized])) == [1, 2]


def test_min_tokens_bans_eos_and_stop_token_ids() -> None:
    logits = torch.full((1, V), -1.0)
    logits[0, 9] = 5.0  # EOS
    logits[0, 8] = 4.0  # a stop token id
    logits[0, 3] = 3.0

    def pick(outputs: list[int], **params: object) -> int:
        seq = make_seq(outputs=outputs, temperature=0.0, stop_token_ids=(8,), **params)
        return make_sampler().sample(logits, [seq])[0].token_ids[0]

    assert pick([], min_tokens=2) == 3
    assert pick([5], min_tokens=2) == 3
    assert pick([5, 5], min_tokens=2) == 9
    assert pick([], min_tokens=2, ignore_eos=True) == 9  # ignore_eos: EOS is not banned
    # Sampled rows obey the ban too.
    seqs = [make_seq(temperature=1.0, min_tokens=1, stop_token_ids=(8,)) for _ in range(500)]
    assert not {8, 9} & set(tokens(make_sampler().sample(logits.expand(500, V), seqs)))


def test_a_min_tokens_window_that_bans_nothing_keeps_the_fast_paths() -> None:
    """`min_tokens` with `ignore_eos` and no stop ids bans no token (benchmarks ask for exactly
    n tokens so), so its rows stay pickable on the device; with stop ids or EOS they are not."""
    free = SamplingParams(max_tokens=8, min_tokens=8, ignore_eos=True)
    assert not bans_tokens(free, 0) and device_pickable(free, 0)
    stop_ids = SamplingParams(max_tokens=8, min_tokens=8, ignore_eos=True, stop_token_ids=(8,))
    for sp in (stop_ids, SamplingParams(max_tokens=8, min_tokens=8)):
        assert bans_tokens(sp, 7) and not device_pickable(sp, 7)
        assert not bans_tokens(sp, 8) and device_pickable(sp, 8)


def _run_seeded(sampler: Sampler, batches: list[list[Sequence]], target: str) -> list[int]:
    out = []
    for step, seqs in enumerate(batches):
        logits = torch.cat([rand_logits(1, seed=1000 * step + i) for i in range(len(seqs))])
        pos = next(i for i, s in enumerate(seqs) if s.request_id == target)
        logits[pos] = rand_logits(1, seed=step)[0]  # the target's logits depend on the step only
        out.append(sampler.sample(logits, seqs)[pos].token_ids[0])
    return out


def test_seeded_request_reproduces_independent_of_batch() -> None:
    steps = 12

    def target() -> Sequence:
        return make_seq(request_id="t", temperature=1.0, top_p=0.95, seed=42)

    alone = _run_seeded(make_sampler(seed=1), [[target()]] * steps, "t")
    others = [make_seq(temperature=1.0, seed=s if s % 2 else None) for s in range(5)]
    mixed = [
        [*others[: step % 4], target(), *others[step % 4 :], make_seq(temperature=0.0)]
        for step in range(steps)
    ]
    assert _run_seeded(make_sampler(seed=2), mixed, "t") == alone
    assert len(set(alone)) > 1  # it did sample


def test_different_seeds_differ_and_forget_restarts() -> None:
    logits = torch.zeros(1, V)
    sampler = make_sampler()

    def draw(seed: int, rid: str, n: int = 8) -> list[int]:
        seq = make_seq(request_id=rid, temperature=1.0, seed=seed)
        return [sampler.sample(logits, [seq])[0].token_ids[0] for _ in range(n)]

    first = draw(7, "a")
    assert draw(7, "b") == first  # same seed, another request: same stream
    assert draw(8, "c") != first
    assert draw(7, "a") != first  # the generator of "a" kept advancing
    sampler.forget("a")
    assert draw(7, "a") == first


def test_unseeded_requests_differ_across_calls() -> None:
    sampler = Sampler(vocab_size=V, eos_token_ids=EOS)  # random shared seed
    seq = make_seq(temperature=1.0)
    draws = {sampler.sample(torch.zeros(1, V), [seq])[0].token_ids[0] for _ in range(30)}
    assert len(draws) > 3
    other = Sampler(vocab_size=V, eos_token_ids=EOS)
    a = tokens(sampler.sample(torch.zeros(64, V), [seq] * 64))
    b = tokens(other.sample(torch.zeros(64, V), [seq] * 64))
    assert a != b


def test_logprobs_are_log_softmax_before_temperature_and_sorted() -> None:
    logits = rand_logits(4, seed=3)
    seqs = [
        make_seq(temperature=0.0, logprobs=5),
        make_seq(temperature=0.8, logprobs=3, top_k=2),
        make_seq(temperature=0.0),
        make_seq(temperature=1.3, logprobs=0),
    ]
    results = make_sampler().sample(logits, seqs)
    ref = torch.log_softmax(logits, -1)
    assert results[2].logprobs is None
    for row, n in ((0, 5), (1, 3), (3, 0)):
        lp = results[row].logprobs[0]
        assert lp is not None and lp.token_id == results[row].token_ids[0]
        assert lp.logprob == pytest.approx(float(ref[row, lp.token_id]), abs=1e-5)
        assert len(lp.top) == n
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        want_ids = ref[row].topk(n).indices.tolist() if n else []
        assert [t for t, _ in lp.top] == want_ids
        for t, v in lp.top:
            assert v == pytest.approx(float(ref[row, t]), abs=1e-5)


def test_sampler_does_not_mutate_inputs() -> None:
    logits = rand_logits(3)
    before = logits.clone()
    seqs = [
        make_seq(outputs=[3, 3], temperature=0.9, repetition_penalty=1.3, frequency_penalty=1.0),
        make_seq(outputs=[], temperature=0.0, min_tokens=2, logprobs=2),
        make_seq(outputs=[1], temperature=1.0, seed=5, min_p=0.1),
    ]
    ids_before = [list(s.token_ids) for s in seqs]
    make_sampler().sample(logits, seqs)
    assert torch.equal(logits, before)
    assert [s.token_ids for s in seqs] == ids_before


def test_empty_batch_and_shape_errors() -> None:
    assert make_sampler().sample(torch.zeros(0, V), []) == []
    with pytest.raises(ValueError):
        make_sampler().sample(torch.zeros(2, V), [make_seq()])
    with pytest.raises(ValueError):
        make_sampler().sample(torch.zeros(1, V - 1), [make_seq()])
