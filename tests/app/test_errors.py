"""Every failure a client can meet, in the OpenAI error schema with the right status."""

from __future__ import annotations

import pytest

from engine.errors import InvalidRequest
from engine.request import FinishReason
from tests.app.fakes import FakeEngine, Script, queue_full, unavailable
from tests.app.helpers import MAX_MODEL_LEN, chat_body, make_app, make_client, parse_sse


async def request(engine=None, *, path="/v1/chat/completions", settings=None, **kwargs):
    app, engine = make_app(engine, **(settings or {}))
    async with make_client(app) as client:
        response = await client.post(path, **kwargs)
    return response, engine


def error_of(response, status: int) -> dict:
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "Traceback" not in error["message"]
    return error


async def test_bad_json_and_non_object_bodies_are_400():
    response, _ = await request(content=b'{"model": "demo", ')
    error = error_of(response, 400)
    assert error["type"] == "invalid_request_error" and "JSON" in error["message"]
    response, _ = await request(content=b"[1, 2]")
    assert "JSON object" in error_of(response, 400)["message"]
    response, _ = await request(content=b"")
    error_of(response, 400)


async def test_wrong_types_are_400_never_422_and_name_the_param():
    cases = {
        "temperature": chat_body(temperature="hot"),
        "messages": chat_body(messages="hello"),
        "messages[0].content": chat_body(messages=[{"role": "user", "content": 5}]),
        "messages[0].role": chat_body(messages=[{"content": "hi"}]),
        "stop": chat_body(stop=[1, 2]),
        "stream": chat_body(stream="maybe"),
        "max_tokens": chat_body(max_tokens="many"),
        "n": chat_body(n="2"),  # strict: OpenAI refuses a string or a bool for a number
        "logprobs": chat_body(logprobs="yes"),
        "stream_options.include_usage": chat_body(stream_options={"include_usage": 1}),
    }
    for param, body in cases.items():
        response, engine = await request(json=body)
        error = error_of(response, 400)
        assert error["param"] == param, (param, error)
        assert engine.requests == []
    response, _ = await request(json={"model": "demo"})
    assert error_of(response, 400)["param"] == "messages"


async def test_bad_values_are_400_with_the_param():
    cases = {
        "top_p": chat_body(top_p=2),
        "temperature": chat_body(temperature=-1),
        "max_tokens": chat_body(max_tokens=0),
        "n": chat_body(n=0),
        "min_tokens": chat_body(min_tokens=50, max_tokens=10),
        "top_logprobs": chat_body(logprobs=True, top_logprobs=50),
        "max_completion_tokens": chat_body(max_completion_tokens=-3),
        "stop": chat_body(stop=[f"s{i}" for i in range(33)]),
        "service_tier": chat_body(service_tier="platinum"),
        "messages[0].role": chat_body(messages=[{"role": "wizard", "content": "hi"}]),
        "messages[1].content": chat_body(
            messages=[{"role": "system", "content": "x"}, {"role": "user", "content": None}]
        ),
        "messages[0].content": chat_body(messages=[{"role": "user"}]),  # no content key
        "seed": chat_body(seed=1.5),
    }
    for param, body in cases.items():
        response, _ = await request(json=body)
        assert error_of(response, 400)["param"] == param, param
    response, _ = await request(json=chat_body(n=5), settings={"max_n": 4})
    assert error_of(response, 400)["param"] == "n"


async def test_context_overflow_is_400():
    long = "Hello there! " * MAX_MODEL_LEN
    response, engine = await request(json=chat_body(messages=[{"role": "user", "content": long}]))
    error = error_of(response, 400)
    assert (error["param"], error["code"]) == ("messages", "context_length_exceeded")
    assert engine.requests == []
    response, _ = await request(json=chat_body(max_tokens=MAX_MODEL_LEN))
    error = error_of(response, 400)
    assert (error["param"], error["code"]) == ("max_tokens", "context_length_exceeded")


async def test_engine_value_error_is_400():
    script = Script(raise_first=InvalidRequest("prompt", "token ids must be in [0, 10)"))
    response, _ = await request(FakeEngine(script=script), json=chat_body())
    error = error_of(response, 400)
    assert error["param"] == "prompt" and "token ids" in error["message"]


async def test_unknown_model_and_route_are_404():
    response, engine = await request(json=chat_body(model="gpt-17"))
    error = error_of(response, 404)
    assert (error["code"], error["param"]) == ("model_not_found", "model")
    assert "gpt-17" in error["message"] and engine.requests == []
    app, _ = make_app()
    async with make_client(app) as client:
        error_of(await client.get("/v1/nothing"), 404)


async def test_body_too_large_is_413_before_parsing():
    body = b'{"junk": "' + b"x" * 5000 + b'"}'
    response, _ = await request(content=body, settings={"max_body_bytes": 4096})
    assert error_of(response, 413)["code"] == "request_too_large"

    async def chunked():  # no Content-Length: counted while buffering
        for _ in range(5):
            yield b"x" * 1000

    response, _ = await request(content=chunked(), settings={"max_body_bytes": 4096})
    error_of(response, 413)

    async def small_chunked():
        yield b'{"model": "demo", "messages": '
        yield b'[{"role": "user", "content": "Hi"}]}'

    response, _ = await request(content=small_chunked(), settings={"max_body_bytes": 4096})
    assert response.status_code == 200, response.text


