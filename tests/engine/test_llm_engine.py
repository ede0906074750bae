"""LLMEngine end to end on a tiny random model: real forward passes, scheduler, sampler."""

from __future__ import annotations

import time

import pytest
import torch
import transformers

from engine.config import CacheConfig, SchedulerConfig
from engine.errors import InvalidRequest
from engine.llm_engine import LLMEngine
from engine.request import FinishReason, RequestClass, SamplingParams
from tests.engine.engine_fixture import (
    greedy,
    make_request,
    prompt_ids,
    tiny_config,
    tiny_model_dir,
)


def run_all(engine: LLMEngine, max_steps: int = 10_000) -> dict[str, list]:
    """Step until idle; returns every request's deltas in order."""
    out: dict[str, list] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return out
        for delta in engine.step():
            out.setdefault(delta.request_id, []).append(delta)
    raise AssertionError("engine did not finish")


def tokens(deltas) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(tiny_config())


def hf_greedy(prompt: list[int], n: int) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir()).eval()
    ids = torch.tensor([prompt])
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        pad_token_id=2,
    )
    return out[0, len(prompt) :].tolist()


def test_greedy_matches_transformers(engine: LLMEngine) -> None:
    prompt = prompt_ids(0, 37)
    engine.add_request(make_request("a", prompt, greedy(48)))
    deltas = run_all(engine)["a"]
    assert tokens(deltas) == hf_greedy(prompt, 48)
    last = deltas[-1]
    assert last.finish_reason is FinishReason.LENGTH
    assert last.num_output_tokens == 48 and last.num_prompt_tokens == 37
    t = last.timings
    assert t.arrival <= t.first_scheduled <= t.first_token <= t.finished
    assert engine.kv.stats().num_free == engine.kv.stats().num_blocks


def test_batched_chunked_prefill_equals_solo_runs() -> None:
    # A tiny token budget forces chunked prefill and mixes prefill with decode steps.
    eng = LLMEngine(tiny_config(scheduler=SchedulerConfig(max_num_batched_tokens=24)))
    prompts = {f"r{i}": prompt_ids(10 + i, 20 + 13 * i) for i in range(5)}
    for rid, p in prompts.items():
        eng.add_request(make_request(rid, p, greedy(20)))
    together = {rid: tokens(d) for rid, d in run_all(eng).items()}
    solo = LLMEngine(tiny_config())
    for rid, p in prompts.items():
        solo.add_request(make_request(rid, p, greedy(20)))
        assert tokens(run_all(solo)[rid]) == together[rid]


def test_prefix_cache_hit_gives_same_tokens(engine: LLMEngine) -> None:
    prompt = prompt_ids(1, 70)
    engine.add_request(make_request("p1", prompt, greedy(10)))
    first = run_all(engine)["p1"]
    engine.add_request(make_request("p2", prompt, greedy(10)))
    second = run_all(engine)["p2"]
    assert first[-1].num_cached_tokens == 0
    assert second[-1].num_cached_tokens == 64  # 4 full blocks of 16
    assert tokens(first) == tokens(second)
    assert engine.kv.stats().prefix_hits >= 64


def test_preemption_under_kv_pressure_loses_nothing() -> None:
    # 8 requests x (40 + 40 tokens) need 40 blocks; the pool has 16.
    eng = LLMEngine(tiny_config(cache=CacheConfig(num_blocks=16)))
    prompts = {f"q{i}": prompt_ids(100 + i, 40) for i in range(8)}
    for i, (rid, p) in enumerate(prompts.items()):
        cls = RequestClass.BULK if i % 2 else RequestClass.INTERACTIVE
        eng.add_request(make_request(rid, p, greedy(40), request_class=cls))
    got = {rid: tokens(d) for rid, d in run_all(eng).items()}
    assert eng.scheduler.stats().num_preemptions > 0
    solo = LLMEngine(tiny_config())
    for rid, p in prompts.items():
        solo.add_request(make_request(rid, p, greedy(40)))
        assert tokens(run_all(solo)[rid]) == got[rid], rid
    assert eng.kv.stats().num_free == 16


def test_abort_frees_blocks_at_once(engine: LLMEngine) -> None:
    free0 = engine.kv.stats().num_free
    engine.add_request(make_request("ab", prompt_ids(2, 50), greedy(100)))
    for _ in range(3):
        engine.step()
    assert engine.kv.stats().num_free < free0
    delta = engine.abort("ab")
    assert delta is not None and delta.finish_reason is FinishReason.ABORT
    assert engine.kv.stats().num_free == free0
    assert not engine.has_unfinished()
    assert engine.abort("ab") is None


def test_stop_string_and_stop_token(engine: LLMEngine) -> None:
    prompt = prompt_ids(3, 12)
    engine.add_request(make_request("full", prompt, greedy(30)))
    full = run_all(engine)["full"]
    text = "".join(d.text for d in full)
    out_ids = tokens(full)
    # Stop at a string that appears mid-output: the text ends right before it.
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    if stop.strip():
        engine.add_request(make_request("s", prompt, greedy(30, stop=(stop,))))
        got = run_all(engine)["s"]
        assert got[-1].finish_reason is FinishReason.STOP
        assert "".join(d.text for d in got) == text[: text.index(stop)]
    # A stop token id ends the request with that token as the last one.
    engine.add_request(make_request("t", prompt, greedy(30, stop_token_ids=(out_ids[5],))))
    got = run_all(engine)["t"]
    assert got[-1].finish_reason is FinishReason.STOP
    assert tokens(got) == out_ids[: out_ids.index(out_ids[5]) + 1]


def test_seeded_sampling_is_reproducible(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    prompt = prompt_ids(4, 25)
    engine.add_request(make_request("x1", prompt, params))
    engine.add_request(make_request("noise", prompt_ids(5, 30), SamplingParams(max_tokens=20)))
    a = tokens(run_all(engine)["x1"])
    engine.add_request(make_request("x2", prompt, params))
    assert tokens(run_all(engine)["x2"]) == a


def test_bad_requests_are_rejected(engine: LLMEngine) -> None:
    with pytest.raises(InvalidRequest):
        engine.add_request(make_request("long", [5] * 600, greedy(4)))
    with pytest.raises(InvalidRequest):
        engine.add_request(make_request("empty", [], greedy(4)))
    with pytest.raises(InvalidRequest):
        engine.add_request(make_request("vocab", [10**6], greedy(4)))
    with pytest.raises(InvalidRequest):
        engine.add_request(make_request("temp", [5, 6], SamplingParams(temperature=-1)))
    assert not engine.has_unfinished()


def test_requests_past_their_deadline_are_aborted(engine: LLMEngine) -> None:
    free0 = engine.kv.stats().num_free
    soon = time.monotonic() + 0.02
    engine.add_request(make_request("late", prompt_ids(6, 30), greedy(400), deadline=soon))
    engine.add_request(make_request("ok", prompt_ids(7, 30), greedy(8), deadline=soon + 60))
    out = run_all(engine)
    assert out["late"][-1].finish_reason is FinishReason.ABORT
    assert sum(len(d.token_ids) for d in out["late"]) < 400
    assert out["ok"][-1].finish_reason is FinishReason.LENGTH
    assert engine.kv.stats().num_free == free0
    assert not engine._deadlines
