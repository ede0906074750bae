"""AsyncEngine: streaming, cancellation, backpressure by coalescing, stalls, overload,
class-aware admission on the event loop, typed stats."""

from __future__ import annotations

import asyncio

import pytest

from engine.async_engine import AsyncEngine, OutputSlot, ReaderStalledError
from engine.config import SchedulerConfig
from engine.errors import InvalidRequest, QueueFull
from engine.llm_engine import LLMEngine
from engine.request import FinishReason, RequestClass
from engine.sched.admission import Admission
from engine.stats import ClassCounts
from tests.engine.engine_fixture import greedy, make_request, prompt_ids, tiny_config
from tests.engine.step_gate import FakeClock, StepGate


async def make_engine(**kw) -> AsyncEngine:
    stall = kw.pop("stall_timeout_s", 30.0)
    engine = AsyncEngine(LLMEngine(tiny_config(**kw)), stall_timeout_s=stall)
    await engine.start()
    return engine


async def collect(engine: AsyncEngine, request) -> list:
    return [d async for d in engine.generate(request)]


async def wait_idle(engine: AsyncEngine, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if not engine.engine.has_unfinished() and not engine._aborts:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("engine did not go idle")


async def test_streams_every_token_with_timings() -> None:
    engine = await make_engine()
    try:
        deltas = await collect(engine, make_request("a", prompt_ids(0, 20), greedy(16)))
        assert sum(len(d.token_ids) for d in deltas) == 16
        assert deltas[-1].finish_reason is FinishReason.LENGTH
        assert all(d.finish_reason is None for d in deltas[:-1])
        timings = deltas[-1].timings.as_dict()
        assert timings["ttft_s"] > 0 and timings["decode_s"] >= 0 and timings["queue_s"] >= 0
    finally:
        await engine.shutdown()


async def test_a_whole_output_request_gets_one_delta_equal_to_the_streamed_ones() -> None:
    engine = await make_engine()
    try:
        streamed = await collect(engine, make_request("s", prompt_ids(3, 20), greedy(16)))
        request = make_request("w", prompt_ids(3, 20), greedy(16))
        request.whole_output = True
        (whole,) = await collect(engine, request)
        assert len(streamed) > 1
        assert whole.token_ids == [t for d in streamed for t in d.token_ids]
        assert whole.text == "".join(d.text for d in streamed)
        assert whole.finish_reason is FinishReason.LENGTH and whole.num_output_tokens == 16
    finally:
        await engine.shutdown()


async def test_concurrent_requests_match_sequential_ones() -> None:
    engine = await make_engine()
    try:
        reqs = [make_request(f"c{i}", prompt_ids(i, 10 + 7 * i), greedy(12)) for i in range(6)]
        together = await asyncio.gather(*(collect(engine, r) for r in reqs))
        for r, deltas in zip(reqs, together, strict=True):
            alone = await collect(
                engine, make_request(r.request_id + "-solo", r.prompt_token_ids, r.sampling)
            )
            assert [t for d in deltas for t in d.token_ids] == [
                t for d in alone for t in d.token_ids
            ]
    finally:
        await engine.shutdown()


async def test_closing_the_stream_aborts_and_frees_kv() -> None:
    engine = await make_engine()
    try:
        kv = engine.engine.kv
        baseline = kv.stats().num_free
        stream = engine.generate(make_request("gone", prompt_ids(1, 40), greedy(400)))
        first = await anext(stream)
        assert first.token_ids
        await stream.aclose()
        await wait_idle(engine)
        assert kv.stats().num_free == baseline
        assert engine.stats().num_cancelled == 1
        assert engine.stats().num_aborted == 1
    finally:
        await engine.shutdown()


async def test_slow_reader_gets_coalesced_deltas() -> None:
    engine = await make_engine()
    try:
        stream = engine.generate(make_request("slow", prompt_ids(2, 10), greedy(40)))
        first = await anext(stream)
        await asyncio.sleep(0.3)  # the model keeps going; output merges into one slot
        rest = [d async for d in stream]
        assert len(first.token_ids) + sum(len(d.token_ids) for d in rest) == 40
        assert len(rest) < 39  # fewer deltas than tokens: they were coalesced
        assert rest[-1].finish_reason is FinishReason.LENGTH
    finally:
        await engine.shutdown()


async def test_stalled_reader_is_cut_and_request_aborted() -> None:
    engine = await make_engine(stall_timeout_s=0.05)
    try:
        stream = engine.generate(make_request("stall", prompt_ids(3, 10), greedy(500)))
        await anext(stream)
        await asyncio.sleep(0.4)
        with pytest.raises(ReaderStalledError):
            async for _ in stream:
                pass
        await wait_idle(engine)
        assert engine.engine.kv.stats().num_free == engine.engine.kv.stats().num_blocks
        assert engine.stats().num_reader_stalls == 1
    finally:
        await engine.shutdown()


async def until(predicate, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.005)):
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not reached")


async def test_queue_full_raises_before_streaming() -> None:
    engine = await make_engine(scheduler=SchedulerConfig(max_num_seqs=1, max_waiting=2))

    def start(i: int) -> asyncio.Task:
        request = make_request(f"b{i}", prompt_ids(i, 8), greedy(480))
        return asyncio.create_task(collect(engine, request))

    busy = [start(0)]
    try:
        await until(lambda: engine.stats().running.interactive == 1)
        busy += [start(1), start(2)]  # the pool seats one; these two fill the queue
        await until(lambda: engine.stats().waiting.interactive == 2)
        with pytest.raises(QueueFull) as info:
            await collect(engine, make_request("over", prompt_ids(9, 8), greedy(4)))
        assert info.value.retry_after_s >= 1
        assert not any(t.done() for t in busy)  # nothing already admitted was harmed
        assert engine.stats().num_requests == ClassCounts(interactive=3)  # the refused: not
    finally:
        for task in busy:
            task.cancel()
        await asyncio.gather(*busy, return_exceptions=True)
        await engine.shutdown()