async def test_queue_full_is_429_with_retry_after():
    for stream in (False, True):
        engine = FakeEngine(script=queue_full())
        response, _ = await request(engine, json=chat_body(stream=stream))
        error = error_of(response, 429)
        assert response.headers["retry-after"] == "3"  # ceil(2.5)
        assert (error["type"], error["code"]) == ("rate_limit_error", "queue_full")
        assert response.headers["x-request-id"]


async def test_no_engine_is_503():
    for stream in (False, True):
        response, _ = await request(FakeEngine(script=unavailable()), json=chat_body(stream=stream))
        assert error_of(response, 503)["code"] == "engine_unavailable"


async def test_unexpected_failure_is_500_without_internals():
    script = Script(raise_first=RuntimeError("secret internal detail"))
    response, _ = await request(FakeEngine(script=script), json=chat_body(),
                                headers={"x-request-id": "boom-1"})  # fmt: skip
    error = error_of(response, 500)
    assert "secret" not in error["message"] and "boom-1" in error["message"]
    assert response.headers["x-request-id"] == "boom-1"


async def test_engine_error_finish_is_500_non_streamed():
    script = Script(finish=FinishReason.ERROR, error="CUDA had a bad day")
    response, _ = await request(FakeEngine(script=script), json=chat_body())
    error = error_of(response, 500)
    assert error["code"] == "engine_error" and "bad day" in error["message"]


async def test_mid_stream_error_is_an_sse_error_event_then_done():
    engine = FakeEngine(script=Script(pieces=("a", "b", "c"), delay_s=0.003, raise_after=2))
    response, engine = await request(engine, json=chat_body(stream=True))
    assert response.status_code == 200
    events = parse_sse(response.content)
    assert [e["choices"][0]["delta"]["content"] for e in events[:-1]] == ["a", "b"]
    error = events[-1]["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "server_error" and "Traceback" not in error["message"]

    script = Script(pieces=("a", "b"), delay_s=0.003, finish=FinishReason.ERROR, error="oops")
    response, _ = await request(FakeEngine(script=script), json=chat_body(stream=True))
    events = parse_sse(response.content)
    assert events[0]["choices"][0]["delta"]["content"] == "a"
    assert events[-1]["error"]["message"] == "oops"


async def test_error_in_first_output_of_a_stream_is_still_an_http_status():
    script = Script(pieces=("a",), finish=FinishReason.ABORT)
    response, _ = await request(FakeEngine(script=script), json=chat_body(stream=True))
    assert error_of(response, 503)["code"] == "engine_error"


async def test_a_client_gone_mid_body_is_one_info_line(caplog):
    """Headers announce 500 bytes, 9 arrive, the socket closes: nobody to answer, and the
    log says so in one INFO line, no traceback; the next request is served."""
    import asyncio
    import logging
    from urllib.parse import urlparse

    import httpx

    from tests.app.helpers import live_server

    app, _ = make_app()
    with caplog.at_level(logging.INFO, logger="firstlight.app"):
        async with live_server(app) as url:
            address = urlparse(url)
            _, writer = await asyncio.open_connection(address.hostname, address.port)
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                b'Content-Type: application/json\r\nContent-Length: 500\r\n\r\n{"model":'
            )
            await writer.drain()
            await asyncio.sleep(0.1)
            writer.close()
            await writer.wait_closed()
            for _ in range(100):
                if "before its body ended" in caplog.text:
                    break
                await asyncio.sleep(0.02)
            async with httpx.AsyncClient(base_url=url) as client:
                assert (
                    await client.post("/v1/chat/completions", json=chat_body())
                ).status_code == 200
    gone = [r for r in caplog.records if "before its body ended" in r.getMessage()]
    assert len(gone) == 1 and gone[0].levelno == logging.INFO and gone[0].exc_info is None
    assert not any(r.exc_info for r in caplog.records), caplog.text


async def test_models_are_listed_and_retrieved_through_the_sdk():
    import openai

    from tests.app.helpers import MODEL, live_server

    app, _ = make_app()
    async with live_server(app) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        listed = [m.id async for m in client.models.list()]
        model = await client.models.retrieve(MODEL)
        assert listed == [MODEL] and model.id == MODEL and model.object == "model"
        with pytest.raises(openai.NotFoundError) as missing:
            await client.models.retrieve("nope")
        assert missing.value.body["code"] == "model_not_found"


async def test_what_clients_commonly_send_is_taken():
    """Strict types, but not stricter than clients: whole-number floats for counts (a value
    computed in Python: `json.dumps(1e3)` is `1000.0`), integers for numbers, nulls for
    optional fields, an assistant turn of tool calls without content, a function result."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello"}]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    body = chat_body(
        messages=messages, max_tokens=50.0, n=1.0, seed=42.0, temperature=1, top_p=1,
        stop=[], stream_options=None, service_tier="auto", logprobs=False, top_logprobs=None,
    )  # fmt: skip
    response, engine = await request(json=body)
    assert response.status_code == 200, response.text
    [sent] = engine.requests
    assert (sent.sampling.max_tokens, sent.sampling.seed) == (50, 42)
