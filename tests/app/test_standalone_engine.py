"""Bare mode end to end: the app over the real in-process `AsyncEngine` and the demo model.

Skipped only while the engine package or the built demo model is missing (`make demo`
builds it); any other failure is a real failure.
"""

from __future__ import annotations

import httpx
import pytest

from tests.app.helpers import demo_app, live_server, parse_sse, wait_until

pytestmark = pytest.mark.slow


async def test_chat_streamed_and_not_against_the_real_engine():
    app = demo_app()
    engine = app.state.firstlight.endpoints.all[0].client
    question = [{"role": "user", "content": "Can I pause my annual subscription?"}]
    async with live_server(app, lifespan="on") as url, httpx.AsyncClient(base_url=url) as client:
        models = (await client.get("/v1/models")).json()
        name = models["data"][0]["id"]
        body = {"model": name, "messages": question, "max_tokens": 12, "temperature": 0}
        reply = await client.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        data = reply.json()
        assert data["choices"][0]["finish_reason"] in ("stop", "length")
        assert 0 < data["usage"]["completion_tokens"] <= 12
        assert (
            data["firstlight"]["ttft_s"] is not None
            and "ttft;dur=" in reply.headers["server-timing"]
        )

        streamed = await client.post(
            "/v1/chat/completions",
            json={**body, "stream": True, "stream_options": {"include_usage": True}},
        )
        chunks = parse_sse(streamed.content)
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        text = "".join(c["choices"][0]["delta"]["content"] for c in chunks if c["choices"])
        assert text  # (not compared with the first answer: batch shapes may flip near-ties)
        usage = chunks[-1]["usage"]
        assert usage["prompt_tokens"] == data["usage"]["prompt_tokens"]
        assert 0 < usage["completion_tokens"] <= 12
        assert chunks[-1]["firstlight"]["ttft_s"] is not None

        async with client.stream(
            "POST", "/v1/chat/completions",
            json={**body, "max_tokens": 200, "ignore_eos": True, "stream": True},
        ) as response:  # fmt: skip
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    break  # walk away mid-stream: the engine must abort the request
        await wait_until(lambda: engine.num_cancelled >= 1)
        metrics = (await client.get("/metrics")).text
    assert "firstlight_time_to_first_token_seconds_bucket" in metrics
    assert 'firstlight_request_cancelled_total{class="interactive"' in metrics


async def test_a_seeded_sampled_request_repeats_with_speculative_decoding_on():
    """With the demo draft model proposing every step, the same seeded request at
    temperature 1 gives the same text each time (an unfamiliar prompt: the demo model's
    distribution is flat there, so drafts would change what rejection sampling keeps), while
    unseeded requests get drafts."""
    speculative = {"method": "draft_model", "draft_model": "demo-draft", "policy": "fixed"}
    app = demo_app(speculative=speculative)
    engine = app.state.firstlight.endpoints.all[0].client.engine
    body = {"model": "demo", "prompt": "Hello, how", "max_tokens": 24, "temperature": 1.0}
    async with live_server(app, lifespan="on") as url, httpx.AsyncClient(base_url=url) as client:

        async def text(**extra) -> str:
            reply = await client.post("/v1/completions", json={**body, **extra})
            assert reply.status_code == 200, reply.text
            return reply.json()["choices"][0]["text"]

        await text()
        assert engine.counters.num_drafts > 0
        seeded = [await text(seed=1234) for _ in range(4)]
    assert len(set(seeded)) == 1, seeded
