"""Proposers behind the engine: a draft model in this process and prompt lookup. Greedy output
equals plain decoding whatever the draft says; the draft's KV follows the accepted tokens and
is freed with the request; the counters reach the stats and `/metrics`."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from app.metric_snapshot import engine_snapshot
from engine.async_engine import AsyncEngine
from engine.config import SchedulerConfig, SpeculativeConfig
from engine.llm_engine import LLMEngine
from engine.request import FinishReason, Request, RequestClass, SamplingParams
from engine.spec.draft_model import DraftModel, DraftModelProposer, DraftQuery
from engine.spec.prompt_lookup import lookup
from tests.engine.engine_fixture import (
    greedy,
    make_request,
    prompt_ids,
    tiny_config,
    tiny_draft_dir,
    tiny_model_dir,
)

PROMPTS = {"a": prompt_ids(1, 40), "b": prompt_ids(2, 23), "c": prompt_ids(3, 9)}
# A prompt that repeats itself, so prompt lookup finds matches.
PROMPTS["q"] = prompt_ids(4, 12) * 3


def spec_config(method: str, draft: Path | None = None, policy: str = "fixed", **kw):
    spec = SpeculativeConfig(
        method=method,  # type: ignore[arg-type]
        draft_model=str(draft or tiny_draft_dir()),
        policy=policy,
        draft_kv_cache_bytes=1 << 20,
        **kw,
    )
    return tiny_config(scheduler=SchedulerConfig(max_num_batched_tokens=32), speculative=spec)


def run_all(engine: LLMEngine, params: dict[str, SamplingParams]) -> dict[str, list[int]]:
    for rid, prompt in PROMPTS.items():
        engine.add_request(make_request(rid, prompt, params[rid]))
    out: dict[str, list[int]] = {rid: [] for rid in PROMPTS}
    while engine.has_unfinished():
        for delta in engine.step():
            assert delta.error is None
            out[delta.request_id].extend(delta.token_ids)
    return out


PARAMS = {rid: greedy(20 + 3 * i) for i, rid in enumerate(PROMPTS)}


@pytest.fixture(scope="module")
def plain() -> dict[str, list[int]]:
    return run_all(LLMEngine(tiny_config()), PARAMS)


@pytest.mark.parametrize(
    ("method", "draft"),
    [("draft_model", "self"), ("draft_model", "random"), ("prompt_lookup", None)],
)
def test_greedy_output_is_plain_decoding(plain, method: str, draft: str | None) -> None:
    draft_dir = tiny_model_dir() if draft == "self" else tiny_draft_dir()
    engine = LLMEngine(spec_config(method, draft_dir))
    assert run_all(engine, PARAMS) == plain
    c = engine.counters
    assert c.num_drafts > 0 and c.draft_tokens > 0
    if draft == "self":  # the target as its own draft: every draft is right, and stays right
        assert c.accepted_tokens == c.draft_tokens  # only if its KV followed the tokens
        assert c.steps < sum(len(t) for t in plain.values()) / 3
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_abort_and_finish_free_both_kv_pools() -> None:
    engine = LLMEngine(spec_config("draft_model"))
    assert isinstance(engine.proposer, DraftModelProposer)
    draft = engine.proposer.draft
    for rid, prompt in PROMPTS.items():
        engine.add_request(make_request(rid, prompt, greedy(30)))
    for _ in range(30):  # until every request decodes (and so is followed by the draft)
        engine.step()
        if draft.num_followed == len(PROMPTS):
            break
    assert draft.num_followed == len(PROMPTS)
    held = draft.kv.num_blocks - draft.kv.num_free_blocks
    delta = engine.abort("a")
    assert delta is not None and delta.finish_reason is FinishReason.ABORT
    assert draft.num_followed == len(PROMPTS) - 1
    assert draft.kv.num_blocks - draft.kv.num_free_blocks < held
    while engine.has_unfinished():
        engine.step()
    assert draft.num_followed == 0
    assert draft.kv.num_free_blocks == draft.kv.num_blocks
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_the_draft_follows_rollbacks_and_long_catch_ups() -> None:
    """Queries that rewind (rejected drafts) or jump ahead by more than one forward holds."""
    draft = DraftModel(tiny_model_dir(), kv_cache_bytes=1 << 20)
    tokens = prompt_ids(5, 30)
    g = greedy(1)
    first = draft.propose([DraftQuery("r", tokens, 4, g)])["r"].token_ids
    assert len(first) == 4
    # The target accepted two drafts and disagreed on the third.
    wrong = (first[2] + 1) % draft.vocab_size
    again = draft.propose([DraftQuery("r", tokens + first[:2] + [wrong], 3, g)])["r"].token_ids
    fresh = DraftModel(tiny_model_dir(), kv_cache_bytes=1 << 20)
    expect = fresh.propose([DraftQuery("x", tokens + first[:2] + [wrong], 3, g)])["x"].token_ids
    assert again == expect
    long = prompt_ids(6, 500)  # 500 of the model's 512 positions: 12 drafts at most
    assert len(draft.propose([DraftQuery("l", long, 40, g)])["l"].token_ids) == 12
    # A catch-up longer than one forward holds is computed in pieces, to the same drafts.
    small = DraftModel(tiny_model_dir(), kv_cache_bytes=1 << 20, max_batched_tokens=64)
    queries = [DraftQuery("l", long, 5, g), DraftQuery("r", tokens, 5, g)]
    assert small.propose(queries) == draft.propose(queries)
    draft.release("r")
    draft.release("l")
    assert draft.kv.num_free_blocks == draft.kv.num_blocks
    # More sequences than one forward holds: the first ones get drafts, the rest none.
    narrow = DraftModel(tiny_model_dir(), kv_cache_bytes=1 << 20, max_seqs=2)
    asked = [DraftQuery(f"n{i}", prompt_ids(10 + i, 12), 3, g) for i in range(3)]
    assert sorted(narrow.propose(asked)) == ["n0", "n1"]


def test_seeded_sampled_requests_repeat_with_a_draft_model_and_others_are_drafted() -> None:
    """Seeded sampled requests decode without drafts, so they give what a plain engine
    gives; unseeded ones get the draft model's sampled drafts."""
    sp = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)
    params = {rid: sp for rid in PROMPTS}
    engine = LLMEngine(spec_config("draft_model"))
    assert run_all(engine, params) == run_all(LLMEngine(tiny_config()), params)
    assert engine.counters.num_drafts == 0
    unseeded = {rid: replace(sp, seed=None) for rid in PROMPTS}
    engine = LLMEngine(spec_config("draft_model"))
    assert all(len(t) == 24 for t in run_all(engine, unseeded).values())
    assert engine.counters.num_drafts > 0 and engine.counters.accepted_tokens > 0


