"""Bulk-only steps that stop at their next layer or MLP when an interactive request arrives
(`EngineConfig.interrupt_bulk_steps`): what is stopped is recomputed, never lost or changed."""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict
from collections.abc import Callable

from engine.async_engine import AsyncEngine
from engine.config import SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.request import Request, RequestClass
from tests.engine.engine_fixture import greedy, make_request, prompt_ids, tiny_config

BULK = RequestClass.BULK


def bulk_requests() -> list[Request]:
    shared = prompt_ids(0, 40)  # a common prefix: later prompts hit the prefix cache
    return [
        make_request(f"b{i}", shared + prompt_ids(i + 1, 5 + 7 * i), greedy(10), request_class=BULK)
        for i in range(4)
    ]


def run(
    engine: LLMEngine, requests: list[Request], interrupt: Callable[[], bool] | None = None
) -> dict[str, list[int]]:
    for request in requests:
        engine.add_request(request)
    out: dict[str, list[int]] = defaultdict(list)
    for _ in range(1000):
        if not engine.has_unfinished():
            return dict(out)
        for delta in engine.step(interrupt):
            out[delta.request_id] += delta.token_ids
    raise AssertionError("the requests did not finish")


def every(n: int, offset: int) -> Callable[[], bool]:
    """True on every n-th question (asked before each layer and each MLP), from the
    `offset`-th."""
    calls = 0

    def ask() -> bool:
        nonlocal calls
        calls += 1
        return calls % n == offset

    return ask


def small_steps() -> SchedulerConfig:
    return SchedulerConfig(max_num_batched_tokens=24)  # prompts prefill in several chunks


def test_interrupted_steps_recompute_to_the_same_tokens() -> None:
    expected = run(LLMEngine(tiny_config(scheduler=small_steps())), bulk_requests())
    # Four questions a step (two layers, each asked before it and before its MLP); a period
    # of four or less would stop every step.
    for n, offset in ((5, 4), (6, 1), (7, 3)):
        engine = LLMEngine(tiny_config(scheduler=small_steps()))
        assert run(engine, bulk_requests(), every(n, offset)) == expected
        assert engine.counters.interrupted_steps > 0
        stats = engine.kv.stats()
        assert stats.num_free == stats.num_blocks  # no block left held by a stopped step


def test_a_bulk_step_is_asked_before_each_layer_and_each_mlp() -> None:
    engine = LLMEngine(tiny_config())
    asked = every(10**9, -1)  # never stops; counts the questions
    calls = []

    def count() -> bool:
        calls.append(1)
        return asked()

    engine.add_request(bulk_requests()[0])
    engine.step(count)
    assert len(calls) == 2 * len(engine.runner.model.layers)


def test_a_step_serving_interactive_work_is_never_interrupted() -> None:
    engine = LLMEngine(tiny_config())
    engine.add_request(make_request("chat", prompt_ids(9, 12), greedy(6)))
    engine.add_request(make_request("bulk", prompt_ids(8, 12), greedy(12), request_class=BULK))
    chat: list[int] = []
    while engine.scheduler.get("chat") is not None:
        chat += [
            t for d in engine.step(lambda: True) if d.request_id == "chat" for t in d.token_ids
        ]
    assert len(chat) == 6 and engine.counters.interrupted_steps == 0
    steps = engine.counters.steps
    assert engine.step(lambda: True) == []  # bulk alone now: stopped before its first layer
    assert engine.counters.interrupted_steps == 1 and engine.counters.steps == steps


def test_interrupts_off_runs_every_step() -> None:
    engine = LLMEngine(tiny_config(interrupt_bulk_steps=False))
    out = run(engine, bulk_requests(), lambda: True)
    assert all(len(tokens) == 10 for tokens in out.values())
    assert engine.counters.interrupted_steps == 0


async def test_an_arriving_chat_stops_the_bulk_step_in_progress() -> None:
    """The engine thread is held inside a bulk-only step's first layer until a chat has been
    queued: the step stops before its second layer, and every output stays exact."""
    requests = bulk_requests()
    expected = run(LLMEngine(tiny_config()), bulk_requests())
    chat_expected = run(
        LLMEngine(tiny_config()), [make_request("chat", prompt_ids(9, 12), greedy(6))]
    )
    engine = AsyncEngine(LLMEngine(tiny_config()))
    inside, chat_queued = threading.Event(), threading.Event()
    hold = [True]

    def in_first_layer(module, args) -> None:  # the engine thread, inside a forward pass
        if hold[0]:
            hold[0] = False
            inside.set()
            chat_queued.wait(5)

    engine.engine.runner.model.layers[0].register_forward_pre_hook(in_first_layer)
    await engine.start()
    try:
        streams = [asyncio.ensure_future(_tokens(engine, r)) for r in requests]
        assert await asyncio.to_thread(inside.wait, 5)
        chat = asyncio.ensure_future(
            _tokens(engine, make_request("chat", prompt_ids(9, 12), greedy(6)))
        )
        await asyncio.sleep(0)  # `generate` attaches the chat
        chat_queued.set()
        assert await asyncio.wait_for(chat, 30) == chat_expected["chat"]
        outputs = await asyncio.wait_for(asyncio.gather(*streams), 30)
        assert dict(zip([r.request_id for r in requests], outputs, strict=True)) == expected
        assert engine.stats().num_interrupted_steps == 1
    finally:
        chat_queued.set()
        await engine.shutdown()


async def _tokens(engine: AsyncEngine, request: Request) -> list[int]:
    return [t async for d in engine.generate(request) for t in d.token_ids]
