"""Autoscaling on real Ray Serve: the replica autoscaler (policies.autoscaling through
actors/autoscaler.py) scales the model replicas up under load and back down, with no failed
request, and times the new replica's cold start; a serverless deployment scales to zero, and
a stream that finds no replica waits with keepalives for one to start."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.actors.helpers import serve_app, small_config
from tests.actors.test_serve_app import scrape, total

pytestmark = [pytest.mark.serve, pytest.mark.slow]

FAST_SCALING = {
    "target_ongoing_requests": 2,
    "upscale_delay_s": 1,
    "downscale_delay_s": 4,
    "look_back_period_s": 2,
}


def running_replicas() -> int:
    from ray import serve

    deployment = serve.status().applications["firstlight"].deployments["ModelReplica"]
    return sum(n for state, n in deployment.replica_states.items() if str(state) == "RUNNING")


async def wait_for(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.25)


async def stream_chat(client: httpx.AsyncClient, tokens: int) -> dict[str, Any]:
    """One streamed chat; what a client saw: status, keepalives before data, finish reason."""
    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": "How do I change my plan?"}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
    }
    seen: dict[str, Any] = {"keepalives": 0, "finish": None, "done": False, "error": None}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        seen["status"] = response.status_code
        async for line in response.aiter_lines():
            if line.startswith(":"):
                seen["keepalives"] += seen["finish"] is None and "first" not in seen
            elif line == "data: [DONE]":
                seen["done"] = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    seen["error"] = event["error"]
                for choice in event.get("choices", []):
                    seen.setdefault("first", True)
                    seen["finish"] = choice.get("finish_reason") or seen["finish"]
    return seen


@pytest.fixture
def dedicated_url() -> Iterator[str]:
    config = small_config(
        replica={
            "num_cpus": 0.5,
            "autoscaling": {"min_replicas": 1, "max_replicas": 2, **FAST_SCALING},
            "stats_interval_s": 0.25,
        },
        ingress={"sync_interval_s": 0.25, "num_cpus": 0.2},
        policies={"autoscaling_options": {"slo": {"stale_after_s": 5}}},
        batch={"enabled": False},
    )
    with serve_app(config, namespace="firstlight-tests-autoscaling") as url:
        yield url


async def test_it_scales_up_under_load_and_back_down_with_no_failed_request(dedicated_url):
    async with httpx.AsyncClient(base_url=dedicated_url, timeout=120) as client:
        assert running_replicas() == 1
        results: list[dict[str, Any]] = []
        stop = asyncio.Event()

        async def user(tokens: int) -> None:
            while not stop.is_set():
                results.append(await stream_chat(client, tokens))

        users = [asyncio.create_task(user(200)) for _ in range(6)]  # 6 in flight, target 2
        await wait_for(lambda: running_replicas() == 2, 60, "a second replica")
        await asyncio.sleep(2.0)  # the new replica serves some of the load
        stop.set()
        await asyncio.gather(*users)
        trickle = asyncio.create_task(user(20))  # one user keeps going through the scale-in
        stop.clear()
        await wait_for(lambda: running_replicas() == 1, 60, "the scale back to one replica")
        stop.set()
        await trickle
        assert len(results) >= 8
        failed = [r for r in results if r["status"] != 200 or r["error"] or not r["done"]]
        assert failed == []
        assert all(r["finish"] == "length" for r in results)
        metrics = await scrape(client)
        assert total(metrics, "firstlight_cold_start_seconds_count") >= 1
        cold = total(metrics, "firstlight_cold_start_seconds_sum")
        assert 0.0 < cold < 60.0


@pytest.fixture
def serverless_url() -> Iterator[str]:
    config = small_config(
        replica={
            "num_cpus": 0.5,
            "autoscaling": {
                "mode": "serverless",
                "max_replicas": 1,
                **FAST_SCALING,
                "downscale_to_zero_delay_s": 2,
            },
            "stats_interval_s": 0.25,
        },
        ingress={"sync_interval_s": 0.25, "num_cpus": 0.2},
        keepalive_s=0.5,
        batch={"enabled": False},
    )
    with serve_app(config, namespace="firstlight-tests-serverless") as url:
        yield url


async def test_a_serverless_model_scales_to_zero_and_a_stream_waits_for_a_replica(serverless_url):
    async with httpx.AsyncClient(base_url=serverless_url, timeout=120) as client:
        await wait_for(lambda: running_replicas() == 0, 60, "the scale to zero")
        metrics = await scrape(client)
        before = total(metrics, "firstlight_cold_start_seconds_count")
        seen = await stream_chat(client, 8)
        assert seen["status"] == 200 and seen["done"] and seen["error"] is None
        assert seen["finish"] == "length"
        assert seen["keepalives"] >= 1  # it waited for the replica with keepalives, no error
        assert running_replicas() == 1

        async def timed() -> bool:
            return total(await scrape(client), "firstlight_cold_start_seconds_count") > before

        deadline = time.monotonic() + 20
        while not await timed():
            assert time.monotonic() < deadline, "no cold start reported"
            await asyncio.sleep(0.5)
