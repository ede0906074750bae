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
from engine.errors import QueueFull, Unavailable
from engine.kv.sketch import PrefixSketch
from engine.request import Request, RequestClass
from engine.stats import AdmissionStats, ClassCounts, EngineStats, KVStats
from policies.prefix_index import PrefixIndex


def make_stats(
    *,
    waiting: ClassCounts = ClassCounts(),
    running: int = 1,
    usage: float = 0.25,
    max_waiting: int = 8,
    reserve: int = 2,
    drain_rate: float | None = None,
    seats: int = 4,
) -> EngineStats:
    return EngineStats(
        model="demo",
        running=ClassCounts(interactive=running),
        waiting=waiting,
        kv=KVStats(
            num_blocks=64,
            num_free_blocks=30,
            usage=usage,
            prefix_cache_queries=100,
            prefix_cache_hits=40,
        ),
        admission=AdmissionStats(max_waiting, reserve, drain_rate, max_running=seats),
    )


def make_report(rid: str, *, healthy: bool = True, **stats) -> ReplicaReport:
    return ReplicaReport(replica_id=rid, model="demo", stats=make_stats(**stats), healthy=healthy)


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
    a = make_report("a", waiting=ClassCounts(interactive=2), running=3)
    state.report_replica(a, now=100.0)
    state.report_replica(make_report("b"), now=101.5)
    view = state.view(now=102.0)
    by_id = {r.replica_id: r for r in view.replicas}
    assert by_id["a"] == ReplicaView("a", "demo", a.stats, age_s=2.0)
    assert (by_id["a"].running, by_id["a"].waiting, by_id["a"].kv_free_blocks) == (3, 2, 30)
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
BULK = Request("b", [1, 2, 3], request_class=RequestClass.BULK)


def test_cache_refuses_only_when_fresh():
    cache = make_cache()
    cache.update(view_of(make_report("a")), now=10.0)
    cache.update(view_of(), now=11.0)
    with pytest.raises(Unavailable):
        cache.admit(REQUEST, now=11.5)
    cache.admit(REQUEST, now=13.5)  # stale: admits, Serve and the engine decide
    cache.update(view_of(make_report("a", waiting=ClassCounts(interactive=8))), now=20.0)
    cache.admit(REQUEST, now=20.1)  # a full queue in the view is no refusal: it may be old


def test_retry_after_is_the_engine_rule_for_the_replica_that_drains_soonest():
    cache = make_cache()
    bulk_full = ClassCounts(bulk=6)  # 8 places, 2 kept for interactive
    cache.update(
        view_of(
            make_report("a", waiting=bulk_full, drain_rate=2.0),
            make_report("b", waiting=bulk_full + ClassCounts(interactive=1), drain_rate=0.5),
        ),
        now=1.0,
    )
    assert cache.retry_after_s(RequestClass.BULK) == pytest.approx(6 / 2.0)  # a drains soonest
    cache.update(
        view_of(make_report("a", waiting=ClassCounts(interactive=8), drain_rate=2.0)), now=3.0
    )
    assert cache.retry_after_s(RequestClass.INTERACTIVE) == pytest.approx(8 / 2.0)
    cache.update(view_of(), now=4.0)
    assert cache.retry_after_s(RequestClass.BULK) == 1.0  # nothing known: the floor


def test_capacity_refuses_a_burst_from_this_ingress_before_any_report_shows_it():
    """Two replicas of 4 seats + 8 places (2 kept for interactive): this ingress's own
    requests in flight are refused past what they hold, with no fresher view needed."""
    cache = make_cache()
    cache.update(view_of(make_report("a", drain_rate=2.0), make_report("b")), now=1.0)
    interactive, bulk = RequestClass.INTERACTIVE, RequestClass.BULK
    cache.check_capacity(interactive, 1, in_flight=23, now=1.0)  # 24 fit
    with pytest.raises(QueueFull) as refused:
        cache.check_capacity(interactive, 1, in_flight=24, now=1.0)
    assert refused.value.retry_after_s == cache.retry_after_s(interactive)
    cache.check_capacity(bulk, 1, in_flight=19, now=1.0)  # 24 - 2 * 2 kept for interactive
    with pytest.raises(QueueFull):
        cache.check_capacity(bulk, 1, in_flight=20, now=1.0)
    with pytest.raises(QueueFull):
        cache.check_capacity(interactive, 4, in_flight=21, now=1.0)  # n=4 at once
    cache.check_capacity(interactive, 1, in_flight=1000, now=9.0)  # stale: engines decide
    cache.update(view_of(), now=10.0)
    cache.check_capacity(interactive, 1, in_flight=1000, now=10.0)  # none known: admit decides


