"""Bad requests at the HTTP edge: each is a 4xx in the OpenAI error schema naming the
parameter, and none of them disturbs a stream that is flowing at the same time."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time

import httpx

from engine.request import Request
from tests.app.fakes import FakeEngine, Script
from tests.app.helpers import chat_body, live_server, make_app, make_client

HUGE = "Hello there! " * 300_000  # 3.9 MB


async def post(app, path="/v1/chat/completions", **kwargs) -> httpx.Response:
    async with make_client(app) as client:
        return await client.post(path, **kwargs)


def error_of(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, (response.status_code, response.text)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


async def test_deeply_nested_json_is_400():
    app, engine = make_app()
    for raw in (b"[" * 5000 + b"]" * 5000, b'{"metadata":' + b"[" * 5000 + b"]" * 5000 + b"}"):
        error = error_of(await post(app, content=raw))
        assert "nested" in error["message"]
    assert engine.requests == []


async def test_lone_surrogate_is_400_naming_the_field():
    app, engine = make_app()
    raw = b'{"model":"demo","messages":[{"role":"user","content":"hi \\ud800"}]}'
    error = error_of(await post(app, content=raw, headers={"content-type": "application/json"}))
    assert error["param"] == "messages[0].content"
    raw = b'{"model":"demo","prompt":"\\udc00"}'
    assert error_of(await post(app, "/v1/completions", content=raw))["param"] == "prompt"
    assert engine.requests == []


async def test_unimplemented_fields_are_400_and_defaults_pass():
    app, engine = make_app()
    cases = {"logit_bias": {"15": 5}, "functions": [{"name": "lookup"}]}
    for field, value in cases.items():
        error = error_of(await post(app, json=chat_body(**{field: value})))
        assert (error["param"], error["code"]) == (field, "unsupported_parameter")
    error = error_of(await post(app, "/v1/completions", json={"prompt": "Hi", "tools": [
        {"type": "function", "function": {"name": "lookup"}}]}))  # fmt: skip
    assert (error["param"], error["code"]) == ("tools", "unsupported_parameter")
    assert engine.requests == []
    response = await post(app, json=chat_body(tools=[], response_format={"type": "text"}))
    assert response.status_code == 200, response.text


async def test_more_prompts_times_n_than_admittable_is_400_stating_the_limit():
    app, engine = make_app(max_requests=6)
    body = {"model": "demo", "prompt": ["Hi"] * 4, "n": 2}
    error = error_of(await post(app, "/v1/completions", json=body))
    assert error["param"] == "n" and "at most 6" in error["message"]
    assert engine.requests == []
    body["n"] = 1
    assert (await post(app, "/v1/completions", json=body)).status_code == 200


async def test_a_seed_with_n_never_derives_an_out_of_range_seed():
    app, engine = make_app()
    response = await post(app, json=chat_body(n=3, seed=2**63 - 1))
    assert response.status_code == 200, response.text
    assert [r.sampling.seed for r in engine.requests] == [2**63 - 1, 0, 1]


async def _stream_gaps_while(app, other: dict, path: str) -> tuple[httpx.Response, float, float]:
    """Post `other` while a long stream flows: its response, how long it took, and the
    stream's largest chunk gap meanwhile (blocking the loop would make the two equal)."""
    async with live_server(app) as url, httpx.AsyncClient(base_url=url, timeout=60) as client:
        arrivals: list[float] = []

        async def stream() -> None:
            body = chat_body(stream=True)
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        arrivals.append(time.monotonic())

        streaming = asyncio.create_task(stream())
        while len(arrivals) < 5:
            await asyncio.sleep(0.01)
        started = time.monotonic()
        other_response = await client.post(path, json=other)
        ended = time.monotonic()
        took = ended - started
        during = [started, *(a for a in arrivals if a >= started), ended]
        assert not streaming.done()  # the gaps cover all the time `other` took
        streaming.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await streaming
    gaps = [b - a for a, b in itertools.pairwise(during)]
    return other_response, took, max(gaps)


async def test_a_huge_prompt_is_refused_untokenized_while_another_stream_flows():
    app, _ = make_app(FakeEngine(script=Script(pieces=("tok",) * 5000, delay_s=0.005)))
    response, _, worst_gap = await _stream_gaps_while(
        app, {"model": "demo", "prompt": HUGE}, "/v1/completions"
    )
    error = error_of(response)
    assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded")
    assert worst_gap < 0.5, worst_gap


async def test_a_huge_prompt_that_may_fit_is_tokenized_while_another_stream_flows():
    # a context large enough that only tokenizing can tell: the work runs in a thread
    flowing, short = Script(pieces=("tok",) * 5000, delay_s=0.005), Script()

    def script(request: Request) -> Script:
        return short if len(request.prompt_token_ids) > 1000 else flowing

    app, _ = make_app(FakeEngine(script=script), max_model_len=10**7)
    response, took, worst_gap = await _stream_gaps_while(
        app, {"model": "demo", "prompt": HUGE, "max_tokens": 1}, "/v1/completions"
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] > 1_000_000
    # tokenizing took seconds; on the loop the stream would have stalled for all of them
    assert took > 1.0 and worst_gap < max(0.5, took / 5), (took, worst_gap)
