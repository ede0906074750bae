"""The outermost ASGI layer of the app: request ids, body-size limit, last-resort 500.

Pure ASGI (no `BaseHTTPMiddleware`) so streamed responses pass through untouched and no
extra task sits between the route and the socket.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

from starlette.requests import ClientDisconnect

from app.errors import error_response
from app.openai.errors import APIError, bad_request, to_api_error

logger = logging.getLogger("firstlight.app")

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]

REQUEST_ID_HEADER = b"x-request-id"
_VALID_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


def request_id_from(raw: bytes | None) -> str:
    """The client's `x-request-id` when it is a sane token, else a fresh random one."""
    if raw:
        value = raw.decode("latin-1")
        if _VALID_REQUEST_ID.fullmatch(value):
            return value
    return uuid.uuid4().hex


class EdgeMiddleware:
    """Stamps `scope["state"]["request_id"]` and echoes it as `x-request-id` on every response;
    answers 413 before the app reads a body over `max_body_bytes`; turns an exception nobody
    handled into a logged 500 (when the response has not started yet)."""

    def __init__(
        self, app: ASGIApp, max_body_bytes: int, large_bodies: Mapping[str, int] | None = None
    ) -> None:
        """`large_bodies`: path → its own body limit (uploads, read as they stream)."""
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.large_bodies = dict(large_bodies or {})

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        request_id = request_id_from(headers.get(REQUEST_ID_HEADER))
        scope.setdefault("state", {})["request_id"] = request_id
        id_header = (REQUEST_ID_HEADER, request_id.encode("latin-1"))
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = [*message.get("headers", ()), id_header]
            await send(message)

        try:
            limit = self.large_bodies.get(scope["path"], self.max_body_bytes)
            receive = await self._limit_body(headers, receive, limit)
            await self.app(scope, receive, send_with_id)
        except APIError as exc:  # raised by _limit_body, before the app ran
            await error_response(exc)(scope, receive, send_with_id)
        except ClientDisconnect:  # gone while sending its body: nobody to answer
            logger.info("request %s: the client disconnected before its body ended", request_id)
        except Exception as exc:
            logger.exception("request %s failed", request_id)
            if not started:
                await error_response(to_api_error(exc, request_id))(scope, receive, send_with_id)

    async def _limit_body(
        self, headers: dict[bytes, bytes], receive: Receive, limit: int
    ) -> Receive:
        """Reject by `content-length` unread; a body without one is buffered up to the limit."""
        length = headers.get(b"content-length")
        if length is not None:
            try:
                size = int(length)
            except ValueError:
                raise bad_request("invalid Content-Length header") from None
            if size > limit:
                raise self._too_large(limit)
            return receive
        if b"transfer-encoding" not in headers:
            return receive
        if limit != self.max_body_bytes:  # an upload route: counted as it streams, not held
            return _counting(receive, limit)
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > limit:
                raise self._too_large(limit)
            if not message.get("more_body", False):
                break
        replay: list[Message] = [
            {"type": "http.request", "body": b"".join(parts), "more_body": False}
        ]

        async def replayed() -> Message:
            return replay.pop() if replay else await receive()

        return replayed

    @staticmethod
    def _too_large(limit: int) -> APIError:
        return APIError(
            413,
            f"request body larger than {limit} bytes",
            code="request_too_large",
        )


def _counting(receive: Receive, limit: int) -> Receive:
    """`receive` that raises 413 once more than `limit` body bytes came through it."""
    size = 0

    async def counted() -> Message:
        nonlocal size
        message = await receive()
        if message["type"] == "http.request":
            size += len(message.get("body", b""))
            if size > limit:
                raise EdgeMiddleware._too_large(limit)
        return message

    return counted