def test_cache_answers_unavailable_once_replicas_were_seen_and_are_gone():
    cache = make_cache()
    cache.update(view_of(), now=1.0)
    cache.admit(REQUEST, now=1.0)  # nothing seen yet (startup): no 503
    cache.update(view_of(make_report("a"), make_report("b", usage=0.75)), now=2.0)
    assert len(cache.replicas()) == 2
    total = cache.stats()
    assert (total.running.total, total.kv.num_free_blocks, total.kv.num_blocks) == (2, 60, 128)
    assert total.kv.usage == pytest.approx(0.5)  # block-weighted
    assert total.kv.prefix_cache_hits == 80
    cache.update(view_of(), now=3.0)
    with pytest.raises(Unavailable):
        cache.admit(REQUEST, now=3.0)
    empty = cache.stats()
    assert (empty.running.total, empty.waiting.total, empty.kv.num_free_blocks) == (0, 0, 0)


def test_a_serverless_model_without_replicas_makes_requests_wait_not_fail():
    cache = ClusterCache(model="demo", stale_after_s=5.0, serverless=True)
    cache.update(view_of(make_report("a")), now=1.0)
    cache.update(view_of(), now=2.0)  # scaled to zero
    cache.admit(REQUEST, now=2.0)  # no 503: Serve starts a replica for it


def sketch_report(rid: str, update) -> ReplicaReport:
    return ReplicaReport(replica_id=rid, model="demo", stats=make_stats(), sketch=update)


def test_the_control_plane_follows_each_replicas_sketch_and_brings_routers_up_to_date():
    state = ClusterState(ttl_s=3.0)
    a, b = PrefixSketch(), PrefixSketch()
    a.added(1)
    assert not state.report_replica(sketch_report("a", a.take()), now=1.0)  # a diff first
    assert state.report_replica(sketch_report("a", a.take(full=True)), now=1.0)
    b.added(7)
    assert state.report_replica(sketch_report("b", b.take(full=True)), now=1.0)
    router = PrefixIndex()
    first = state.sync_router(router.have(), "demo", now=1.5)
    assert sorted(first.live) == ["a", "b"] and all(u.full for u in first.updates.values())
    assert sorted(first.stats) == ["a", "b"]  # with each replica's latest stats
    router.apply(first.updates, first.live)
    assert state.sync_router(router.have(), "demo", now=1.5).updates == {}  # up to date
    for h in (2, 3):  # two reports later, the router gets one merged diff
        a.added(h)
        assert state.report_replica(sketch_report("a", a.take()), now=2.0)
    a.removed(1)
    state.report_replica(sketch_report("a", a.take()), now=2.0)
    sync = state.sync_router(router.have(), "demo", now=2.0)
    update = sync.updates["a"]
    assert not update.full and sorted(update.added) == [2, 3] and update.removed == (1,)
    router.apply(sync.updates, sync.live)
    assert router.depths([2, 3], ["a", "b"]) == {"a": 2, "b": 0}
    # a replica silent past the TTL leaves the view, and its sketch with it
    state.report_replica(sketch_report("a", a.take()), now=3.5)
    gone = state.sync_router(router.have(), "demo", now=5.0)
    assert gone.live == ("a",) and "b" not in state.sketches
    router.apply(gone.updates, gone.live)
    assert "b" not in router


def test_a_router_too_far_behind_gets_the_whole_set():
    state = ClusterState()
    state.sketches.history = 2
    a = PrefixSketch()
    state.report_replica(sketch_report("a", a.take(full=True)), now=1.0)
    router = PrefixIndex()
    router.apply(state.sync_router({}, "demo", now=1.0).updates, ["a"])
    for h in range(5):
        a.added(h)
        state.report_replica(sketch_report("a", a.take()), now=1.0)
    update = state.sync_router(router.have(), "demo", now=1.0).updates["a"]
    assert update.full and sorted(update.added) == [0, 1, 2, 3, 4]


def test_cold_starts_reach_metrics_once_per_replica_and_outlive_it():
    state = ClusterState(ttl_s=3.0)
    report = ReplicaReport("a", "demo", make_stats(), cold_start_s=7.5)
    state.report_replica(report, now=1.0)
    state.report_replica(report, now=2.0)  # every report carries it: counted once
    state.report_replica(ReplicaReport("b", "demo", make_stats(), cold_start_s=1.5), now=2.0)
    family = state.metrics_except(None)["firstlight_cold_start_seconds"]
    (only,) = family["series"]
    assert sum(only["counts"]) == 2 and only["sum"] == 9.0
    state.expire(now=10.0)  # both gone: the history stays
    assert (
        sum(state.metrics_except(None)["firstlight_cold_start_seconds"]["series"][0]["counts"]) == 2
    )
