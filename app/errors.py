"""The FastAPI side of errors: every known failure answers in the OpenAI error schema.

The error type and its mapping (`APIError`, `to_api_error`) are HTTP-free and live in
`app/openai/errors.py`; this module only turns them into responses and installs the
handlers. Unexpected exceptions answer 500 without a traceback (that goes to the log).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from app.openai.errors import APIError, from_validation_errors, to_api_error
from engine.errors import InvalidRequest, QueueFull, Unavailable

logger = logging.getLogger("firstlight.app")


def error_response(error: APIError) -> JSONResponse:
    """`error` as an HTTP answer: its status, the OpenAI error body, its extra headers."""
    return JSONResponse(error.payload(), status_code=error.status, headers=error.headers)


def _request_id(request: Request) -> str | None:
    return getattr(request.state, "request_id", None)


async def _api_error(request: Request, exc: Exception) -> Response:
    error = to_api_error(exc, _request_id(request))
    if error.status >= 500 and not isinstance(exc, APIError):
        logger.error("request %s failed", _request_id(request), exc_info=exc)
    return error_response(error)


async def _validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    return error_response(from_validation_errors(list(exc.errors())))


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return error_response(
        APIError(exc.status_code, str(exc.detail), code=code, headers=exc.headers)
    )


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
