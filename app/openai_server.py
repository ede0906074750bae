"""The OpenAI-compatible FastAPI app: `/v1/chat/completions`, `/v1/completions`,
`/v1/models` (and `/v1/models/{model}`), `/health`, `/metrics`.

`build_app(endpoints, settings)` is the whole surface: the same app serves bare mode (an
in-process `AsyncEngine`, see `app.standalone`) and Ray Serve mode (endpoints whose client
streams from replicas; `extra_metrics` returns the other processes' metric snapshots so one
scrape covers them all). Routes read the body and hand it to the HTTP-free OpenAI layer
(`app.openai.prepare`), which validates and tokenizes; the job it returns runs in
`app.generation.run_job`.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass

from fastapi import FastAPI
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response

from app.auth import AuthMiddleware, load_keys
from app.batch.routes import install_batch_routes
from app.batch.store import BatchStore
from app.endpoint import Endpoints, ModelEndpoint
from app.errors import install_error_handlers
from app.generation import Job, Runtime, Trace, run_job
from app.metric_snapshot import Snapshot
from app.metrics import CONTENT_TYPE, Metrics
from app.middleware import EdgeMiddleware
from app.openai.body import parse_body
from app.openai.errors import Refused
from app.openai.prepare import OpenAILayer, Route
from app.playground.routes import install_playground
from app.settings import Settings
from policies.base import create
from policies.request_class import RequestClassPolicy

ExtraMetrics = Callable[[], Awaitable[Iterable[Snapshot]]]
Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]


@dataclass(slots=True)
class AppContext:
    """Per-app state, stored at `app.state.firstlight` (no module-level state)."""

    settings: Settings
    endpoints: Endpoints
    metrics: Metrics
    layer: OpenAILayer
    runtime: Runtime
    extra_metrics: ExtraMetrics | None = None


def build_app(
    endpoints: Iterable[ModelEndpoint],
    settings: Settings | None = None,
    *,
    metrics: Metrics | None = None,
    classifier: RequestClassPolicy | None = None,
    extra_metrics: ExtraMetrics | None = None,
    lifespan: Lifespan | None = None,
) -> FastAPI:
    """The app serving `endpoints`.

    `metrics` defaults to one that also renders each endpoint's `client.stats()` at scrape
    time; pass your own (e.g. HTTP metrics only) when engine stats arrive another way.
    `classifier` defaults to the `settings.request_class_policy` policy. `extra_metrics`
    returns snapshots merged into every `/metrics` scrape. `lifespan` owns engine start/stop.
    The app context lives at `app.state.firstlight` (`AppContext`).
    """
    settings = settings or Settings()
    table = Endpoints(endpoints)
    if metrics is None:
        metrics = Metrics(
            max_label_values=settings.max_label_values,
            engine_stats=lambda: [({"model": e.name}, e.client.stats()) for e in table.all],
        )
    classifier = classifier or create(RequestClassPolicy, settings.request_class_policy)
    ctx = AppContext(
        settings=settings,
        endpoints=table,
        metrics=metrics,
        layer=OpenAILayer(table, classifier, max_n=settings.max_n),
        runtime=Runtime(metrics, settings.keepalive_s, settings.stall_timeout_s),
        extra_metrics=extra_metrics,
    )
    app = FastAPI(title="firstlight", lifespan=lifespan)
    app.state.firstlight = ctx
    install_error_handlers(app)
    keys = load_keys(settings.auth)
    if keys:  # inside EdgeMiddleware (added below): a 401 carries the request id
        app.add_middleware(AuthMiddleware, keys=keys)
    large = (
        {"/v1/files": settings.batch.max_file_bytes + 64 * 1024} if settings.batch.enabled else {}
    )
    app.add_middleware(EdgeMiddleware, max_body_bytes=settings.max_body_bytes, large_bodies=large)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model:path}", retrieve_model, methods=["GET"])
    app.add_api_route("/metrics", render_metrics, methods=["GET"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    install_playground(app)  # `/`, its assets, `/status`
    if settings.batch.enabled:
        install_batch_routes(app, BatchStore(settings.batch.path()), settings.batch)
    return app


def _ctx(request: HTTPRequest) -> AppContext:
    return request.app.state.firstlight


async def health() -> Response:
    return JSONResponse({"status": "ok"})


async def list_models(request: HTTPRequest) -> Response:
    return JSONResponse({"object": "list", "data": [e.card() for e in _ctx(request).endpoints.all]})


async def retrieve_model(request: HTTPRequest, model: str) -> Response:
    """One `/v1/models` entry by name or alias (404 `model_not_found` otherwise)."""
    return JSONResponse(_ctx(request).endpoints.resolve(model).card())


async def render_metrics(request: HTTPRequest) -> Response:
    ctx = _ctx(request)
    others = list(await ctx.extra_metrics()) if ctx.extra_metrics else []
    return Response(ctx.metrics.render(*others), media_type=CONTENT_TYPE)


async def chat_completions(request: HTTPRequest) -> Response:
    return await _generate(request, Route.CHAT)


async def completions(request: HTTPRequest) -> Response:
    return await _generate(request, Route.COMPLETIONS)


async def _generate(request: HTTPRequest, route: Route) -> Response:
    """Read the body, let the OpenAI layer turn it into a job, run the job."""
    arrival = time.monotonic()
    ctx = _ctx(request)
    body = parse_body(await request.body())
    try:
        work = await ctx.layer.prepare(
            route, body, headers=request.headers, request_id=request.state.request_id
        )
    except Refused as refused:  # overloaded: counted like a job that failed
        labels = ctx.metrics.labels(refused.model, refused.request_class, refused.tags)
        ctx.metrics.record_error(labels, refused.code or "refused")
        raise
    labels = ctx.metrics.labels(work.endpoint.name, work.request_class.value, work.tags)
    return await run_job(Job(work, labels, Trace(arrival)), ctx.runtime, request.receive)
