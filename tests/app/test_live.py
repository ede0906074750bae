"""Behaviour over a real socket (uvicorn on 127.0.0.1): keepalives, client disconnects, and
the official `openai` SDK with strict response validation."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.app.fakes import FakeEngine, Script, queue_full
from tests.app.helpers import chat_body, live_server, make_app, parse_sse, wait_until


async def test_keepalive_only_after_an_idle_gap():
    gate = asyncio.Event()
    script = Script(pieces=tuple("abcdefgh"), delay_s=0.005, gate=gate)
    app, engine = make_app(FakeEngine(script=script), keepalive_s=0.1)
    async with live_server(app) as url, httpx.AsyncClient(base_url=url) as client:
        call = asyncio.create_task(client.post("/v1/chat/completions", json=chat_body(stream=True)))
        await wait_until(lambda: bool(engine.requests))
        await asyncio.sleep(0.35)  # the request "queues" in the engine for 350 ms
        gate.set()
        response = await call
    events = parse_sse(response.content)
    first_data = next(i for i, e in enumerate(events) if isinstance(e, dict))
    assert 2 <= first_data <= 4  # ~0.35 s / 0.1 s of idle
    assert events[:first_data] == [": keepalive"] * first_data
    flowing = events[first_data:]
    assert all(isinstance(e, dict) for e in flowing)  # none while tokens flow (5 ms apart)
    assert "".join(e["choices"][0]["delta"]["content"] for e in flowing) == "abcdefgh"


@pytest.mark.parametrize("stage", ["mid_stream", "before_first_token", "non_streamed"])
async def test_client_disconnect_aborts_the_engine_request(stage):
    gate = asyncio.Event()
    if stage == "mid_stream":
        gate.set()
    script = Script(pieces=("tok",) * 500, delay_s=0.01, gate=gate)
    app, engine = make_app(FakeEngine(script=script))
    async with live_server(app) as url, httpx.AsyncClient(base_url=url) as client:
        body = chat_body(stream=stage != "non_streamed")
        if stage == "mid_stream":
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        break  # got a token chunk; now walk away
        else:
            call = asyncio.create_task(client.post("/v1/chat/completions", json=body))
            await wait_until(lambda: bool(engine.requests))
            await asyncio.sleep(0.05)
            call.cancel()
        await wait_until(lambda: bool(engine.aborted))
        assert engine.aborted == [engine.requests[0].request_id]
        assert engine.completed == []
        metrics = (await client.get("/metrics")).text
    assert 'firstlight_request_cancelled_total{class="interactive"' in metrics


async def test_openai_sdk_strict_validation_chat_and_completions():
    app, _ = make_app(FakeEngine(script=Script(pieces=("Hello", " there", "!"), delay_s=0.002)))
    async with live_server(app) as url:
        client = openai.AsyncOpenAI(
            base_url=f"{url}/v1", api_key="unused", max_retries=0,
            _strict_response_validation=True,
        )  # fmt: skip
        async with client:
            reply = await client.chat.completions.create(
                model="demo", messages=[{"role": "user", "content": "Hi"}], logprobs=True,
                top_logprobs=1,
            )  # fmt: skip
            assert reply.choices[0].message.content == "Hello there!"
            assert reply.choices[0].finish_reason == "stop"
            assert reply.choices[0].logprobs.content[0].token == "Hello"
            assert reply.usage.total_tokens > reply.usage.prompt_tokens

            stream = await client.chat.completions.create(
                model="demo", messages=[{"role": "user", "content": "Hi"}], stream=True,
                stream_options={"include_usage": True},
            )  # fmt: skip
            chunks = [chunk async for chunk in stream]
            assert chunks[0].choices[0].delta.role == "assistant"
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert text == "Hello there!"
            assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0

            done = await client.completions.create(model="demo", prompt="Hi", logprobs=1)
            assert done.choices[0].text == "Hello there!"
            assert done.choices[0].logprobs.text_offset == [0, 5, 11]

            models = await client.models.list()
            assert [m.id for m in models.data] == ["demo"]

            with pytest.raises(openai.NotFoundError):
                await client.chat.completions.create(
                    model="nope", messages=[{"role": "user", "content": "Hi"}]
                )
            with pytest.raises(openai.BadRequestError) as bad:
                await client.chat.completions.create(
                    model="demo", messages=[{"role": "user", "content": "Hi"}], top_p=5
                )
            assert bad.value.param == "top_p"


async def test_openai_sdk_sees_rate_limit_with_retry_after():
    app, _ = make_app(FakeEngine(script=queue_full()))
    async with live_server(app) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        async with client:
            with pytest.raises(openai.RateLimitError) as err:
                await client.chat.completions.create(
                    model="demo", messages=[{"role": "user", "content": "Hi"}], stream=True
                )
    assert err.value.response.headers["retry-after"] == "3"
    assert err.value.code == "queue_full"
