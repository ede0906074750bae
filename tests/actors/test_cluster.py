"""The control plane's logic without Ray: reports in, view and merged metrics out."""

from __future__ import annotations

import pytest

from actors.cluster import (
    ClusterCache,
    ClusterSnapshot,
    ClusterState,
    ClusterView,
    IngressReport,
    ReplicaReport,
    ReplicaView,
)
from app.metrics import Metrics
from engine.errors import Unavailable
from engine.request import Request


def make_report(
    rid: str, *, waiting: int = 0, running: int = 1, usage: float = 0.25, healthy: bool = True
) -> ReplicaReport:
    stats = {
        "num_requests_running": {"interactive": running, "bulk": 0},
        "num_requests_waiting": {"interactive": waiting, "bulk": 0},
        "kv_cache_usage_perc": usage,
        "kv_num_free_blocks": 30,
        "prefix_cache_queries": 100,
        "prefix_cache_hits": 40,
    }
    return ReplicaReport(replica_id=rid, model="demo", stats=stats, healthy=healthy)


def http_snapshot(ttft_s: float) -> dict:
    metrics = Metrics()
    labels = metrics.labels("demo", "interactive", {})
    metrics.record_request(
        labels,
        ttft_s=ttft_s,
        itl_s=[0.01],
        tpot_s=0.01,
        e2e_s=0.1,
        engine_timings={},
        finish_reasons=["stop"],
        prompt_tokens=3,
        generation_tokens=2,
    )
    metrics.record_cancelled(labels)
    return metrics.snapshot()


def series(snapshot: dict, name: str) -> dict[tuple, float]:
    family = snapshot[name]
    return {tuple(s["labels"]): s.get("value", sum(s.get("counts", ()))) for s in family["series"]}


def test_view_lists_live_replicas_and_expires_silent_ones():
    state = ClusterState(ttl_s=3.0)
    state.report_replica(make_report("a", waiting=2, running=3), now=100.0)
    state.report_replica(make_report("b"), now=101.5)
    view = state.view(now=102.0)
    by_id = {r.replica_id: r for r in view.replicas}
    assert by_id["a"] == ReplicaView(
        "a", "demo", 0.25, 30, 3, 2, {"interactive": 2, "bulk": 0}, age_s=2.0
    )
    assert state.view(now=103.5).for_model("demo")[0].replica_id == "b"  # a: 3.5 s silent
    assert state.view(now=105.0).replicas == ()
    assert state.view(now=105.0).for_model("other") == ()


def test_unhealthy_and_removed_replicas_leave_the_view():
    state = ClusterState()
    state.report_replica(make_report("a", healthy=False), now=1.0)
    state.report_replica(make_report("b"), now=1.0)
    assert [r.replica_id for r in state.view(now=1.0).replicas] == ["b"]
    state.remove_replica("b")
    assert state.view(now=1.0).replicas == ()


def test_sync_returns_everything_but_the_callers_own_metrics():
    state = ClusterState()
    state.report_replica(make_report("r1", usage=0.5), now=1.0)
    state.report_replica(make_report("r2", usage=0.25), now=1.0)
    state.report_ingress(IngressReport("i2", http_snapshot(0.02)), now=1.0)
    snapshot = state.sync(IngressReport("i1", http_snapshot(0.5)), now=1.5)
    assert len(snapshot.view.replicas) == 2
    kv = series(snapshot.metrics, "firstlight_kv_cache_usage_perc")
    assert kv == {("demo", "r1"): 0.5, ("demo", "r2"): 0.25}  # one gauge per replica
    hits = series(snapshot.metrics, "firstlight_prefix_cache_hits")
    assert sum(hits.values()) == 80
    ttft = snapshot.metrics["firstlight_time_to_first_token_seconds"]["series"]
    assert [s["sum"] for s in ttft] == [pytest.approx(0.02)]  # only i2's, not the caller's
    # The other ingress sees i1's metrics in turn.
    other = state.sync(IngressReport("i2", http_snapshot(0.02)), now=1.6)
    assert [
        s["sum"] for s in other.metrics["firstlight_time_to_first_token_seconds"]["series"]
    ] == [pytest.approx(0.5)]


def make_cache(**kwargs) -> ClusterCache:
    return ClusterCache(model="demo", stale_after_s=2.0, **kwargs)


def view_of(*reports: ReplicaReport) -> ClusterSnapshot:
    return ClusterSnapshot(
        ClusterView(tuple(ReplicaView.from_report(r, 0.0) for r in reports), 0.0), {}
    )


REQUEST = Request("r", [1, 2, 3])


def test_cache_refuses_only_when_fresh_and_never_for_full_queues():
    cache = make_cache()
    cache.update(view_of(make_report("a")), now=10.0)
    cache.update(view_of(), now=11.0)
    with pytest.raises(Unavailable):
        cache.admit(REQUEST, now=11.5)
    cache.admit(REQUEST, now=13.5)  # stale: admits, Serve and the engine decide
    cache.update(view_of(make_report("a", waiting=99)), now=20.0)
    cache.admit(REQUEST, now=20.1)  # a full queue is the engine's call (429), not the cache's


def test_cache_answers_unavailable_once_replicas_were_seen_and_are_gone():
    cache = make_cache()
    cache.update(view_of(), now=1.0)
    cache.admit(REQUEST, now=1.0)  # nothing seen yet (startup): no 503
    cache.update(view_of(make_report("a")), now=2.0)
    assert cache.stats()["num_replicas"] == 1
    cache.update(view_of(), now=3.0)
    with pytest.raises(Unavailable):
        cache.admit(REQUEST, now=3.0)
    assert cache.stats() == {
        "num_replicas": 0,
        "num_requests_running": 0,
        "num_requests_waiting": 0,
        "kv_num_free_blocks": 0,
    }
