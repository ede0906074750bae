"""`Metrics`: buckets, bounded labels, snapshots that merge across processes, engine stats,
and `/metrics` after real requests."""

from __future__ import annotations

import dataclasses
import re

from app.metric_snapshot import engine_snapshot, merge_snapshots, render_snapshot
from app.metrics import LATENCY_BUCKETS, BoundedValues, Metrics
from engine.stats import EngineStats
from tests.app.fakes import FakeEngine, Script
from tests.app.helpers import chat_body, make_app, make_client

LABELS = ("demo", "interactive", "none", "none")
HISTOGRAMS = (
    "time_to_first_token_seconds", "inter_token_latency_seconds",
    "request_time_per_output_token_seconds", "e2e_request_latency_seconds",
    "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
)  # fmt: skip


def record(metrics: Metrics, ttft: float = 0.0015, labels=LABELS) -> None:
    metrics.record_request(
        labels, ttft_s=ttft, itl_s=[0.004, 0.2], tpot_s=0.01, e2e_s=0.5,
        engine_timings={"queue_s": 0.0005, "prefill_s": 0.001, "decode_s": 0.3, "ttft_s": 0.0015},
        finish_reasons=["stop", "length"], prompt_tokens=10, generation_tokens=7,
    )  # fmt: skip


def sample(text: str, name: str, **labels: str) -> float:
    """The value of the one sample `name{labels...}` in Prometheus text."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            found = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
            if all(found.get(k) == v for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{labels} not found")


def test_buckets_start_at_one_millisecond():
    assert LATENCY_BUCKETS[:3] == (0.001, 0.0025, 0.005)


def test_bounded_values_cap_cardinality():
    bound = BoundedValues(limit=2)
    assert [bound(v) for v in ("a", "b", "c", "a", None, "d")] == [
        "a",
        "b",
        "other",
        "a",
        "none",
        "other",
    ]


def test_histograms_and_counters_render():
    metrics = Metrics()
    record(metrics)
    text = metrics.render().decode()
    ttft = "firstlight_time_to_first_token_seconds_bucket"
    assert sample(text, ttft, le="0.001", model="demo") == 0
    assert sample(text, ttft, le="0.0025", model="demo") == 1
    assert sample(text, ttft, le="+Inf", model="demo") == 1
    assert sample(text, "firstlight_inter_token_latency_seconds_count") == 2
    assert sample(text, "firstlight_inter_token_latency_seconds_bucket", le="0.005") == 1
    assert sample(text, "firstlight_request_queue_time_seconds_bucket", le="0.001") == 1
    assert sample(text, "firstlight_request_success_total", finish_reason="stop") == 1
    assert sample(text, "firstlight_request_success_total", finish_reason="length") == 1
    assert sample(text, "firstlight_prompt_tokens_total") == 10
    assert sample(text, "firstlight_generation_tokens_total") == 7
    for name in HISTOGRAMS:
        assert f"# TYPE firstlight_{name} histogram" in text


def test_snapshots_merge_across_processes():
    a, b = Metrics(), Metrics()
    record(a)
    record(b, ttft=3.0)
    record(b, labels=("demo", "bulk", "search", "v1"))
    a.record_cancelled(LABELS)
    merged = merge_snapshots(a.snapshot(), b.snapshot())
    text = render_snapshot(merged).decode()
    ttft = "firstlight_time_to_first_token_seconds_bucket"
    assert sample(text, ttft, le="0.0025", **{"class": "interactive"}) == 1
    assert sample(text, ttft, le="5.0", **{"class": "interactive"}) == 2
    assert sample(text, ttft, le="+Inf", feature="search", prompt_version="v1") == 1
    assert sample(text, "firstlight_prompt_tokens_total", **{"class": "interactive"}) == 20
    assert sample(text, "firstlight_request_cancelled_total") == 1
    assert a.render(b.snapshot()).decode() == text  # render(*others) is the same merge
    assert merge_snapshots(a.snapshot()) == a.snapshot()  # inputs untouched, idempotent shape


def test_engine_stats_are_read_at_scrape_time():
    engine = FakeEngine()
    calls = []

    def stats():
        calls.append(1)
        return [({"model": "demo"}, engine.stats())]

    metrics = Metrics(engine_stats=stats)
    assert calls == []
    text = metrics.render().decode()
    assert len(calls) == 1
    running = "firstlight_num_requests_running"
    assert sample(text, running, model="demo", **{"class": "interactive"}) == 1
    assert sample(text, "firstlight_num_requests_waiting", **{"class": "bulk"}) == 2
    assert sample(text, "firstlight_kv_cache_usage_perc", model="demo") == 0.25
    assert sample(text, "firstlight_prefix_cache_hits_total") == 40
    assert sample(text, "firstlight_num_preemptions_total") == 3
    assert sample(text, "firstlight_num_interrupted_steps_total") == 5
    assert sample(text, "firstlight_kv_num_free_blocks") == 48
    assert "999" not in text  # an engine counter without a family is not rendered
    assert "spec_decode" not in text  # no family for what nothing produces

    def with_usage(usage: float) -> EngineStats:
        return dataclasses.replace(
            engine.stats(), kv=dataclasses.replace(engine.stats().kv, usage=usage)
        )

    replicas = merge_snapshots(
        engine_snapshot(with_usage(0.5), {"model": "demo", "replica": "r1"}),
        engine_snapshot(with_usage(0.1), {"model": "demo", "replica": "r2"}),
    )
    text = render_snapshot(replicas).decode()
    assert sample(text, "firstlight_kv_cache_usage_perc", replica="r1") == 0.5
    assert sample(text, "firstlight_kv_cache_usage_perc", replica="r2") == 0.1


def test_engine_families_keep_their_names_types_and_labels():
    snapshot = engine_snapshot(FakeEngine().stats(), {"model": "demo"})
    by_class, plain = ["model", "class"], ["model"]
    assert {name: (f["type"], f["labels"]) for name, f in snapshot.items()} == {
        "firstlight_num_requests_running": ("gauge", by_class),
        "firstlight_num_requests_waiting": ("gauge", by_class),
        "firstlight_kv_cache_usage_perc": ("gauge", plain),
        "firstlight_kv_num_blocks": ("gauge", plain),
        "firstlight_kv_num_free_blocks": ("gauge", plain),
        "firstlight_prefix_cache_queries": ("counter", plain),
        "firstlight_prefix_cache_hits": ("counter", plain),
        "firstlight_num_preemptions": ("counter", plain),
        "firstlight_num_interrupted_steps": ("counter", plain),
        "firstlight_num_aborted": ("counter", plain),
        "firstlight_num_reader_stalls": ("counter", plain),
    }


def test_a_failing_stats_source_does_not_break_the_scrape():
    def broken():
        raise RuntimeError("replica gone")

    metrics = Metrics(engine_stats=broken)
    record(metrics)
    assert b"firstlight_e2e_request_latency_seconds" in metrics.render()


async def test_metrics_endpoint_after_requests_with_bounded_tags():
    script = Script(pieces=("a", "b", "c"), delay_s=0.003)
    app, _ = make_app(FakeEngine(script=script), max_label_values=2)
    async with make_client(app) as client:
        for i in range(4):
            body = chat_body(stream=i % 2 == 0, metadata={"feature": f"f{i}"})
            assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    for name in HISTOGRAMS:
        if name != "inter_token_latency_seconds":
            assert sample(text, f"firstlight_{name}_count", feature="f0") == 1, name
    itl = "firstlight_inter_token_latency_seconds_count"
    assert sample(text, itl, feature="f0") == 2  # 3 token chunks, 2 gaps
    assert sample(text, "firstlight_request_success_total", feature="other") == 2
    assert 'feature="f2"' not in text
    assert sample(text, "firstlight_num_requests_running", model="demo") == 1  # fake's stats


async def test_a_non_streamed_request_takes_its_output_whole_and_engine_timings():
    engine = FakeEngine(script=Script(pieces=("a", "b", "c"), delay_s=0.003))
    app, _ = make_app(engine)
    async with make_client(app) as client:
        for stream in (False, True):
            body = chat_body(stream=stream, metadata={"feature": f"s{int(stream)}"})
            assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        text = (await client.get("/metrics")).text
    assert [r.whole_output for r in engine.requests] == [True, False]
    # not streamed: TTFT as the engine measured it, and no chunk gaps (nothing was streamed)
    assert sample(text, "firstlight_time_to_first_token_seconds_count", feature="s0") == 1
    assert not re.search(r'inter_token_latency_seconds_count\{[^}]*feature="s0"', text)
    assert sample(text, "firstlight_inter_token_latency_seconds_count", feature="s1") == 2


async def test_extra_snapshots_are_merged_into_the_scrape():
    other = Metrics()
    record(other, labels=("demo", "bulk", "none", "none"))

    async def others():
        return [other.snapshot()]

    app, _ = make_app()
    app.state.firstlight.extra_metrics = others
    async with make_client(app) as client:
        text = (await client.get("/metrics")).text
    assert sample(text, "firstlight_e2e_request_latency_seconds_count", **{"class": "bulk"}) == 1
