"""`GET /status`: the service panel's JSON, read from the same snapshot as `/metrics`."""

from __future__ import annotations

from dataclasses import replace

import pytest

from app.metric_snapshot import engine_snapshot, merge_snapshots
from app.metrics import Metrics
from app.service_status import TTFTWindow, histogram_quantile, service_status
from engine.stats import ClassCounts, EngineStats
from tests.app.fakes import FakeEngine
from tests.app.helpers import chat_body, make_app, make_client


def engine_stats(running: ClassCounts, waiting: ClassCounts, used: int, blocks: int) -> EngineStats:
    base = FakeEngine().stats()
    kv = replace(base.kv, num_blocks=blocks, num_free_blocks=blocks - used, usage=used / blocks)
    return replace(base, running=running, waiting=waiting, kv=kv)


def record_ttft(metrics: Metrics, request_class: str, *values: float) -> None:
    labels = metrics.labels("demo", request_class, {})
    for value in values:
        metrics.record_request(
            labels, ttft_s=value, itl_s=(), tpot_s=None, e2e_s=value, engine_timings={},
            finish_reasons=["stop"], prompt_tokens=1, generation_tokens=1,
        )  # fmt: skip


def test_quantiles_interpolate_inside_a_bucket_like_prometheus() -> None:
    bounds = [0.1, 0.2, 0.4]
    assert histogram_quantile(0.5, bounds, [0, 4, 0, 0]) == pytest.approx(0.15)
    assert histogram_quantile(0.95, bounds, [10, 0, 10, 0]) == pytest.approx(0.2 + 0.2 * 0.9)
    assert histogram_quantile(0.99, bounds, [0, 0, 0, 3]) == 0.4  # +Inf: the largest bound
    assert histogram_quantile(0.5, bounds, [0, 0, 0, 0]) is None


def test_engines_load_and_kv_usage_across_replicas() -> None:
    replicas = [
        engine_snapshot(
            engine_stats(ClassCounts(2, 1), ClassCounts(0, 3), used=10, blocks=100),
            {"model": "demo", "replica": "r1"},
        ),
        engine_snapshot(
            engine_stats(ClassCounts(1, 0), ClassCounts(1, 0), used=150, blocks=300),
            {"model": "demo", "replica": "r2"},
        ),
    ]
    metrics = Metrics()
    metrics.record_cancelled(metrics.labels("demo", "interactive", {}))
    summary = service_status(merge_snapshots(metrics.snapshot(), *replicas), TTFTWindow(), 0.0)
    assert [(e.name, e.running, e.waiting, e.kv_blocks) for e in summary.engines] == [
        ("r1", 3, 3, 100),
        ("r2", 1, 1, 300),
    ]
    assert summary.running == {"interactive": 3, "bulk": 1}
    assert summary.waiting == {"interactive": 1, "bulk": 3}
    assert summary.kv_usage == pytest.approx(160 / 400)  # weighted by pool size
    assert (summary.finished, summary.cancelled, summary.errors) == (0, 1, 0)


def test_ttft_quantiles_cover_about_the_last_minute_by_class() -> None:
    metrics, window = Metrics(), TTFTWindow(window_s=60.0)
    record_ttft(metrics, "interactive", *[5.0] * 10)  # long ago
    first = service_status(metrics.snapshot(), window, now=0.0).ttft["interactive"]
    assert (first.window_s, first.count) == (None, 10)  # first poll: since the start
    for t in range(1, 70):  # polled every second; fast requests from t=30 on
        if t >= 30:
            record_ttft(metrics, "interactive", 0.012)
        if t == 69:
            record_ttft(metrics, "bulk", 0.3)
        latest = service_status(metrics.snapshot(), window, now=float(t))
    interactive, bulk = latest.ttft["interactive"], latest.ttft["bulk"]
    assert interactive.window_s == pytest.approx(60.0)
    assert interactive.count == 40  # t = 30..69; the 5 s ones left the window
    assert 0.01 < interactive.p50_s <= 0.015 and interactive.p95_s <= 0.015
    assert bulk.count == 1 and 0.2 < bulk.p50_s <= 0.3
    assert len(window.samples) <= 62


async def test_status_route_answers_json_in_bare_mode() -> None:
    app, _ = make_app()
    async with make_client(app) as client:
        assert (await client.post("/v1/chat/completions", json=chat_body())).status_code == 200
        response = await client.get("/status")
    assert response.status_code == 200
    body = response.json()
    assert [e["name"] for e in body["engines"]] == ["demo"]
    assert body["finished"] == 1
    assert body["ttft"]["interactive"]["count"] == 1
    assert set(body) == {
        "engines", "running", "waiting", "kv_usage", "ttft", "finished", "cancelled", "errors",
    }  # fmt: skip


async def test_page_and_assets_are_served_from_the_package() -> None:
    app, _ = make_app()
    async with make_client(app) as client:
        page = await client.get("/")
        script = await client.get("/playground/app.js")
        style = await client.get("/playground/app.css")
        missing = await client.get("/playground/secrets.txt")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert '<script src="/playground/app.js"' in page.text
    assert script.headers["content-type"].startswith("text/javascript")
    assert "/v1/chat/completions" in script.text and "include_usage" in script.text
    assert style.headers["content-type"].startswith("text/css")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
