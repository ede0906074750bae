"""The playground page in headless Chromium over a real uvicorn server (fake engine): API keys
kept in the browser's session storage and sent as a Bearer header, every error shown as the
message the API returned, and the speculative-decoding row shown only when a server sends it.
The real application (Ray Serve, demo model) is driven in tests/actors/test_playground_serve.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn

from app.playground.browser import Chromium, Playground, find_chromium, headless_chromium
from engine.request import Request, RequestClass
from tests.app.fakes import FakeEngine, Script, queue_full
from tests.app.helpers import chat_body, make_app

pytestmark = pytest.mark.slow

KEY = "sk-playground-test"


def script_for(request: Request) -> Script:
    """The fake's answer, chosen by the prompt's words."""
    prompt = FakeEngine().tokenizer.decode(request.prompt_token_ids)
    if "explode" in prompt:
        return Script(pieces=("one", " two", " three", " four"), raise_after=2, delay_s=0.05)
    if "crowd" in prompt:
        return queue_full()
    return Script()


class KeyCheck:
    """A stand-in for the API-key layer: `/v1/*` needs `Authorization: Bearer KEY` once
    `required` is set, answered in the OpenAI error schema; records what each request sent."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.required = False
        self.seen: list[tuple[str, str | None]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            auth = dict(scope["headers"]).get(b"authorization")
            self.seen.append((scope["path"], auth.decode() if auth else None))
            if self.required and auth != f"Bearer {KEY}".encode():
                body = {"error": {"message": "invalid API key", "type": "authentication_error",
                                  "param": None, "code": "invalid_api_key"}}  # fmt: skip
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json")]})  # fmt: skip
                await send({"type": "http.response.body", "body": json.dumps(body).encode()})
                return
        await self.app(scope, receive, send)


@contextlib.contextmanager
def server_thread(app: Any) -> Iterator[str]:
    """`app` under uvicorn on 127.0.0.1 in a thread of its own (the browser is synchronous)."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "the server did not start"
        threading.Event().wait(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def chromium() -> Chromium:
    found = find_chromium()
    if isinstance(found, str):
        pytest.skip(found)
    return found


@pytest.fixture(scope="module")
def engine() -> FakeEngine:
    return FakeEngine(script=script_for)


@pytest.fixture(scope="module")
def site(engine: FakeEngine) -> Iterator[tuple[str, KeyCheck]]:
    app, _ = make_app(engine)
    checked = KeyCheck(app)
    with server_thread(checked) as url:
        yield url, checked


@pytest.fixture
def page(chromium: Chromium, site: tuple[str, KeyCheck]) -> Iterator[Playground]:
    url, checked = site
    checked.required = False
    with headless_chromium(chromium) as driver:
        yield Playground(driver, url)


def finish(page: Playground, prompt: str, max_tokens: str = "16") -> None:
    page.set("max-tokens", max_tokens)
    page.send(prompt)
    page.wait_for(lambda: not page.busy(), timeout_s=10)


def test_options_reach_the_engine(page, engine) -> None:
    page.set("temperature", "0.3")
    page.choose("tier", "flex")
    page.tick("ignore-eos")
    finish(page, "Hello", max_tokens="12")
    request = engine.requests[-1]
    assert request.request_class is RequestClass.BULK
    assert (request.sampling.temperature, request.sampling.max_tokens) == (0.3, 12)
    assert request.sampling.ignore_eos

    page.choose("tier", "default")
    page.tick("ignore-eos", on=False)
    finish(page, "Hello again")
    request = engine.requests[-1]
    assert request.request_class is RequestClass.INTERACTIVE and not request.sampling.ignore_eos
    # the conversation goes on: the first exchange is part of the second prompt
    assert "Hello there!" in engine.tokenizer.decode(request.prompt_token_ids)


def test_api_key_is_kept_for_the_session_and_sent_as_a_bearer_header(page, site) -> None:
    _, checked = site
    checked.required = True
    finish(page, "Hello")
    assert page.text("error") == "401: invalid API key"  # the API's own message

    page.driver.refresh()  # a page opened with keys on and no key: the model list is refused
    page.wait_for(lambda: page.text("error") == "models: 401: invalid API key")

    page.set("api-key", KEY)
    page.driver.find_element("id", "prompt").click()  # leaving the field commits the key
    page.wait_for(lambda: checked.seen[-1] == ("/v1/models", f"Bearer {KEY}"))
    page.wait_for(lambda: page.text("error") == "")
    finish(page, "Hello")
    assert page.text("error") == ""
    assert page.last_answer() == "Hello there!"
    assert checked.seen[-1] == ("/v1/chat/completions", f"Bearer {KEY}")

    page.driver.refresh()  # same tab, same session: the key is still there
    page.wait_for(lambda: page.driver.find_element("id", "api-key").get_attribute("value") == KEY)
    stored = page.driver.execute_script("return sessionStorage.getItem('firstlight.apiKey')")
    assert stored == KEY


def test_errors_show_the_message_the_api_returned(page, site) -> None:
    url, _ = site
    finish(page, "Hello", max_tokens="100000")
    refused = httpx.post(f"{url}/v1/chat/completions", json=chat_body(max_tokens=100000))
    assert page.text("error") == f"400: {refused.json()['error']['message']}"

    finish(page, "the crowd is here")
    crowd = chat_body(messages=[{"role": "user", "content": "the crowd is here"}])
    crowded = httpx.post(f"{url}/v1/chat/completions", json=crowd)
    assert crowded.status_code == 429
    assert page.text("error") == f"429: {crowded.json()['error']['message']}"

    finish(page, "please explode")  # fails mid-stream: an SSE error event after two pieces
    exploding = chat_body(stream=True, messages=[{"role": "user", "content": "please explode"}])
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=exploding) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line[6:7] == "{"]
    shown, sent = page.text("error"), events[-1]["error"]["message"]
    assert re.sub(r"request id \w+", "", shown) == re.sub(r"request id \w+", "", sent), shown
    assert page.last_answer() == "one two"


def test_server_breakdown_shows_speculative_acceptance_only_when_drafts_were_made(page) -> None:
    finish(page, "Hello")
    assert page.text("s-ttft").endswith("ms")
    row = page.driver.find_element("id", "spec-row")
    assert not row.is_displayed()  # this server does not speculate: draft_tokens is 0
    page.driver.execute_script(
        "renderServer({queue_s: 0.001, prefill_s: 0.002, ttft_s: 0.003, decode_s: 0.5,"
        " e2e_s: 0.503, draft_tokens: 40, accepted_tokens: 30}, {completion_tokens: 64})"
    )
    assert row.is_displayed()
    assert page.text("s-accept") == "30/40 (75%)"
