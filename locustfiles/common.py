"""What every firstlight Locust user shares: one streamed chat completion, timed per chunk.

`StreamingUser.stream(messages)` sends a streamed `/v1/chat/completions` request, reads it
(to the end, or only `drop_after` content chunks before closing the connection) and reports
to Locust's statistics, all in milliseconds, named by service tier:

* `ttft[tier]`: request sent → first content chunk, once per request;
* `itl[tier]`: every gap between content chunks, one event per gap;
* `tpot[tier]`: (last − first chunk) / (completion tokens − 1), once per request;
* `e2e[tier]` (read to the end, or failed) or `dropped[tier]` (closed on purpose): the whole
  request, carrying its `StreamRecord` in the event's context.

With `LOAD_RECORDS=path` set, every request's `StreamRecord` is also appended to that file
as one JSON line (what `make load`'s report reads).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import requests
from locust import HttpUser, events
from locust.env import Environment

from locustfiles.records import Outcome, StreamRecord
from locustfiles.settings import LoadSettings

CHAT_PATH = "/v1/chat/completions"


class StreamingUser(HttpUser):
    """A user that streams chat completions; subclasses pick the messages and the tier."""

    abstract = True
    service_tier: str | None = None  # "flex": bulk work (the server's `bulk` class)
    max_tokens = 64
    ignore_eos = False  # True: always `max_tokens` tokens (long, steady outputs)

    def on_start(self) -> None:
        self.model = LoadSettings().model

    @property
    def tier(self) -> str:
        return self.service_tier or "interactive"

    def body(self, messages: list[dict[str, str]]) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": self.max_tokens,
            "messages": messages,
        }
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.service_tier:
            body["service_tier"] = self.service_tier
        return body

    def stream(self, messages: list[dict[str, str]], drop_after: int | None = None) -> None:
        """One streamed request; with `drop_after`, the connection is closed after that many
        content chunks (the server should abort the request and count it cancelled)."""
        body, name = self.body(messages), f"chat[{type(self).__name__}]"
        chunks: list[float] = []
        tokens: int | None = None
        start_wall, start = time.time(), time.perf_counter()
        with self.client.post(
            CHAT_PATH, json=body, stream=True, catch_response=True, name=name
        ) as resp:
            try:
                if resp.status_code == 200:
                    outcome, error, tokens = _read(resp, start, chunks, drop_after)
                else:
                    outcome, error = "error", f"HTTP {resp.status_code}"
            except (requests.RequestException, ValueError) as exc:  # closed mid-stream, bad JSON
                outcome, error = "error", f"{type(exc).__name__}: {exc}"
            finally:
                resp.close()  # mid-stream: closes the connection, which the server notices
            if outcome == "error":
                resp.failure(error)
            else:
                resp.success()
        record = StreamRecord(
            start=start_wall,
            user=type(self).__name__,
            tier=self.tier,
            outcome=outcome,
            chunks_ms=tuple(chunks),
            end_ms=1000 * (time.perf_counter() - start),
            tokens=tokens,
            error=error,
        )
        self._report(record)

    def _report(self, record: StreamRecord) -> None:
        tier = record.tier
        if record.ttft_ms is not None:
            self._fire(f"ttft[{tier}]", record.ttft_ms)
        for gap in record.itl_ms():
            self._fire(f"itl[{tier}]", gap)
        if record.tpot_ms is not None and record.outcome == "ok":
            self._fire(f"tpot[{tier}]", record.tpot_ms)
        whole = "dropped" if record.outcome == "dropped" else "e2e"
        failed = RuntimeError(record.error) if record.outcome == "error" else None
        self._fire(f"{whole}[{tier}]", record.end_ms, failed, {"stream": record})

    def _fire(
        self,
        name: str,
        ms: float,
        exception: Exception | None = None,
        context: dict[str, Any] | None = None,
    ) -> None:
        self.environment.events.request.fire(
            request_type="SSE",
            name=name,
            response_time=ms,
            response_length=0,
            exception=exception,
            context=context or {},
        )


def _read(
    resp: Any, start: float, chunks: list[float], drop_after: int | None
) -> tuple[Outcome, str, int | None]:
    """Read SSE lines, appending each content chunk's arrival (ms after `start`) to `chunks`;
    returns the outcome, the error message and the completion tokens of the usage chunk."""
    tokens = None
    for line in resp.iter_lines():
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            return "error", chunk["error"].get("message", "stream error"), tokens
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        if any(c.get("delta", {}).get("content") for c in chunk.get("choices", ())):
            chunks.append(1000 * (time.perf_counter() - start))
            if drop_after is not None and len(chunks) >= drop_after:
                return "dropped", "", tokens
    return "ok", "", tokens


@events.init.add_listener
def write_records(environment: Environment, **_: Any) -> None:
    """With LOAD_RECORDS set: each request's `StreamRecord` as one JSON line in that file."""
    path = os.environ.get("LOAD_RECORDS")
    if not path:
        return
    out = open(path, "a", buffering=1)  # noqa: SIM115 (open for the whole run, line-buffered)

    def on_request(context: dict[str, Any] | None = None, **_: Any) -> None:
        record = (context or {}).get("stream")
        if isinstance(record, StreamRecord):
            out.write(record.to_json() + "\n")

    environment.events.request.add_listener(on_request)
    environment.events.quitting.add_listener(lambda **_: out.close())
