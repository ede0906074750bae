"""Prefix-affinity routing on real Ray Serve with two model replicas.

Requests that share a long system prompt all land on one replica, whose prefix cache then
serves that prompt; unrelated requests still spread over both replicas.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from tests.actors.helpers import serve_app, small_config
from tests.actors.test_serve_app import scrape

pytestmark = [pytest.mark.serve, pytest.mark.slow]

SYSTEM = (
    "You are the support assistant of a subscription service. Answer briefly, politely and "
    "only about accounts, billing, plans, pauses, refunds and cancellations. "
) * 4


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    config = small_config(
        replica={
            "num_cpus": 0.5,
            "autoscaling": {"min_replicas": 2, "max_replicas": 2},
            "stats_interval_s": 0.2,
        },
        ingress={"sync_interval_s": 0.2, "num_cpus": 0.2},
        policies={"routing": "prefix_affinity"},
    )
    with serve_app(config, namespace="firstlight-tests-routing") as url:
        yield url


def by_replica(metrics: dict, name: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for labels, value in metrics.get(name, {}).items():
        replica = dict(labels).get("replica")
        if replica is not None:
            out[replica] = out.get(replica, 0.0) + value
    return out


async def settle(client: httpx.AsyncClient, replicas: int = 2) -> dict:
    """A scrape once both replicas report (their stats reach /metrics every ~0.2 s)."""
    for _ in range(100):
        metrics = await scrape(client)
        if len(by_replica(metrics, "firstlight_prefix_cache_queries_total")) >= replicas:
            return metrics
        await asyncio.sleep(0.1)
    raise AssertionError("replica metrics did not show up")


def chat(question: str, system: str | None = SYSTEM) -> dict:
    messages = [{"role": "user", "content": question}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    return {"model": "demo", "messages": messages, "max_tokens": 2, "temperature": 0}


async def test_a_shared_prompt_sticks_to_one_replica_and_the_rest_spreads(base_url):
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        before = await settle(client)
        hits0 = by_replica(before, "firstlight_prefix_cache_hits_total")
        queries0 = by_replica(before, "firstlight_prefix_cache_queries_total")
        questions = [f"Question {i}: can I pause my plan for {i + 1} months?" for i in range(6)]
        for question in questions:
            assert (
                await client.post("/v1/chat/completions", json=chat(question))
            ).status_code == 200
        await asyncio.sleep(0.8)  # two stats pushes
        after = await scrape(client)
        hits = {
            r: v - hits0.get(r, 0.0)
            for r, v in by_replica(after, "firstlight_prefix_cache_hits_total").items()
        }
        # the 5 requests after the first read the system prompt (~100+ tokens) from one cache
        assert sum(hits.values()) >= 5 * 96
        assert max(hits.values()) == sum(hits.values())

        # unrelated prompts, 8 at once, use both replicas
        queries1 = by_replica(after, "firstlight_prefix_cache_queries_total")
        unrelated = [
            client.post("/v1/chat/completions", json=chat(f"{i} " * (20 + 9 * i), system=None))
            for i in range(8)
        ]
        assert all(r.status_code == 200 for r in await asyncio.gather(*unrelated))
        await asyncio.sleep(0.8)
        queries2 = by_replica(await scrape(client), "firstlight_prefix_cache_queries_total")
        grew = [r for r, v in queries2.items() if v > queries1.get(r, 0.0)]
        assert len(grew) == 2, (queries0, queries1, queries2)


async def test_a_router_that_never_sent_a_prefix_finds_the_replica_holding_it(base_url):
    """Routing follows what replicas report holding: a second router (this test's own
    handle), which never sent the prefix anywhere, sends it where the ingress's router put
    it, because that replica's prefix sketch lists its blocks."""
    from ray import serve

    from engine.request import Request, SamplingParams

    prefix = [(7 * i + 3) % 1000 + 10 for i in range(160)]  # 10 full blocks
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        await settle(client)
        body = {"model": "demo", "prompt": [*prefix, 5, 6, 7], "max_tokens": 1}
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        await asyncio.sleep(1.0)  # the holder's next stats push carries the blocks
        before = by_replica(await scrape(client), "firstlight_prefix_cache_hits_total")

        handle = serve.get_deployment_handle("ModelReplica", app_name="firstlight")
        stream = handle.options(stream=True)

        async def generate(rid: str, ids: list[int]) -> None:
            request = Request(rid, ids, SamplingParams(max_tokens=1))
            async for _ in stream.generate.remote(request):
                pass

        await generate("warm-router", [3, 1, 4, 1, 5, 9, 2, 6])  # starts its sketch sync
        await asyncio.sleep(1.0)
        await generate("same-prefix", [*prefix, 8, 9])
        await asyncio.sleep(0.8)
        after = by_replica(await scrape(client), "firstlight_prefix_cache_hits_total")
        grew = {r: v - before.get(r, 0.0) for r, v in after.items() if v > before.get(r, 0.0)}
        assert len(grew) == 1 and next(iter(grew.values())) >= 160, (before, after)
