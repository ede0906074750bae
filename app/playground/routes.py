"""Routes of the playground: the page at `/`, its two assets, and `GET /status`.

The page talks to the public API only (`/v1/models`, `/v1/chat/completions`) plus `/status`,
so it behaves exactly as any client does (API keys, errors, cancellation). `/status` is
`app.service_status` over the same merged snapshot `/metrics` renders; its TTFT window lives
on the app (`app.state.ttft_window`), one per process.
"""

from __future__ import annotations

import dataclasses
import time
from importlib import resources

from fastapi import FastAPI
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response

from app.metric_snapshot import merge_snapshots
from app.openai.errors import APIError
from app.service_status import TTFTWindow, service_status

STATIC = resources.files(__package__) / "static"
ASSETS = {"app.js": "text/javascript", "app.css": "text/css"}
# the page loads only its own files and talks only to this origin
PAGE_HEADERS = {
    "cache-control": "no-cache",
    "content-security-policy": "default-src 'self'; img-src 'self' data:",
}


def install_playground(app: FastAPI) -> None:
    """Register `/`, `/playground/{asset}` and `/status` on a `build_app` app."""
    app.state.ttft_window = TTFTWindow()
    app.add_api_route("/", page, methods=["GET"], include_in_schema=False)
    app.add_api_route("/playground/{name}", asset, methods=["GET"], include_in_schema=False)
    app.add_api_route("/status", status, methods=["GET"])


async def page() -> Response:
    return Response(
        (STATIC / "index.html").read_bytes(), media_type="text/html", headers=PAGE_HEADERS
    )


async def asset(name: str) -> Response:
    media_type = ASSETS.get(name)
    if media_type is None:
        raise APIError(404, f"the playground has no file {name!r}", code="not_found")
    return Response((STATIC / name).read_bytes(), media_type=media_type, headers=PAGE_HEADERS)


async def status(request: HTTPRequest) -> Response:
    """Engines, load by class, KV usage, recent TTFT and request counts (see
    `app.service_status`), from this process's metrics and the others it is given."""
    ctx = request.app.state.firstlight
    others = list(await ctx.extra_metrics()) if ctx.extra_metrics else []
    snapshot = merge_snapshots(ctx.metrics.snapshot(), *others)
    summary = service_status(snapshot, request.app.state.ttft_window, time.monotonic())
    return JSONResponse(dataclasses.asdict(summary), headers={"cache-control": "no-store"})