def test_prompt_lookup_proposes_what_followed_the_latest_match() -> None:
    assert lookup([1, 2, 3, 4, 1, 2], 3, 1, 3) == [3, 4, 1]
    assert lookup([5, 1, 2, 9, 7, 1, 2, 8, 1, 2], 2, 1, 3) == [8, 1]  # the latest match
    assert lookup([1, 2, 3], 2, 1, 3) == []
    assert lookup([4, 4], 4, 1, 2) == [4]


async def test_spec_counters_reach_engine_stats_and_metrics() -> None:
    engine = AsyncEngine(LLMEngine(spec_config("draft_model", tiny_model_dir())))
    await engine.start()
    try:
        stream = engine.generate(make_request("s", PROMPTS["a"], greedy(16)))
        async for _ in stream:
            pass
        spec = engine.stats().spec
        assert spec is not None and spec.num_draft_tokens > 0
        assert spec.num_accepted_tokens == spec.num_draft_tokens  # a self-draft
        assert spec.accepted_per_pos[0] == spec.num_drafts
        assert spec.propose_seconds > 0 and spec.verify_seconds > 0
        snap = engine_snapshot(engine.stats(), {"model": "m"})
        series = snap["firstlight_spec_decode_num_accepted_tokens_per_pos"]["series"]
        assert series[0]["labels"] == ["m", "0"] and series[0]["value"] == spec.num_drafts
        assert snap["firstlight_spec_decode_num_draft_tokens"]["series"][0]["value"] > 0
    finally:
        await engine.shutdown()
    plain = engine_snapshot(AsyncEngine(LLMEngine(tiny_config())).stats(), {"model": "m"})
    assert not any("spec_decode" in name for name in plain)


