"""Admission over HTTP, bare mode with the real engine and demo model: a bulk flood leaves
room for interactive requests, and the `Retry-After` a client receives is the admission
decision's value for a controlled drain rate (a fake clock in the engine's `Admission`).

Skipped only while the built demo model is missing (`make demo` builds it)."""

from __future__ import annotations

import asyncio
import math

import pytest

from app.endpoint import ModelEndpoint
from app.openai_server import build_app
from app.settings import Settings
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig, SchedulerConfig
from engine.request import RequestClass
from engine.sched.admission import Admission
from engine.stats import ClassCounts
from tests.app.helpers import chat_body, make_client, wait_until
from tests.engine.step_gate import FakeClock, StepGate

pytestmark = pytest.mark.slow

BULK = {"x-firstlight-class": "bulk"}


def demo_engine(admission: Admission) -> AsyncEngine:
    try:
        from demo.paths import resolve_model

        config = EngineConfig(
            model="demo", scheduler=SchedulerConfig(max_num_seqs=1, max_waiting=4)
        )
        return AsyncEngine.from_config(config, resolve_model=resolve_model, admission=admission)
    except FileNotFoundError as exc:
        pytest.skip(f"demo model not available: {exc}")


def body(**overrides):
    return chat_body(max_tokens=2, temperature=0, ignore_eos=True, **overrides)


async def test_bulk_flood_leaves_interactive_room_and_retry_after_is_the_decisions():
    clock = FakeClock()
    admission = Admission(4, interactive_reserve=1, clock=clock)
    engine = demo_engine(admission)
    endpoint = ModelEndpoint(
        name="demo", tokenizer=engine.tokenizer, max_model_len=engine.max_model_len, client=engine
    )
    app = build_app([endpoint], Settings())
    await engine.start()
    admitted: list[asyncio.Task] = []
    gate: StepGate | None = None
    try:
        async with make_client(app) as client:
            for _ in range(3):  # finishes at t = 0, 2, 4: a drain rate of 0.5 per second
                assert (await client.post("/v1/chat/completions", json=body())).status_code == 200
                clock.advance(2.0)
            clock.advance(-2.0)
            assert admission.drain.rate_per_s() == pytest.approx(0.5)

            gate = StepGate(engine.engine)  # nothing leaves the queue until it opens

            def post(headers=None, **overrides):
                return client.post(
                    "/v1/chat/completions", json=body(**overrides), headers=headers or {}
                )

            admitted += [asyncio.create_task(post(BULK)) for _ in range(4)]  # 1 seat, 3 wait
            await wait_until(lambda: engine.num_waiting_by_class == ClassCounts(bulk=3))

            refused = await post(BULK, stream=True)  # the last place is kept for interactive
            assert refused.status_code == 429
            assert refused.json()["error"]["type"] == "rate_limit_error"
            decision = admission.retry_after_s(RequestClass.BULK, ClassCounts(bulk=3))
            assert decision == pytest.approx(6.0)  # 3 ahead at 0.5 per second
            assert refused.headers["retry-after"] == str(math.ceil(decision)) == "6"

            admitted.append(asyncio.create_task(post()))  # interactive: room remains
            await wait_until(
                lambda: engine.num_waiting_by_class == ClassCounts(bulk=4)  # chat seated first
            )
            full = await post(stream=True)
            assert full.status_code == 429
            assert full.headers["retry-after"] == "2"  # one must leave first, at 0.5 per second
            metrics = (await client.get("/metrics")).text  # both refusals counted, by class
            refusals = {
                cls: sum(
                    float(line.rsplit(" ", 1)[1])
                    for line in metrics.splitlines()
                    if line.startswith("firstlight_request_error_total{")
                    and 'code="queue_full"' in line
                    and f'class="{cls}"' in line
                )
                for cls in ("bulk", "interactive")
            }
            assert refusals == {"bulk": 1.0, "interactive": 1.0}, metrics

            gate.open()
            answers = await asyncio.gather(*admitted)
            assert [a.status_code for a in answers] == [200] * 5
            assert all(a.json()["usage"]["completion_tokens"] == 2 for a in answers)
    finally:
        if gate is not None:
            gate.open()
        for task in admitted:
            task.cancel()
        await asyncio.gather(*admitted, return_exceptions=True)
        await engine.shutdown()
