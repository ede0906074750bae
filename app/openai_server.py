"""The OpenAI-compatible FastAPI app: `/v1/chat/completions`, `/v1/completions`,
`/v1/models`, `/health`, `/metrics`.

`build_app(endpoints, settings)` is the whole surface: the same app serves bare mode (an
in-process `AsyncEngine`, see `app.standalone`) and Ray Serve mode (endpoints whose client
streams from replicas; `extra_metrics` returns the other processes' metric snapshots so one
scrape covers them all). Routes validate and tokenize, then hand a `Job` to `run_job`.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI
from pydantic import BaseModel, ValidationError
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response

from app.endpoint import Endpoints, ModelEndpoint
from app.errors import bad_request, from_invalid, from_validation_errors, install_error_handlers
from app.generation import Job, Runtime, Trace, run_job
from app.metric_snapshot import Snapshot
from app.metrics import CONTENT_TYPE, Metrics
from app.middleware import EdgeMiddleware
from app.openai.chat import chat_prompt_ids
from app.openai.render import ChatRenderer, CompletionRenderer, Renderer
from app.openai.schemas import ChatCompletionRequest, CompletionRequest
from app.settings import Settings
from engine.errors import InvalidRequest
from engine.request import Request, RequestClass
from policies.base import create
from policies.request_class import RequestClassPolicy

M = TypeVar("M", bound=BaseModel)
ExtraMetrics = Callable[[], Awaitable[Iterable[Snapshot]]]
Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]


@dataclass(slots=True)
class AppContext:
    """Per-app state, stored at `app.state.firstlight` (no module-level state)."""

    settings: Settings
    endpoints: Endpoints
    metrics: Metrics
    classifier: RequestClassPolicy
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
    ctx = AppContext(
        settings=settings,
        endpoints=table,
        metrics=metrics,
        classifier=classifier or create(RequestClassPolicy, settings.request_class_policy),
        runtime=Runtime(metrics, settings.keepalive_s, settings.stall_timeout_s),
        extra_metrics=extra_metrics,
    )
    app = FastAPI(title="firstlight", lifespan=lifespan)
    app.state.firstlight = ctx
    install_error_handlers(app)
    app.add_middleware(EdgeMiddleware, max_body_bytes=settings.max_body_bytes)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/metrics", render_metrics, methods=["GET"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    return app


def _ctx(request: HTTPRequest) -> AppContext:
    return request.app.state.firstlight


async def health() -> Response:
    return JSONResponse({"status": "ok"})


async def list_models(request: HTTPRequest) -> Response:
    return JSONResponse({"object": "list", "data": [e.card() for e in _ctx(request).endpoints.all]})


async def render_metrics(request: HTTPRequest) -> Response:
    ctx = _ctx(request)
    others = list(await ctx.extra_metrics()) if ctx.extra_metrics else []
    return Response(ctx.metrics.render(*others), media_type=CONTENT_TYPE)


async def chat_completions(request: HTTPRequest) -> Response:
    arrival = time.monotonic()
    ctx = _ctx(request)
    body = await _json_body(request)
    params = _parse(ChatCompletionRequest, body)
    endpoint = ctx.endpoints.resolve(params.model)
    request_class = _classify(ctx, request, body)
    prompt = chat_prompt_ids(endpoint.tokenizer, params.messages)
    job = _make_job(
        ctx,
        request,
        endpoint,
        params,
        [prompt],
        request_class,
        arrival,
        renderer=ChatRenderer,
        default_max_tokens=None,
        prompt_param="messages",
    )
    return await run_job(job, ctx.runtime, request.receive)


async def completions(request: HTTPRequest) -> Response:
    arrival = time.monotonic()
    ctx = _ctx(request)
    body = await _json_body(request)
    params = _parse(CompletionRequest, body)
    if params.echo:
        raise bad_request("echo is not supported", "echo")
    if params.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if params.best_of is not None and params.best_of != params.n:
        raise bad_request("best_of other than n is not supported", "best_of")
    endpoint = ctx.endpoints.resolve(params.model)
    request_class = _classify(ctx, request, body)
    prompts = [_prompt_ids(endpoint, p) for p in params.prompt]
    job = _make_job(
        ctx,
        request,
        endpoint,
        params,
        prompts,
        request_class,
        arrival,
        renderer=CompletionRenderer,
        default_max_tokens=16,
        prompt_param="prompt",
    )
    return await run_job(job, ctx.runtime, request.receive)


async def _json_body(request: HTTPRequest) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    return body


def _parse(model: type[M], body: dict[str, Any]) -> M:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise from_validation_errors(exc.errors(include_url=False)) from None


def _classify(ctx: AppContext, request: HTTPRequest, body: dict[str, Any]) -> RequestClass:
    try:
        return ctx.classifier.classify(request.headers, body)
    except InvalidRequest as exc:
        raise from_invalid(exc) from None


def _prompt_ids(endpoint: ModelEndpoint, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        return list(endpoint.tokenizer.encode(prompt))
    if any(t < 0 or t >= endpoint.vocab_size for t in prompt):
        raise bad_request(f"token ids must be in [0, {endpoint.vocab_size})", "prompt")
    return prompt


def _max_tokens(
    endpoint: ModelEndpoint,
    prompt_len: int,
    requested: int | None,
    default: int | None,
    prompt_param: str,
) -> int:
    """Completion budget within the context: 400 when the prompt or the request overflows it."""
    limit = endpoint.max_model_len
    if prompt_len == 0:
        raise bad_request("the prompt is empty", prompt_param)
    if prompt_len >= limit:
        raise bad_request(
            f"the prompt has {prompt_len} tokens; this model's maximum context length is "
            f"{limit} tokens (prompt + completion)",
            prompt_param,
            "context_length_exceeded",
        )
    room = limit - prompt_len
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise bad_request(
            f"this model's maximum context length is {limit} tokens, but {prompt_len + requested}"
            f" were requested ({prompt_len} in the prompt, {requested} for the completion)",
            "max_tokens",
            "context_length_exceeded",
        )
    return requested


def _make_job(
    ctx: AppContext,
    request: HTTPRequest,
    endpoint: ModelEndpoint,
    params: ChatCompletionRequest | CompletionRequest,
    prompts: Sequence[list[int]],
    request_class: RequestClass,
    arrival: float,
    *,
    renderer: type[Renderer],
    default_max_tokens: int | None,
    prompt_param: str,
) -> Job:
    if params.n > ctx.settings.max_n:
        raise bad_request(f"n must be at most {ctx.settings.max_n}", "n")
    request_id: str = request.state.request_id
    tags = params.tags()
    engine_requests: list[Request] = []
    for prompt in prompts:
        max_tokens = _max_tokens(
            endpoint, len(prompt), params.requested_max_tokens(), default_max_tokens, prompt_param
        )
        try:
            logprobs = params.logprobs_k()
            sampling = params.sampling_params(
                max_tokens=max_tokens, logprobs=logprobs, seed=params.seed
            )
        except InvalidRequest as exc:
            raise from_invalid(exc) from None
        for i in range(params.n):
            if params.seed is not None and i:  # distinct but reproducible samples per choice
                sampling = dataclasses.replace(sampling, seed=params.seed + i)
            engine_requests.append(Request(
                request_id=f"{request_id}-{len(engine_requests)}",
                prompt_token_ids=prompt,
                sampling=sampling,
                request_class=request_class,
                tags=tags,
            ))  # fmt: skip
    return Job(
        request_id=request_id,
        endpoint=endpoint,
        requests=engine_requests,
        renderer=renderer(
            response_id=f"{renderer.id_prefix}{request_id}",
            created=int(time.time()),
            model=endpoint.name,
            prompt_lens=[len(p) for p in prompts],
            n=params.n,
            include_usage=params.stream and params.include_usage,
            logprobs=logprobs is not None,
            token_text=endpoint.token_text,
        ),
        stream=params.stream,
        labels=ctx.metrics.labels(endpoint.name, request_class.value, tags),
        trace=Trace(arrival),
    )