def test_every_request_reports_its_drafts() -> None:
    engine = LLMEngine(spec_config("draft_model", tiny_model_dir()))
    engine.add_request(Request("u", PROMPTS["b"], greedy(12)))
    last = None
    while engine.has_unfinished():
        for delta in engine.step():
            last = delta
    assert last is not None and last.finish_reason is FinishReason.LENGTH
    assert last.num_draft_tokens > 0 and last.num_accepted_tokens == last.num_draft_tokens


class CountingProposer(DraftModelProposer):
    def __init__(self, draft: DraftModel) -> None:
        super().__init__(draft)
        self.calls = 0

    def propose(self, seqs, num_tokens):  # type: ignore[no-untyped-def]
        self.calls += 1
        return super().propose(seqs, num_tokens)


def test_first_tokens_leave_before_drafting_and_waiting_chats_skip_it() -> None:
    """A step returns its deltas before the draft model runs (drafts are proposed at the
    start of the step that verifies them), and a step with an interactive request waiting
    for its first token drafts nothing (TTFT before ITL)."""
    proposer = CountingProposer(DraftModel(tiny_model_dir(), kv_cache_bytes=1 << 20))
    config = spec_config("draft_model", tiny_model_dir(), bulk=True)
    engine = LLMEngine(config, proposer=proposer)
    engine.add_request(
        make_request("bulk", PROMPTS["b"], greedy(40), request_class=RequestClass.BULK)
    )
    first = engine.step()
    assert first[0].token_ids and proposer.calls == 0  # the first token left undrafted
    engine.step()
    assert proposer.calls == 1 and engine.counters.draft_tokens > 0
    engine.add_request(make_request("chat", PROMPTS["c"], greedy(4)))
    deltas = engine.step()  # the chat waits: this step prefills it, no drafting
    assert proposer.calls == 1
    assert any(d.request_id == "chat" and d.token_ids for d in deltas)
    engine.step()
    assert proposer.calls == 2  # both decode now: drafting resumes


def test_bulk_sequences_go_without_drafts_while_an_interactive_one_decodes() -> None:
    engine = LLMEngine(spec_config("draft_model", tiny_model_dir(), bulk=True))
    engine.add_request(
        make_request("bulk", PROMPTS["b"], greedy(40), request_class=RequestClass.BULK)
    )
    engine.add_request(make_request("chat", PROMPTS["c"], greedy(30)))
    for _ in range(4):
        engine.step()
    bulk, chat = engine.scheduler.get("bulk"), engine.scheduler.get("chat")
    assert bulk is not None and chat is not None
    assert chat.num_draft_tokens > 0 and bulk.num_draft_tokens == 0
    while engine.has_unfinished():
        engine.step()  # the chat ends first (30 tokens): the bulk one speculates again
    assert engine.counters.draft_tokens > chat.num_draft_tokens


def test_bulk_requests_get_no_drafts_unless_asked() -> None:
    engine = LLMEngine(spec_config("draft_model", tiny_model_dir()))
    engine.add_request(
        make_request("bulk", PROMPTS["b"], greedy(12), request_class=RequestClass.BULK)
    )
    while engine.has_unfinished():
        engine.step()
    assert engine.counters.draft_tokens == 0
    engine.add_request(make_request("chat", PROMPTS["c"], greedy(12)))
    while engine.has_unfinished():
        engine.step()
    assert engine.counters.draft_tokens > 0  # interactive ones still speculate
