"""The only place that writes Server-Sent Events.

Wire format, exactly: each event `data: <compact json>\\n\\n`; after the last event
`data: [DONE]\\n\\n`, and then the body ends. A `: keepalive\\n\\n` comment is written only
where the event source yields `None`, which it does after an idle gap with no data (some load
tools choke on comments, so never during normal flow). An exception from the source becomes
one `data: {"error": {...}}` event followed by `[DONE]`.

`SSEResponse` watches for the client leaving: on disconnect (or a reader stalled past
`stall_timeout_s`) the source is closed, which closes the engine iterators and so aborts the
requests. Each frame is sent the moment the source yields it: no buffering, no timers.

A stalled reader is seen in one of two ways. Under a server whose `send` blocks while the
client is not reading (uvicorn), a `send` that takes longer than the limit. Under one whose
`send` never blocks (Ray Serve queues the messages for its proxy), the server puts a
callable at `scope[SEND_BACKLOG_KEY]` that returns how long the oldest message not yet taken
from that queue has waited (`actors/ingress.py`), checked after every frame.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from app.disconnect import ClientDisconnected, until_disconnected
from app.openai.errors import APIError, to_api_error

logger = logging.getLogger("firstlight.app")

SSE_HEADERS = {
    "content-type": "text/event-stream",
    "cache-control": "no-cache",
    "x-accel-buffering": "no",
}
DONE_FRAME = b"data: [DONE]\n\n"
KEEPALIVE_FRAME = b": keepalive\n\n"
_encode = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode

Event = dict[str, Any] | None  # None: "idle for a while" → keepalive comment
SEND_BACKLOG_KEY = "firstlight.send_backlog_s"  # scope key: () -> seconds (see above)


def data_frame(event: Mapping[str, Any]) -> bytes:
    return f"data: {_encode(event)}\n\n".encode()


class SlowReader(Exception):
    """The client did not take a frame within the stall timeout."""


class SSEResponse(Response):
    """A 200 `text/event-stream` response whose frames come from `events`; `on_close` (if
    given, idempotent) runs last, after the source has been closed, whatever happened."""

    def __init__(
        self,
        events: AsyncGenerator[Event, None],
        *,
        headers: Mapping[str, str] | None = None,
        stall_timeout_s: float | None = None,
        request_id: str | None = None,
        on_close: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.events = events
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.stall_timeout_s = stall_timeout_s
        self.request_id = request_id
        self._backlog_s: Callable[[], float] | None = None
        self.init_headers({**SSE_HEADERS, **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._backlog_s = scope.get(SEND_BACKLOG_KEY)
        try:
            await until_disconnected(self._write(send), receive)
        except (ClientDisconnected, OSError):  # uvicorn's ClientDisconnected is an OSError
            logger.info("request %s: client disconnected mid-stream", self.request_id)
        except asyncio.CancelledError:  # the server cancelled the handler: the client left
            logger.info("request %s: stream cancelled", self.request_id)
            raise
        except SlowReader:
            logger.warning("request %s: reader stalled, stream cut", self.request_id)
        finally:
            # `_write` closed the source in its own task, unless it never started; by now it
            # has ended (until_disconnected waits for it), so this cannot race the writer.
            await self.events.aclose()
            if self.on_close is not None:  # the source's own cleanup never ran if it never started
                await self.on_close()

    async def _send(self, send: Send, frame: bytes, more: bool = True) -> None:
        message = {"type": "http.response.body", "body": frame, "more_body": more}
        if self.stall_timeout_s is None:
            await send(message)
            return
        try:
            async with asyncio.timeout(self.stall_timeout_s):
                await send(message)
        except TimeoutError:
            raise SlowReader from None
        if self._backlog_s is not None and self._backlog_s() > self.stall_timeout_s:
            raise SlowReader

    async def _write(self, send: Send) -> None:
        """Send every frame. The source is closed here, in the task that runs it: closing an
        async generator from another task while it is suspended inside an `await` raises
        "aclose(): asynchronous generator is already running"."""
        try:
            await self._write_frames(send)
        finally:
            await self.events.aclose()

    async def _write_frames(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        events = self.events
        while True:
            try:
                event = await anext(events)
            except StopAsyncIteration:
                break
            except Exception as exc:  # the source failed: tell the client, then end cleanly
                error = to_api_error(exc, self.request_id)
                if isinstance(exc, APIError):
                    logger.warning("request %s: stream error: %s", self.request_id, exc)
                else:
                    logger.exception("request %s: stream failed", self.request_id)
                await self._send(send, data_frame(error.payload()))
                break
            await self._send(send, KEEPALIVE_FRAME if event is None else data_frame(event))
        await self._send(send, DONE_FRAME, more=False)
