"""OpenAI-style errors without HTTP: `{"error": {"message", "type", "param", "code"}}` plus the
status an HTTP edge answers with.

Every failure that reaches a client goes through `to_api_error`, so HTTP responses, SSE error
events and batch result lines agree. Unexpected exceptions become a 500 whose message
carries the request id but never a traceback (that goes to the server log). The FastAPI
handlers that turn an `APIError` into a response live in `app/errors.py`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from engine.errors import InvalidRequest, QueueFull, Unavailable

INVALID_REQUEST = "invalid_request_error"


class APIError(Exception):
    """An error with everything the client sees: status, OpenAI error fields, extra headers."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def payload(self) -> dict[str, Any]:
        """The OpenAI error object, as the body of an HTTP answer or a batch error line."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class EngineRequestError(APIError):
    """The engine ended a request abnormally (error or abort finish, or a broken stream)."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(status, message, type="server_error", code="engine_error")


class Refused(APIError):
    """An overload refusal (429) of a request whose model, class and tags are known: the
    route counts it in `firstlight_request_error_total` as it would a failed job."""

    def __init__(
        self, error: APIError, model: str, request_class: str, tags: Mapping[str, str]
    ) -> None:
        super().__init__(
            error.status, error.message, type=error.type, param=error.param, code=error.code,
            headers=error.headers,
        )  # fmt: skip
        self.model = model
        self.request_class = request_class
        self.tags = dict(tags)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_invalid(exc: InvalidRequest) -> APIError:
    """The engine's `InvalidRequest(param, message)` → 400 naming the parameter."""
    return bad_request(exc.message, param=exc.param)


def to_api_error(exc: BaseException, request_id: str | None = None) -> APIError:
    """Map any exception to what the client should see."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequest):  # the engine refused the request
        return from_invalid(exc)
    if isinstance(exc, QueueFull):
        retry = max(1, math.ceil(exc.retry_after_s))
        return APIError(
            429,
            f"{exc}; retry after {retry} s",
            type="rate_limit_error",
            code="queue_full",
            headers={"Retry-After": str(retry)},
        )
    if isinstance(exc, Unavailable):
        return APIError(
            503, str(exc) or "no engine available", type="server_error", code="engine_unavailable"
        )
    suffix = f" (request id {request_id})" if request_id else ""
    return APIError(
        500, f"internal server error{suffix}", type="server_error", code="internal_error"
    )


def param_from_loc(loc: Sequence[Any]) -> str | None:
    """`("messages", 0, "content")` → `"messages[0].content"`."""
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        else:
            parts.append(("." if parts else "") + str(item))
    return "".join(parts) or None


def from_validation_errors(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """The first pydantic/FastAPI validation error as a 400 naming the offending parameter."""
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    loc = tuple(first.get("loc", ()))
    if loc and loc[0] in ("body", "query", "path", "header"):
        loc = loc[1:]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return bad_request(f"request body is not valid JSON: {detail}".rstrip(": "))
    param = param_from_loc(loc)
    message = str(first.get("msg", "invalid value"))
    return bad_request(f"{param}: {message}" if param else message, param=param)
