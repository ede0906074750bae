"""Builders for HTTP-layer tests: an app over a `FakeEngine` or over the real engine and the
demo model, an in-process client, a real uvicorn server on 127.0.0.1, and an SSE body parser
that insists on exact framing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI

from app.endpoint import ModelEndpoint
from app.openai_server import build_app
from app.settings import Settings
from tests.app.fakes import FakeEngine

MODEL = "demo"
MAX_MODEL_LEN = 128


def make_app(
    engine: FakeEngine | None = None,
    *,
    max_model_len: int = MAX_MODEL_LEN,
    max_requests: int | None = None,
    **settings: Any,
) -> tuple[FastAPI, FakeEngine]:
    engine = engine or FakeEngine()
    endpoint = ModelEndpoint(
        name=MODEL,
        tokenizer=engine.tokenizer,
        max_model_len=max_model_len,
        client=engine,
        root="/models/demo",
        max_requests=max_requests,
    )
    return build_app([endpoint], Settings(**settings)), engine


def demo_app(**engine: Any) -> FastAPI:
    """The bare-mode app over the real engine and the demo model (`engine`: settings on
    top of `model: demo`); skips the test while the engine or the demo model is missing.
    One per test: the engine loop lives and dies with the test's event loop."""
    import pytest

    try:
        from app.standalone import build_standalone

        return build_standalone(Settings(engine={"model": "demo", **engine}))
    except (ImportError, FileNotFoundError) as exc:
        pytest.skip(f"engine or demo model not available: {exc}")


def sdk_client(url: str) -> Any:
    """The OpenAI SDK's async client on the server at `url`, validating every response
    against the SDK's own types (no retries: a failure shows as it happened)."""
    from openai import AsyncOpenAI

    return AsyncOpenAI(
        base_url=f"{url}/v1",
        api_key="unused",
        max_retries=0,
        timeout=120,
        _strict_response_validation=True,
    )


def make_client(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def chat_body(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}]}
    body.update(overrides)
    return body


@contextlib.asynccontextmanager
async def live_server(app: FastAPI, lifespan: str = "off") -> AsyncIterator[str]:
    """Run `app` under uvicorn on a free 127.0.0.1 port in this event loop; yields the URL."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan=lifespan)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.005)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


async def wait_until(predicate: Callable[[], bool], timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def parse_sse(body: bytes) -> list[Any]:
    """Events of an SSE body; asserts exact `data: <json>\\n\\n` framing ending in [DONE].

    Returns the decoded JSON events (without [DONE]); comments are returned as the string
    ":" + text so tests can assert where keepalives appear.
    """
    assert body.endswith(b"data: [DONE]\n\n"), body[-80:]
    frames = body.split(b"\n\n")
    assert frames[-1] == b""
    out: list[Any] = []
    for frame in frames[:-2]:
        assert b"\n" not in frame, frame
        if frame.startswith(b":"):
            out.append(frame.decode())
            continue
        assert frame.startswith(b"data: "), frame
        payload = frame[len(b"data: ") :]
        assert payload == json.dumps(json.loads(payload), separators=(",", ":"),
                                     ensure_ascii=False).encode()  # fmt: skip
        out.append(json.loads(payload))
    assert frames[-2] == b"data: [DONE]"
    return out
