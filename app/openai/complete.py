"""Run a `GenerationJob` to its non-streamed OpenAI response dict, without HTTP.

What a batch runner calls per line (and what the HTTP route runs for `stream: false`, with
its own disconnect watch around it). An engine refusal or failure propagates as the
exception it is; `to_api_error` turns it into the OpenAI error object.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from app.feed import DeltaFeed
from app.openai.prepare import GenerationJob


async def collect(job: GenerationJob, feed: DeltaFeed, on_tokens: Callable[[], None]) -> None:
    """Absorb every delta of `feed` into `job.renderer`; `on_tokens()` after each batch item
    that carried tokens (when they reached this process)."""
    while not feed.finished:
        for index, delta in await feed.next_batch(None):
            job.renderer.absorb(index, delta)
            if delta.token_ids:
                on_tokens()


async def complete(job: GenerationJob) -> dict[str, Any]:
    """The job's full response (`chat.completion` or `text_completion` object)."""
    feed = DeltaFeed(job.endpoint.client, job.requests)
    try:
        await collect(job, feed, lambda: None)
    finally:
        await feed.close()
    return job.renderer.response()
