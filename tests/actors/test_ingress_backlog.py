"""The ingress's outermost ASGI layer: how long Serve's queue to the proxy has held a message.

The real thing is exercised end to end in test_serve_app.py (a stalled reader is cut); here
the bookkeeping runs against Serve's own `MessageQueue` behind a `send` shaped like Serve's.
"""

from __future__ import annotations

import asyncio

from ray.serve._private.http_util import MessageQueue

from actors.ingress import _SendBacklog
from app.sse import SEND_BACKLOG_KEY


def serve_like_send() -> tuple[object, MessageQueue]:
    """What Serve passes as ASGI `send` (user code on the replica's loop): a closure that
    puts each message on the queue its proxy-facing generator drains."""
    result_queue = MessageQueue()

    async def enqueue(item: object) -> None:
        result_queue.put_nowait(item)

    return enqueue, result_queue


async def test_the_backlog_is_the_age_of_the_oldest_message_the_proxy_has_not_taken():
    send, queue = serve_like_send()
    seen: dict = {}

    async def app(scope, receive, send) -> None:
        seen["backlog"] = scope[SEND_BACKLOG_KEY]
        await send({"type": "http.response.start"})
        await asyncio.sleep(0.05)
        await send({"type": "http.response.body"})

    await _SendBacklog(app)({"type": "http"}, None, send)
    backlog = seen["backlog"]
    assert backlog() >= 0.05  # both queued: the first has waited since before the sleep
    await queue.get_one_message()  # the proxy takes the first one
    assert 0.0 <= backlog() < 0.05
    queue.get_messages_nowait()  # ... and the rest
    assert backlog() == 0.0


async def test_without_serves_queue_nothing_is_reported():
    seen: dict = {}

    async def app(scope, receive, send) -> None:
        seen.update(scope)

    async def plain_send(message: object) -> None:
        pass

    await _SendBacklog(app)({"type": "http"}, None, plain_send)
    assert SEND_BACKLOG_KEY not in seen
    await _SendBacklog(app)({"type": "lifespan"}, None, serve_like_send()[0])
    assert SEND_BACKLOG_KEY not in seen
