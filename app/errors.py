"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with a real status.

Every failure that reaches a client goes through `to_api_error`, so HTTP responses and SSE
error events agree. Unexpected exceptions become a 500 whose message carries the request id
but never a traceback (that goes to the server log).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.errors import InvalidRequest, QueueFull, Unavailable

logger = logging.getLogger("firstlight.app")

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
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.payload(), status_code=self.status, headers=self.headers)


class EngineRequestError(APIError):
    """The engine ended a request abnormally (error or abort finish, or a broken stream)."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(status, message, type="server_error", code="engine_error")


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


def _param_from_loc(loc: tuple[Any, ...]) -> str | None:
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
    param = _param_from_loc(loc)
    message = str(first.get("msg", "invalid value"))
    return bad_request(f"{param}: {message}" if param else message, param=param)


def _request_id(request: Request) -> str | None:
    return getattr(request.state, "request_id", None)


async def _api_error(request: Request, exc: Exception) -> Response:
    error = to_api_error(exc, _request_id(request))
    if error.status >= 500 and not isinstance(exc, APIError):
        logger.error("request %s failed", _request_id(request), exc_info=exc)
    return error.response()


async def _validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    return from_validation_errors(list(exc.errors())).response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return APIError(exc.status_code, str(exc.detail), code=code, headers=exc.headers).response()


def install_error_handlers(app: FastAPI) -> None:
    """Route every known failure through the OpenAI error schema (422 becomes 400).

    Exceptions nobody handles here propagate to `app.middleware.EdgeMiddleware`, which logs
    them and answers 500.
    """
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(QueueFull, _api_error)
    app.add_exception_handler(Unavailable, _api_error)
    app.add_exception_handler(InvalidRequest, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
