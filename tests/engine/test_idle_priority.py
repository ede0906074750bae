"""Bulk-only steps that yield the CPU while chat is being served
(`EngineConfig.bulk_idle_priority_s`): within the window after the last interactive request
they run on a thread at the OS's idle priority; steps with chat in them, and bulk steps with
no chat in sight, run on the engine thread as before. Outputs never change."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from dataclasses import dataclass

import pytest

from engine.async_engine import AsyncEngine
from engine.idle_runner import IdleRunner
from engine.llm_engine import LLMEngine
from engine.request import Request, RequestClass
from tests.engine.engine_fixture import greedy, make_request, prompt_ids, tiny_config
from tests.engine.test_interrupt import run

BULK = RequestClass.BULK
INTERACTIVE = RequestClass.INTERACTIVE
linux_only = pytest.mark.skipif(sys.platform != "linux", reason="SCHED_IDLE is Linux's")


@dataclass(frozen=True)
class Forward:
    thread: str
    policy: int
    chat: bool  # an interactive request was running or waiting in that step


def watch(engine: AsyncEngine) -> list[Forward]:
    """Every forward pass of the target model: which thread ran it, at which policy."""
    seen: list[Forward] = []
    sched = engine.engine.scheduler

    def hook(module, args) -> None:  # on the thread that runs the step
        chat = bool(sched.running[INTERACTIVE] or sched.waiting[INTERACTIVE])
        seen.append(Forward(threading.current_thread().name, os.sched_getscheduler(0), chat))

    engine.engine.runner.model.layers[0].register_forward_pre_hook(hook)
    return seen


def bulk(tag: str, n: int = 3) -> list[Request]:
    return [
        make_request(f"{tag}{i}", prompt_ids(i + 1, 6 + 3 * i), greedy(8), request_class=BULK)
        for i in range(n)
    ]


def chat(rid: str) -> Request:
    return make_request(rid, prompt_ids(9, 12), greedy(6))


async def tokens(engine: AsyncEngine, request: Request) -> list[int]:
    return [t async for d in engine.generate(request) for t in d.token_ids]


async def run_all(engine: AsyncEngine, requests: list[Request]) -> dict[str, list[int]]:
    outs = await asyncio.wait_for(asyncio.gather(*(tokens(engine, r) for r in requests)), 30)
    return dict(zip([r.request_id for r in requests], outs, strict=True))


@linux_only
async def test_bulk_steps_yield_the_cpu_only_while_chat_is_recent() -> None:
    window = 2.0  # wide enough for a stalled CI machine, short enough to wait out
    engine = AsyncEngine(LLMEngine(tiny_config(bulk_idle_priority_s=window)))
    seen = watch(engine)
    await engine.start()
    try:
        # No chat yet: a batch alone runs at full priority on the engine thread.
        before = await run_all(engine, bulk("a"))
        assert seen and all(f.thread == "firstlight-engine" for f in seen)
        assert all(f.policy == os.SCHED_OTHER for f in seen)

        # A chat among bulk: its steps on the engine thread; the bulk steps after it yield.
        seen.clear()
        with_chat = await run_all(engine, [chat("c1"), *bulk("b", 4)])
        chat_steps = [f for f in seen if f.chat]
        last = max(i for i, f in enumerate(seen) if f.chat)
        bulk_after = seen[last + 1 :]
        assert chat_steps and bulk_after
        assert all(f.thread == "firstlight-engine" for f in chat_steps)
        assert all(f.policy == os.SCHED_OTHER for f in chat_steps)
        assert all(f.thread.startswith("firstlight-engine-idle") for f in bulk_after)
        assert all(f.policy == os.SCHED_IDLE for f in bulk_after)
        assert engine.num_idle_steps >= len(bulk_after)

        # Past the window with no chat: full priority again.
        await asyncio.sleep(window + 0.5)
        seen.clear()
        after = await run_all(engine, bulk("d"))
        assert all(f.thread == "firstlight-engine" for f in seen)
    finally:
        await engine.shutdown()

    # The same tokens as an engine that never yields.
    reference = LLMEngine(tiny_config(bulk_idle_priority_s=0))
    for requests, got in ((bulk("a"), before), ([chat("c1"), *bulk("b", 4)], with_chat)):
        assert run(reference, requests) == got
    assert run(reference, bulk("d")) == after


async def test_off_runs_every_step_on_the_engine_thread() -> None:
    engine = AsyncEngine(LLMEngine(tiny_config(bulk_idle_priority_s=0)))
    seen = watch(engine)
    await engine.start()
    try:
        await run_all(engine, [chat("c1"), *bulk("b", 4)])
        await run_all(engine, bulk("d"))
    finally:
        await engine.shutdown()
    assert seen and all(f.thread == "firstlight-engine" for f in seen)
    assert engine.num_idle_steps == 0


@linux_only
async def test_a_chat_stops_a_yielding_bulk_step() -> None:
    """A bulk step on the idle thread, held in its first layer until a chat is queued, stops
    before its second layer (EngineConfig.interrupt_bulk_steps), and the chat's steps run on
    the engine thread; every output stays exact."""
    engine = AsyncEngine(LLMEngine(tiny_config(bulk_idle_priority_s=60)))
    inside, chat_queued = threading.Event(), threading.Event()
    held_on: list[str] = []

    def in_first_layer(module, args) -> None:
        name = threading.current_thread().name
        if not held_on and name.startswith("firstlight-engine-idle"):
            held_on.append(name)
            inside.set()
            chat_queued.wait(5)

    await engine.start()
    try:
        first = await run_all(engine, [chat("c1")])  # the window opens
        engine.engine.runner.model.layers[0].register_forward_pre_hook(in_first_layer)
        requests = bulk("b", 4)
        streams = asyncio.ensure_future(run_all(engine, requests))
        assert await asyncio.to_thread(inside.wait, 5)
        second = asyncio.ensure_future(tokens(engine, chat("c2")))
        await asyncio.sleep(0)  # `generate` attaches the chat
        chat_queued.set()
        assert await asyncio.wait_for(second, 30) == first["c1"]  # same prompt, greedy
        outputs = await streams
        assert engine.stats().num_interrupted_steps == 1
    finally:
        chat_queued.set()
        await engine.shutdown()
    assert outputs == run(LLMEngine(tiny_config(bulk_idle_priority_s=0)), bulk("b", 4))


@linux_only
def test_the_idle_runner_thread_is_at_idle_priority_and_the_caller_is_not() -> None:
    runner = IdleRunner()
    try:
        policy, name = runner.run(
            lambda: (os.sched_getscheduler(0), threading.current_thread().name)
        )
        assert policy == os.SCHED_IDLE and runner.priority == "SCHED_IDLE"
        assert name.startswith("firstlight-engine-idle")
        assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the caller's own is untouched
        with pytest.raises(ZeroDivisionError):  # errors come back to the caller
            runner.run(lambda: 1 / 0)
        start = time.monotonic()
        assert runner.run(sum, [1, 2, 3]) == 6
        assert time.monotonic() - start < 5
    finally:
        runner.shutdown()


@linux_only
def test_hurry_lifts_the_runner_until_its_next_call() -> None:
    """Where the process may raise a thread's priority (root here and in CI), `hurry` puts
    the runner's thread back at normal priority at once, and its next call lowers it again;
    elsewhere `hurry` changes nothing and never fails."""
    runner = IdleRunner()
    try:
        tid = runner.run(threading.get_native_id)
        assert os.sched_getscheduler(tid) == os.SCHED_IDLE
        runner.hurry()
        may_raise = os.geteuid() == 0
        assert os.sched_getscheduler(tid) == (os.SCHED_OTHER if may_raise else os.SCHED_IDLE)
        assert runner.run(os.sched_getscheduler, 0) == os.SCHED_IDLE
        runner.hurry()
        runner.hurry()  # twice before a call: one lift
        assert runner.run(os.sched_getscheduler, 0) == os.SCHED_IDLE
    finally:
        runner.shutdown()
