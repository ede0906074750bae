"""The bulk gate: bulk requests wait at the caller until the cluster has spare capacity."""

from __future__ import annotations

import asyncio

import pytest

from actors.bulk_gate import BulkGate
from engine.errors import QueueFull
from engine.request import RequestClass
from engine.stats import AdmissionStats, ClassCounts, EngineStats, KVStats
from policies.bulk_throttle import SpareCapacity

BULK, CHAT = RequestClass.BULK, RequestClass.INTERACTIVE


def stats(interactive: int = 0, bulk: int = 0, seats: int = 4) -> EngineStats:
    return EngineStats(
        model="m",
        running=ClassCounts(interactive, bulk),
        waiting=ClassCounts(),
        kv=KVStats(10, 10, 0.0, 0, 0),
        admission=AdmissionStats(8, 2, 2.0, max_running=seats),
    )


def make_gate(view: dict[str, EngineStats], **kwargs) -> BulkGate:
    options = {"max_wait_s": 5.0, "max_waiting": 8, "poll_s": 0.01, **kwargs}
    return BulkGate(
        SpareCapacity(busy_share=0.5, hold_s=0.0, queue_ahead=0.0), lambda: view, **options
    )


async def test_bulk_fills_an_idle_replica_then_waits_for_a_place():
    view = {"r": stats()}
    gate = make_gate(view)
    for _ in range(4):
        assert await gate.acquire(BULK)
    assert gate.room() == 0
    fifth = asyncio.create_task(gate.acquire(BULK))
    await asyncio.sleep(0.05)
    assert not fifth.done() and gate.num_waited == 1
    gate.release()  # one of ours ended: the waiter takes its place
    assert await asyncio.wait_for(fifth, 1.0)
    assert gate.in_flight == 4


async def test_interactive_never_waits_and_chat_load_shrinks_the_bulk_share():
    view = {"r": stats()}
    gate = make_gate(view)
    assert not await gate.acquire(CHAT)  # takes no place
    assert await gate.acquire(BULK) and await gate.acquire(BULK)
    view["r"] = stats(interactive=1, bulk=2)  # chat arrives: half the seats, less its own
    assert gate.room() == 0
    waiter = asyncio.create_task(gate.acquire(BULK))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    view["r"] = stats(bulk=2)  # chat gone: the view refresh alone lets it through
    assert await asyncio.wait_for(waiter, 1.0)


async def test_other_callers_bulk_counts_against_the_allowance():
    gate = make_gate({"r": stats(bulk=3)})  # 3 bulk from another caller
    assert gate.room() == 1


async def test_waiting_is_bounded_in_time_and_in_number():
    view = {"r": stats(interactive=4)}  # every seat chatting: 1 bulk request may move
    gate = make_gate(view, max_wait_s=0.05, max_waiting=1)
    assert await gate.acquire(BULK)
    late = asyncio.create_task(gate.acquire(BULK))
    await asyncio.sleep(0.01)
    with pytest.raises(QueueFull) as full:  # one is already waiting
        await gate.acquire(BULK)
    assert full.value.retry_after_s == 1.0
    with pytest.raises(QueueFull, match="within"):
        await late
    assert gate.num_refused == 2 and not gate._waiting
    families = gate.snapshot()
    assert families["firstlight_bulk_gate_refused"]["series"][0]["value"] == 2
    assert families["firstlight_bulk_gate_waited"]["series"][0]["value"] == 1
    assert families["firstlight_bulk_gate_in_flight"]["series"][0]["value"] == 1


async def test_waiters_pass_in_arrival_order():
    view = {"r": stats()}
    gate = make_gate(view)
    for _ in range(4):
        await gate.acquire(BULK)
    order: list[int] = []

    async def wait(i: int) -> None:
        await gate.acquire(BULK)
        order.append(i)

    tasks = [asyncio.create_task(wait(i)) for i in range(3)]
    await asyncio.sleep(0.03)
    for _ in range(3):
        gate.release()
        await asyncio.sleep(0.02)
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2]


async def test_a_cancelled_waiter_leaves_the_line():
    view = {"r": stats(interactive=4)}
    gate = make_gate(view)
    await gate.acquire(BULK)
    waiter = asyncio.create_task(gate.acquire(BULK))
    await asyncio.sleep(0.02)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert not gate._waiting and gate.in_flight == 1
