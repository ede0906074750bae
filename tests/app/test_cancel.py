"""A client that cancels is normal traffic: one INFO line, no traceback, no error."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from tests.app.fakes import FakeEngine, Script
from tests.app.helpers import chat_body, live_server, make_app, wait_until


@pytest.mark.parametrize("stage", ["mid_stream", "before_first_token", "non_streamed"])
async def test_a_client_cancel_logs_one_info_line_and_nothing_else(stage, caplog):
    caplog.set_level(logging.INFO)
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
                        break
        else:
            call = asyncio.create_task(client.post("/v1/chat/completions", json=body))
            await wait_until(lambda: bool(engine.requests))
            await asyncio.sleep(0.05)
            call.cancel()
        await wait_until(lambda: bool(engine.aborted))
        await asyncio.sleep(0.1)  # anything logged late would show up now
    ours = [r for r in caplog.records if r.name.startswith("firstlight")]
    assert len(ours) == 1, [r.getMessage() for r in ours]
    assert ours[0].levelno == logging.INFO and "disconnected" in ours[0].getMessage()
    noisy = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert noisy == [], [r.getMessage() for r in noisy]
