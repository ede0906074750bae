"""Small builders for the load report's tests: stream records, /status samples, scrapes."""

from __future__ import annotations

from typing import Any

from app.metrics import Metrics
from locustfiles.records import Outcome, StreamRecord

START = 1_000_000.0  # wall-clock seconds of a synthetic run's first request


def make_record(
    at: float = 0.0,
    ttft_ms: float = 20.0,
    gaps_ms: tuple[float, ...] = (5.0, 5.0, 5.0),
    tier: str = "interactive",
    outcome: Outcome = "ok",
    tokens: int | None = None,
    user: str = "ChatUser",
    error: str = "",
) -> StreamRecord:
    """A request sent `at` seconds into the run, its first chunk after `ttft_ms`, then one
    chunk after each of `gaps_ms`."""
    chunks = [ttft_ms] if ttft_ms >= 0 else []
    for gap in gaps_ms if chunks else ():
        chunks.append(chunks[-1] + gap)
    return StreamRecord(
        start=START + at,
        user=user,
        tier=tier,
        outcome=outcome,
        chunks_ms=tuple(chunks),
        end_ms=(chunks[-1] if chunks else 0.0) + 1.0,
        tokens=tokens,
        error=error,
    )


def status(engines: int, running: int = 0, waiting: int = 0) -> dict[str, Any]:
    """A `/status` reply with `engines` engines and interactive load."""
    return {
        "engines": [{"name": f"r{i}"} for i in range(engines)],
        "running": {"interactive": running, "bulk": 0},
        "waiting": {"interactive": waiting, "bulk": 0},
        "kv_usage": 0.25,
    }


def scrape(ttfts_s: dict[str, list[float]], cancelled: int = 0) -> str:
    """The Prometheus text `/metrics` renders after these TTFTs (by server class)."""
    metrics = Metrics()
    for request_class, values in ttfts_s.items():
        labels = metrics.labels("demo", request_class, {})
        for value in values:
            metrics.record_request(
                labels, ttft_s=value, itl_s=(), tpot_s=None, e2e_s=value, engine_timings={},
                finish_reasons=["stop"], prompt_tokens=1, generation_tokens=1,
            )  # fmt: skip
    labels = metrics.labels("demo", "interactive", {})
    for _ in range(cancelled):
        metrics.record_cancelled(labels)
    return metrics.render().decode()
