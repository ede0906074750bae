"""`app/sse.py` driven as a raw ASGI app: exact bytes, keepalives, errors, disconnects."""

from __future__ import annotations

import asyncio

import pytest

from app.openai.errors import APIError
from app.sse import DONE_FRAME, KEEPALIVE_FRAME, SEND_BACKLOG_KEY, SSEResponse, data_frame


class Recorder:
    """ASGI `send`/`receive` pair: records messages; `disconnect` makes receive return."""

    def __init__(self, send_blocks: bool = False) -> None:
        self.messages: list[dict] = []
        self.disconnect = asyncio.Event()
        self.send_blocks = send_blocks

    async def receive(self) -> dict:
        await self.disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        if self.send_blocks and message["type"] == "http.response.body":
            await asyncio.Event().wait()  # a reader that never reads
        self.messages.append(message)

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages[1:])


async def run(response: SSEResponse, recorder: Recorder) -> None:
    await response({"type": "http"}, recorder.receive, recorder.send)


def test_data_frame_is_compact_utf8_json():
    frame = data_frame({"a": [1, 2], "b": {"c": "héllo 世界"}, "d": None})
    assert frame == 'data: {"a":[1,2],"b":{"c":"héllo 世界"},"d":null}\n\n'.encode()


async def test_frames_then_done_then_body_end():
    async def events():
        yield {"n": 1}
        yield None
        yield {"n": 2}

    recorder = Recorder()
    await run(SSEResponse(events()), recorder)
    start, *bodies = recorder.messages
    assert start["type"] == "http.response.start" and start["status"] == 200
    headers = dict(start["headers"])
    assert headers[b"content-type"] == b"text/event-stream"
    assert headers[b"cache-control"] == b"no-cache"
    assert headers[b"x-accel-buffering"] == b"no"
    assert [b["body"] for b in bodies] == [
        b'data: {"n":1}\n\n',
        KEEPALIVE_FRAME,
        b'data: {"n":2}\n\n',
        DONE_FRAME,
    ]
    assert [b["more_body"] for b in bodies] == [True, True, True, False]


async def test_source_error_becomes_one_error_event_then_done():
    async def events():
        yield {"n": 1}
        raise APIError(503, "engine went away", type="server_error", code="engine_error")

    recorder = Recorder()
    await run(SSEResponse(events()), recorder)
    assert recorder.body == (
        b'data: {"n":1}\n\n'
        b'data: {"error":{"message":"engine went away","type":"server_error","param":null,'
        b'"code":"engine_error"}}\n\n' + DONE_FRAME
    )

    async def buggy():
        yield {"n": 1}
        raise KeyError("internal detail")

    recorder = Recorder()
    await run(SSEResponse(buggy(), request_id="r-9"), recorder)
    assert b"internal detail" not in recorder.body and b"r-9" in recorder.body
    assert recorder.body.endswith(DONE_FRAME)


@pytest.mark.parametrize("stalled", [False, True])
async def test_disconnect_or_stalled_reader_closes_the_source(stalled):
    closed = asyncio.Event()

    async def events():
        try:
            yield {"n": 1}
            await asyncio.Event().wait()  # the engine has nothing more for now
            yield {"never": True}
        finally:
            closed.set()

    recorder = Recorder(send_blocks=stalled)
    task = asyncio.create_task(run(SSEResponse(events(), stall_timeout_s=0.05), recorder))
    await asyncio.sleep(0.02)
    if not stalled:
        recorder.disconnect.set()
    await asyncio.wait_for(task, 2)
    assert closed.is_set()
    assert DONE_FRAME not in recorder.body


async def test_a_server_reported_backlog_past_the_limit_cuts_the_stream():
    """Under Ray Serve `send` never blocks; the server reports how long its oldest queued
    message has waited (scope[SEND_BACKLOG_KEY]) and the writer cuts past the limit."""
    closed = asyncio.Event()
    backlog = [0.0]

    async def events():
        try:
            for n in range(100):
                yield {"n": n}
                await asyncio.sleep(0)
        finally:
            closed.set()

    def report() -> None:
        backlog[0] = 0.0 if len(recorder.messages) < 5 else 1.0  # the proxy stopped taking

    recorder = Recorder()
    original = recorder.send

    async def send(message: dict) -> None:
        await original(message)
        report()

    scope = {"type": "http", SEND_BACKLOG_KEY: lambda: backlog[0]}
    response = SSEResponse(events(), stall_timeout_s=0.5)
    await asyncio.wait_for(response(scope, recorder.receive, send), 2)
    assert closed.is_set()
    assert len(recorder.messages) == 5  # start + 4 frames; the 4th one saw the backlog
    assert DONE_FRAME not in recorder.body

    # below the limit nothing is cut
    backlog[0] = 0.2
    recorder = Recorder()
    scope = {"type": "http", SEND_BACKLOG_KEY: lambda: backlog[0]}
    await asyncio.wait_for(
        run_scope(SSEResponse(events(), stall_timeout_s=0.5), scope, recorder), 2
    )
    assert recorder.body.endswith(DONE_FRAME)


async def run_scope(response: SSEResponse, scope: dict, recorder: Recorder) -> None:
    await response(scope, recorder.receive, recorder.send)


@pytest.mark.parametrize("cancels", [1, 2])
async def test_a_cancelled_handler_waits_for_the_source_to_clean_up(cancels, caplog):
    """A server may cancel the handler (even twice) while the source is still cleaning up in
    the writer task: the source must never be closed from outside while it runs."""
    cleaned = asyncio.Event()
    started = asyncio.Event()

    async def events():
        try:
            yield {"n": 1}
            started.set()
            await asyncio.Event().wait()
            yield {"never": True}
        finally:
            await asyncio.sleep(0.05)  # e.g. aborting engine requests
            cleaned.set()

    recorder = Recorder()
    caplog.set_level("INFO", logger="firstlight")
    task = asyncio.create_task(run(SSEResponse(events(), request_id="c-1"), recorder))
    await started.wait()
    for _ in range(cancels):
        task.cancel()
        await asyncio.sleep(0.01)
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cleaned.is_set()
    records = [r for r in caplog.records if r.name.startswith("firstlight")]
    assert [(r.levelname, r.exc_info) for r in records] == [("INFO", None)]
    assert "c-1" in records[0].getMessage()


async def test_on_close_runs_even_when_the_source_never_started():
    ran, closed, sending = [], asyncio.Event(), asyncio.Event()

    async def events():
        ran.append(True)
        yield {"n": 1}

    async def on_close() -> None:
        closed.set()

    async def send(message: dict) -> None:
        sending.set()
        await asyncio.Event().wait()  # the response start never goes out

    response = SSEResponse(events(), on_close=on_close)
    task = asyncio.create_task(response({"type": "http"}, Recorder().receive, send))
    await sending.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ran == [] and closed.is_set()
