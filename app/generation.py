"""Run one validated generation request against its engine and answer it (streamed or not).

The status line is decided as late as possible and as early as needed: a streamed response
waits for the first engine output (at most one keepalive gap) before sending its headers,
so an engine refusal (queue full → 429, no engine → 503, engine error) is a real HTTP error,
and the headers leave together with the first token, never ahead of it on a timer. If the
first output takes longer than the gap, the stream starts with a keepalive comment instead.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import JSONResponse, Response

from app.disconnect import ClientDisconnected, Receive, until_disconnected
from app.feed import DeltaFeed
from app.metrics import Metrics, RequestLabels
from app.openai.complete import collect
from app.openai.errors import to_api_error
from app.openai.prepare import GenerationJob
from app.sse import Event, SSEResponse

logger = logging.getLogger("firstlight.app")

CLIENT_CLOSED_REQUEST = 499  # nginx's code; nobody reads it, it only shows in access logs


@dataclass(slots=True)
class Trace:
    """When token chunks reached the client (streamed requests)."""

    arrival: float
    first: float | None = None
    last: float | None = None
    gaps: list[float] = field(default_factory=list)

    def delivered(self) -> None:
        now = time.monotonic()
        if self.last is None:
            self.first = now
        else:
            self.gaps.append(now - self.last)
        self.last = now


@dataclass(slots=True)
class Job:
    """What the OpenAI layer decided (`work`), plus what HTTP adds: metric labels, a trace."""

    work: GenerationJob
    labels: RequestLabels
    trace: Trace


@dataclass(slots=True)
class Runtime:
    """What running a job needs from the app."""

    metrics: Metrics
    keepalive_s: float
    stall_timeout_s: float | None


async def run_job(job: Job, runtime: Runtime, receive: Receive) -> Response:
    """The HTTP answer of `job`. A client that leaves (or a cancelled handler) before the
    response starts is normal traffic: one INFO line, the engine requests aborted, counted."""
    work = job.work
    feed = DeltaFeed(work.endpoint.client, work.requests)
    try:
        if not work.stream:
            await until_disconnected(collect(work, feed, lambda: None), receive)
            await feed.close()
            return _finish_json(job, runtime)
        first = await until_disconnected(feed.next_batch(runtime.keepalive_s), receive)
        # render now, so an engine error in the first output is still an HTTP status
        pending = [(work.renderer.chunk(i, d), bool(d.token_ids)) for i, d in first]
    except (ClientDisconnected, asyncio.CancelledError) as exc:
        await feed.close()
        runtime.metrics.record_cancelled(job.labels)
        logger.info("request %s: client disconnected before the response", work.request_id)
        if isinstance(exc, asyncio.CancelledError):
            raise
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    except BaseException as exc:
        await feed.close()
        if isinstance(exc, Exception):
            runtime.metrics.record_error(job.labels, to_api_error(exc).code or "error")
        raise
    events = _stream_events(job, runtime, feed, pending, idle=not first)
    return SSEResponse(
        events,
        stall_timeout_s=runtime.stall_timeout_s,
        request_id=work.request_id,
        on_close=feed.close,
    )


def _finish_json(job: Job, runtime: Runtime) -> Response:
    body = job.work.renderer.response()
    _record(job, runtime, body["usage"])
    timing = server_timing(body["firstlight"])
    return JSONResponse(body, headers={"Server-Timing": timing} if timing else None)


async def _stream_events(
    job: Job,
    runtime: Runtime,
    feed: DeltaFeed,
    pending: list[tuple[dict[str, Any] | None, bool]],
    idle: bool,
) -> AsyncGenerator[Event, None]:
    """Chunks as they come; code after each `yield` runs once the frame has been sent."""
    renderer, trace = job.work.renderer, job.trace
    done = False
    try:
        if idle:
            yield None
        for chunk, has_tokens in pending:
            if chunk is not None:
                yield chunk
                if has_tokens:
                    trace.delivered()
        while not feed.finished:
            batch = await feed.next_batch(runtime.keepalive_s)
            if not batch:
                yield None
            for index, delta in batch:
                chunk = renderer.chunk(index, delta)
                if chunk is not None:
                    yield chunk
                    if delta.token_ids:
                        trace.delivered()
        if renderer.include_usage:
            yield renderer.usage_chunk()
        done = True
        _record(job, runtime, renderer.usage())
    except Exception as exc:
        done = True
        runtime.metrics.record_error(job.labels, to_api_error(exc).code or "error")
        raise
    finally:
        await feed.close()
        if not done:
            runtime.metrics.record_cancelled(job.labels)


def _record(job: Job, runtime: Runtime, usage: dict[str, Any]) -> None:
    """Streamed: TTFT and gaps as the client's chunks left. Not streamed (nothing reaches the
    client before the end): TTFT and time per output token as the engine measured them."""
    trace, renderer = job.trace, job.work.renderer
    e2e = time.monotonic() - trace.arrival
    longest = max(s.num_output_tokens for s in renderer.states)
    engine = renderer.latency()
    tpot = ttft = None
    if not job.work.stream:  # (with n > 1 the engine's timings are one choice's: no TPOT)
        ttft, decode = engine["ttft_s"], engine["decode_s"]
        if decode is not None and longest > 1 and len(renderer.states) == 1:
            tpot = float(decode) / (longest - 1)
    else:
        if trace.first is not None and trace.last is not None and longest > 1:
            tpot = (trace.last - trace.first) / (longest - 1)
        ttft = None if trace.first is None else trace.first - trace.arrival
    runtime.metrics.record_request(
        job.labels,
        ttft_s=None if ttft is None else float(ttft),
        itl_s=trace.gaps,
        tpot_s=tpot,
        e2e_s=e2e,
        engine_timings=engine,
        finish_reasons=[s.finish_reason for s in renderer.states],
        prompt_tokens=usage["prompt_tokens"],
        generation_tokens=usage["completion_tokens"],
    )
    work = job.work
    logger.info(
        "request %s done: model=%s class=%s tags=%s prompt=%d completion=%d ttft=%s e2e=%.1fms",
        work.request_id, work.endpoint.name, job.labels[1], work.tags, usage["prompt_tokens"],
        usage["completion_tokens"], "-" if ttft is None else f"{ttft * 1e3:.1f}ms", e2e * 1e3,
    )  # fmt: skip


SERVER_TIMING = (("queue", "queue_s"), ("prefill", "prefill_s"), ("ttft", "ttft_s"),
                 ("decode", "decode_s"), ("e2e", "e2e_s"))  # fmt: skip


def server_timing(latency: dict[str, float | None]) -> str:
    """`Server-Timing` header value (milliseconds) from the engine latency breakdown."""
    return ", ".join(
        f"{name};dur={value * 1e3:.3f}"
        for name, key in SERVER_TIMING
        if (value := latency.get(key)) is not None
    )
