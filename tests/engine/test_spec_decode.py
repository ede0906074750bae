"""Speculative tokens end to end on the tiny random model: whatever a proposer says, greedy
output equals plain decoding token for token, and rejected drafts leave no KV behind."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest

from engine.config import SchedulerConfig
from engine.kv.block_hash import hash_block
from engine.llm_engine import LLMEngine
from engine.request import FinishReason, Request, SamplingParams
from engine.sequence import Sequence
from engine.spec.proposer import Draft, NoopProposer, Proposer
from tests.engine.engine_fixture import greedy, make_request, prompt_ids, tiny_config

K = 4


class ScriptedProposer:
    """Proposes `K` drafts per sequence from a reference output: right, wrong or a mix."""

    def __init__(self, reference: dict[str, list[int]], mode: str, k: int = K):
        self.reference, self.mode, self.k = reference, mode, k
        self.calls = 0
        self.proposed = 0

    def propose(self, seqs: list[Sequence], num_tokens: dict[str, int]) -> dict[str, Draft]:
        self.calls += 1
        out = {}
        for seq in seqs:
            ref = self.reference[seq.request_id]
            n = seq.num_output_tokens
            right = (ref[n : n + self.k] + [5] * self.k)[: self.k]
            wrong = [(t + 1) % 300 + 3 for t in right]
            if self.mode == "right":
                draft = right
            elif self.mode == "wrong":
                draft = wrong
            else:  # right for a while, then wrong, varying with the step
                cut = (self.calls + len(seq.request_id)) % (self.k + 1)
                draft = right[:cut] + wrong[cut:]
            self.proposed += len(draft)
            out[seq.request_id] = Draft(draft)
        return out

    def forget(self, request_id: str) -> None:
        pass


PROMPTS = {
    "a": prompt_ids(1, 40),
    "b": prompt_ids(2, 23),
    "c": prompt_ids(3, 9),
}
SECOND_WAVE = {  # prefix-cache hits on the first wave's blocks
    "d": PROMPTS["a"][:35] + prompt_ids(4, 6),
    "e": PROMPTS["b"],
}


def params(rid: str) -> SamplingParams:
    return greedy(21, logprobs=2) if rid == "c" else greedy(21 + len(rid))


def run(make_proposer: Callable[[], Proposer]) -> tuple[LLMEngine, dict[str, list]]:
    """Two waves, chunked prefill (budget 24), several requests batched together."""
    engine = LLMEngine(
        tiny_config(scheduler=SchedulerConfig(max_num_batched_tokens=24)),
        proposer=make_proposer(),
    )
    out: dict[str, list] = {}
    for wave in (PROMPTS, SECOND_WAVE):
        for rid, prompt in wave.items():
            engine.add_request(make_request(rid, prompt, params(rid)))
        while engine.has_unfinished():
            for delta in engine.step():
                out.setdefault(delta.request_id, []).append(delta)
    return engine, out


def tokens(deltas) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def cached_hashes(engine: LLMEngine) -> set[int]:
    return {b.block_hash for b in engine.kv.pool.blocks if b.block_hash is not None}


def valid_hashes(engine: LLMEngine, sequences: dict[str, list[int]]) -> set[int]:
    """Hashes of every full block of the requests' real tokens (prompt + output)."""
    bs, out = engine.kv.block_size, set()
    for ids in sequences.values():
        parent = None
        for i in range(len(ids) // bs):
            parent = hash_block(parent, ids[i * bs : (i + 1) * bs], engine.kv.extra_key)
            out.add(parent)
    return out


@pytest.fixture(scope="module")
def baseline() -> tuple[LLMEngine, dict[str, list]]:
    return run(NoopProposer)


@pytest.mark.parametrize("mode", ["right", "wrong", "mixed"])
def test_greedy_output_and_kv_do_not_depend_on_the_drafts(baseline, mode: str) -> None:
    base_engine, base = baseline
    reference = {rid: tokens(d) for rid, d in base.items()}
    proposer = ScriptedProposer(reference, mode)
    engine, out = run(lambda: proposer)
    assert proposer.proposed > 0
    for rid, deltas in base.items():
        assert tokens(out[rid]) == reference[rid], rid
        assert "".join(d.text for d in out[rid]) == "".join(d.text for d in deltas)
        assert out[rid][-1].finish_reason is FinishReason.LENGTH
        assert out[rid][-1].num_cached_tokens == deltas[-1].num_cached_tokens
    got = [(lp.token_id, lp.logprob) for d in out["c"] for lp in d.logprobs]
    want = [(lp.token_id, lp.logprob) for d in base["c"] for lp in d.logprobs]
    assert [t for t, _ in got] == [t for t, _ in want]
    assert [v for _, v in got] == pytest.approx([v for _, v in want], abs=1e-4)
    assert out["d"][-1].num_cached_tokens == 32  # the second wave hit the cache
    # No KV left behind: same free blocks and prefix cache as plain decoding, and every cached
    # block holds real tokens only.
    assert engine.kv.num_free_blocks == base_engine.kv.num_free_blocks == engine.kv.num_blocks
    assert cached_hashes(engine) == cached_hashes(base_engine)
    full = {rid: (PROMPTS | SECOND_WAVE)[rid] + reference[rid] for rid in reference}
    assert cached_hashes(engine) <= valid_hashes(engine, full)
    counters = engine.counters
    assert counters.draft_tokens > 0
    assert counters.generated_tokens == base_engine.counters.generated_tokens
    if mode == "wrong":
        assert counters.accepted_tokens == 0
    if mode == "right":  # several tokens per step: fewer steps
        assert engine.counters.steps < base_engine.counters.steps
        assert any(len(d.token_ids) == K + 1 for d in out["a"])


def _solo(engine: LLMEngine, rid: str, prompt: list[int], sp: SamplingParams) -> list:
    engine.add_request(Request(rid, prompt, sp))
    deltas = []
    while engine.has_unfinished():
        deltas.extend(engine.step())
    return deltas


def test_a_stop_inside_an_accepted_run_ends_the_request_exactly_there() -> None:
    plain = LLMEngine(tiny_config())
    prompt = prompt_ids(9, 12)
    ref = tokens(_solo(plain, "ref", prompt, greedy(30)))
    proposer = ScriptedProposer({}, "right", k=8)
    spec = LLMEngine(tiny_config(), proposer=proposer)

    def same_as_plain(sp: SamplingParams) -> list:
        want = _solo(plain, "p", prompt, sp)
        proposer.reference = {"x": ref}
        got = _solo(spec, "x", prompt, sp)
        assert tokens(got) == tokens(want)
        assert "".join(d.text for d in got) == "".join(d.text for d in want)
        assert got[-1].finish_reason is want[-1].finish_reason
        assert len(got[-1].token_ids) > 1  # it ended inside a multi-token step
        assert spec.kv.num_free_blocks == spec.kv.num_blocks
        return got

    # A stop string completed by output token 6 (the first multi-token step covers 2..10):
    # the text is cut at the stop string, the token ids end with the token completing it.
    text = plain.tokenizer.decode(ref)
    cut = len(plain.tokenizer.decode(ref[:6]))
    start = next(i for i in range(cut - 1, -1, -1) if text.find(text[i:cut]) == i)
    stop = text[start:cut]
    got = same_as_plain(greedy(30, stop=(stop,)))
    assert got[-1].finish_reason is FinishReason.STOP
    assert "".join(d.text for d in got) == text[:start]
    assert tokens(got) == ref[:6]
    # A stop token inside the run: kept as the last token, nothing after it.
    got = same_as_plain(greedy(30, stop_token_ids=(ref[5],)))
    assert tokens(got) == ref[: ref.index(ref[5]) + 1]
    # max_tokens in the middle of what the proposer offers.
    got = same_as_plain(greedy(7))
    assert got[-1].finish_reason is FinishReason.LENGTH and tokens(got) == ref[:7]


def test_random_requests_verify_drafts_but_seeded_ones_decode_without() -> None:
    """An unseeded random request verifies drafts by rejection sampling. A seeded one gets
    none (which drafts rejection sampling keeps would depend on the proposer and on the
    policy's other requests): its tokens are the ones a plain engine gives its seed."""
    sp = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)
    prompt = prompt_ids(12, 20)
    ref = tokens(_solo(LLMEngine(tiny_config()), "r", prompt, greedy(24)))
    want = tokens(_solo(LLMEngine(tiny_config()), "r", prompt, sp))
    for seed in (3, None):
        engine = LLMEngine(tiny_config(), proposer=ScriptedProposer({"r": ref}, "mixed"))
        got = _solo(engine, "r", prompt, replace(sp, seed=seed))
        assert got[-1].finish_reason is FinishReason.LENGTH and len(tokens(got)) == 24
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
        if seed is None:
            assert engine.counters.num_drafts > 0
        else:
            assert engine.counters.num_drafts == 0 and tokens(got) == want
