"""A request the engine cannot process fails alone: its neighbours and later requests go on."""

from __future__ import annotations

import math

import pytest

from engine.errors import InvalidRequest
from engine.llm_engine import LLMEngine
from engine.request import FinishReason, Request, SamplingParams, TokenDelta
from engine.sequence import Sequence
from engine.spec.proposer import Draft
from tests.engine.engine_fixture import greedy, make_request, prompt_ids, tiny_config


def run_all(engine: LLMEngine) -> dict[str, list[TokenDelta]]:
    out: dict[str, list[TokenDelta]] = {}
    for _ in range(10_000):
        if not engine.has_unfinished():
            return out
        for delta in engine.step():  # never raises, whatever one request does
            out.setdefault(delta.request_id, []).append(delta)
    raise AssertionError("engine did not finish")


def tokens(deltas: list[TokenDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


SEEDED = SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def engine(request: pytest.FixtureRequest) -> LLMEngine:
    """Both ways of running steps: synchronously, and launched ahead (async scheduling)."""
    return LLMEngine(tiny_config(async_scheduling=request.param))


@pytest.fixture(scope="module")
def solo(engine: LLMEngine) -> dict[str, list[int]]:
    """What the well-behaved requests produce on their own."""
    engine.add_request(make_request("g", prompt_ids(1, 20), greedy(12)))
    engine.add_request(make_request("s", prompt_ids(2, 20), SEEDED))
    return {rid: tokens(d) for rid, d in run_all(engine).items()}


def add_unvalidated(engine: LLMEngine, request: Request, monkeypatch) -> None:
    """Queue a request as if validation had missed something."""
    with monkeypatch.context() as m:
        m.setattr(engine, "validate", lambda request: None)
        engine.add_request(request)


def check_isolated(engine: LLMEngine, solo: dict[str, list[int]], add_bad) -> None:
    """Queue neighbours, then the bad request (`add_bad()` returns its id; queued last, so a
    batched pass reaches the neighbours first); run them and a later request."""
    free0 = engine.kv.num_blocks
    engine.add_request(make_request("g", prompt_ids(1, 20), greedy(12)))
    engine.add_request(make_request("s", prompt_ids(2, 20), SEEDED))
    bad = add_bad()
    out = run_all(engine)
    last = out[bad][-1]
    assert last.finish_reason is FinishReason.ERROR and last.error
    assert tokens(out["g"]) == solo["g"] and tokens(out["s"]) == solo["s"]
    assert out["g"][-1].finish_reason is FinishReason.LENGTH
    assert engine.kv.num_free_blocks == free0
    engine.add_request(make_request("later", prompt_ids(1, 20), greedy(12)))
    assert tokens(run_all(engine)["later"]) == solo["g"]


def test_a_seed_the_generator_rejects_fails_only_its_request(engine, solo, monkeypatch) -> None:
    def add_bad() -> str:
        sp = SamplingParams(max_tokens=12, temperature=1.0, seed=2**70)
        add_unvalidated(engine, make_request("bad", prompt_ids(3, 20), sp), monkeypatch)
        return "bad"

    check_isolated(engine, solo, add_bad)


def test_a_detokenizer_failure_fails_only_its_request(engine, solo) -> None:
    class Broken:
        def push(self, token_ids):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "broken")

    def add_bad() -> str:
        engine.add_request(make_request("bad", prompt_ids(3, 20), greedy(12)))
        engine._detok["bad"] = Broken()
        return "bad"

    check_isolated(engine, solo, add_bad)


def test_a_failed_forward_pass_ends_its_step_and_the_engine_goes_on(engine, solo, monkeypatch):
    engine.add_request(make_request("x", prompt_ids(3, 20), greedy(12)))
    engine.add_request(make_request("y", prompt_ids(4, 20), greedy(12)))
    real = engine.runner.execute
    with monkeypatch.context() as m:
        m.setattr(engine.runner, "execute", lambda out: 1 / 0)
        deltas = engine.step()
        assert {d.request_id for d in deltas} == {"x", "y"}
        assert all(d.finish_reason is FinishReason.ERROR and d.error for d in deltas)
    assert engine.runner.execute == real
    assert not engine.has_unfinished() and engine.kv.num_free_blocks == engine.kv.num_blocks
    engine.add_request(make_request("later", prompt_ids(1, 20), greedy(12)))
    assert tokens(run_all(engine)["later"]) == solo["g"]


def test_a_failing_or_lying_proposer_costs_speculation_only(solo) -> None:
    class Bad:
        calls = 0

        def propose(self, seqs: list[Sequence], num_tokens: dict[str, int]) -> dict[str, Draft]:
            self.calls += 1
            if self.calls % 2:
                raise RuntimeError("proposer down")
            return {s.request_id: Draft([10**9, -1]) for s in seqs}  # outside the vocabulary

        def forget(self, request_id: str) -> None:
            raise RuntimeError("proposer down")

    engine = LLMEngine(tiny_config(), proposer=Bad())
    engine.add_request(make_request("g", prompt_ids(1, 20), greedy(12)))
    assert tokens(run_all(engine)["g"]) == solo["g"]


@pytest.mark.parametrize(
    ("param", "value"),
    [
        ("seed", 2**70),
        ("seed", 2**64),
        ("seed", -(2**63) - 1),
        ("seed", 1.5),
        ("seed", True),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", "hot"),
        ("top_p", math.nan),
        ("min_p", -math.inf),
        ("presence_penalty", math.nan),
        ("repetition_penalty", 1e-300),
        ("max_tokens", 2.0),
        ("top_k", None),
        ("logprobs", 1.5),
        ("stop_token_ids", (-1,)),
        ("stop_token_ids", (2**31,)),
        ("stop_token_ids", ("7",)),
        ("ignore_eos", "yes"),
    ],
)
def test_validate_rejects_what_the_engine_cannot_process(param: str, value: object) -> None:
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(**{param: value}).validate()  # type: ignore[arg-type]
    assert err.value.param == param


@pytest.mark.parametrize("seed", [0, 2**64 - 1, -(2**63), -1])
def test_every_accepted_seed_seeds_the_generator(engine: LLMEngine, seed: int) -> None:
    sp = SamplingParams(max_tokens=3, temperature=1.0, seed=seed, ignore_eos=True)
    sp.validate()
    engine.add_request(make_request(f"seed{seed}", prompt_ids(6, 8), sp))
    out = run_all(engine)[f"seed{seed}"]
    assert out[-1].finish_reason is FinishReason.LENGTH and len(tokens(out)) == 3