async def test_invalid_request_raises_invalid_request() -> None:
    engine = await make_engine()
    try:
        with pytest.raises(InvalidRequest):
            await collect(engine, make_request("big", [5] * 1000, greedy(4)))
    finally:
        await engine.shutdown()


async def drain(engine: AsyncEngine, slots: dict[str, OutputSlot]) -> dict[str, list]:
    """Read every slot to its end (detaching it); the deltas per request id."""
    out: dict[str, list] = {}
    for rid, slot in slots.items():
        deltas = [await slot.get()]
        while not deltas[-1].finished:
            deltas.append(await slot.get())
        engine.detach(rid, abort=False)
        out[rid] = deltas
    return out


async def test_a_bulk_flood_never_gets_interactive_refused_and_refusal_needs_no_step() -> None:
    engine = await make_engine(scheduler=SchedulerConfig(max_num_seqs=2, max_waiting=4))
    gate = StepGate(engine.engine)  # the engine thread takes the first add, then waits
    assert engine.admission.interactive_reserve == 1
    slots: dict[str, OutputSlot] = {}

    def attach(rid: str, cls: RequestClass) -> None:
        request = make_request(rid, prompt_ids(len(slots), 8), greedy(4), request_class=cls)
        slot = OutputSlot()
        engine.attach(request, slot)  # raises at once (no await) when refused
        slots[rid] = slot

    try:
        engine.check_admission(RequestClass.BULK, 5)  # 2 seats + the 3 bulk places
        with pytest.raises(QueueFull):
            engine.check_admission(RequestClass.BULK, 6)
        for i in range(5):  # 2 find a seat, 3 wait
            attach(f"bulk{i}", RequestClass.BULK)
        assert engine.num_waiting_by_class == ClassCounts(bulk=3)
        with pytest.raises(QueueFull):  # the early check agrees with attach
            engine.check_admission(RequestClass.BULK, 1)
        engine.check_admission(RequestClass.INTERACTIVE, 1)
        with pytest.raises(QueueFull) as bulk_refused:
            attach("bulk5", RequestClass.BULK)  # the last place is interactive's
        attach("chat0", RequestClass.INTERACTIVE)
        assert engine.num_waiting_by_class == ClassCounts(bulk=4)  # chat0 is seated first
        with pytest.raises(QueueFull):
            attach("chat1", RequestClass.INTERACTIVE)  # now the queue is full
        assert bulk_refused.value.retry_after_s == 1.0  # nothing finished yet: the floor
        gate.open()
        done = await drain(engine, slots)
        assert sorted(done) == ["bulk0", "bulk1", "bulk2", "bulk3", "bulk4", "chat0"]
        for deltas in done.values():
            assert sum(len(d.token_ids) for d in deltas) == 4
            assert deltas[-1].finish_reason is FinishReason.LENGTH
        await until(lambda: engine.num_waiting_by_class == ClassCounts())
    finally:
        gate.open()
        await engine.shutdown()


async def test_retry_after_is_the_queue_ahead_over_the_measured_drain_rate() -> None:
    clock = FakeClock()
    admission = Admission(4, interactive_reserve=1, clock=clock)
    engine = AsyncEngine(
        LLMEngine(tiny_config(scheduler=SchedulerConfig(max_num_seqs=1, max_waiting=4))),
        admission=admission,
    )
    await engine.start()
    try:
        for i in range(3):  # finishes at t = 0, 2, 4: 0.5 per second
            await collect(engine, make_request(f"warm{i}", prompt_ids(i, 8), greedy(2)))
            if i < 2:
                clock.advance(2.0)
        assert engine.stats().admission.drain_rate_per_s == pytest.approx(0.5)
        gate = StepGate(engine.engine)
        slots = {}
        for i in range(5):  # one is seated, four wait
            slots[f"q{i}"] = OutputSlot()
            engine.attach(make_request(f"q{i}", prompt_ids(i, 8), greedy(2)), slots[f"q{i}"])
        with pytest.raises(QueueFull) as info:
            engine.attach(make_request("over", prompt_ids(9, 8), greedy(2)), OutputSlot())
        assert info.value.retry_after_s == pytest.approx(8.0)  # 4 ahead / 0.5 per second
        gate.open()
        assert len(await drain(engine, slots)) == 5
    finally:
        await engine.shutdown()


async def test_stats_are_typed_and_agree_with_the_engine() -> None:
    engine = await make_engine()
    try:
        await collect(engine, make_request("s", prompt_ids(3, 40), greedy(5)))
        stats = engine.stats()
        kv = engine.engine.kv.stats()
        assert stats.model == engine.model_name
        assert stats.running == ClassCounts() and stats.waiting == ClassCounts()
        assert stats.kv.num_blocks == kv.num_blocks == stats.kv.num_free_blocks
        assert stats.kv.prefix_cache_queries == kv.prefix_queries > 0
        assert stats.generation_tokens == 5 and stats.num_steps >= 5
        assert stats.admission.max_waiting == SchedulerConfig().max_waiting
    finally:
        await engine.shutdown()
