"""The Serve adapter of the autoscaling policy, without a cluster: an AutoscalingContext in,
the policy's want out; scale-up decisions recorded for cold-start timing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from ray.serve._private.common import TimeStampedValue

from actors import autoscaler
from actors.autoscaler import (
    ReplicaAutoscaler,
    autoscaling_stats,
    scale_up_decided_before,
    signals_from,
)


def ctx(target: int, samples: dict[str, dict[str, float]], *, at: float, now: float, queued=0.0):
    """A context whose running replicas reported `samples` (replica → metric → value) at
    time `at`."""
    raw: dict[str, dict[str, list[TimeStampedValue]]] = {}
    for rid, metrics in samples.items():
        for name, value in metrics.items():
            raw.setdefault(name, {})[rid] = [
                TimeStampedValue(at - 5, 0.0),
                TimeStampedValue(at, value),
            ]
    return SimpleNamespace(
        app_name="app",
        deployment_name="ModelReplica",
        current_num_replicas=len(samples),
        target_num_replicas=target,
        running_replicas=list(samples),
        raw_metrics=raw,
        total_queued_requests=queued,
        current_time=now,
    )


@pytest.fixture
def records(monkeypatch):
    store: dict[str, str] = {}
    monkeypatch.setattr(autoscaler, "put_cluster_record", store.__setitem__)
    monkeypatch.setattr(autoscaler, "cluster_record", store.get)
    return store


def test_signals_are_each_replicas_newest_samples_aged_by_their_time():
    sample = autoscaling_stats(12, 0.5, 0.08, None)
    assert sample["ttft_p95_bulk_s"] == -1.0  # Serve takes numbers only
    signals = signals_from(ctx(2, {"a": sample, "b": sample}, at=100.0, now=103.0, queued=4), 103.0)
    assert (signals.current, signals.target, signals.queued) == (2, 2, 4.0)
    (a, _) = signals.replicas
    assert (a.ongoing, a.kv_usage, a.ttft_p95_interactive_s, a.ttft_p95_bulk_s) == (
        12.0,
        0.5,
        0.08,
        None,
    )
    assert a.age_s == 3.0
    unreported = ctx(1, {"a": sample}, at=1.0, now=1.0)
    unreported.running_replicas.append("new")  # running, no sample yet
    assert len(signals_from(unreported, 1.0).replicas) == 1


def test_the_policy_decides_and_stale_samples_hold_it_still(records):
    scaler = ReplicaAutoscaler("slo", target_ongoing_requests=4, stale_after_s=10.0)
    busy = autoscaling_stats(16, 0.3, 0.05, None)
    assert scaler(ctx(1, {"a": busy}, at=100.0, now=101.0))[0] == 4.0
    assert scaler(ctx(1, {"a": busy}, at=100.0, now=130.0))[0] == 1  # 30 s old: hold


def test_a_grown_target_records_the_tick_that_decided_it(records):
    scaler = ReplicaAutoscaler("queue_depth", target_ongoing_requests=4)
    idle = {"a": autoscaling_stats(1, 0.1, None, None)}
    scaler(ctx(1, idle, at=10.0, now=10.0))
    scaler(ctx(1, idle, at=10.1, now=10.1))  # this tick's want made Serve decide...
    scaler(ctx(2, idle, at=10.2, now=10.2))  # ...which shows as a bigger target next tick
    assert scale_up_decided_before("app", "ModelReplica", started_at=11.0) == 10.1
    assert scale_up_decided_before("app", "ModelReplica", started_at=10.0) is None  # before it
    assert scale_up_decided_before("app", "Other", started_at=11.0) is None
    for i in range(12):  # a bounded history
        scaler(ctx(3 + i, idle, at=20.0 + i, now=20.0 + i))
    assert len(autoscaler._decisions("app", "ModelReplica")) == autoscaler.MAX_DECISIONS


def test_a_failing_record_never_disturbs_the_decision(monkeypatch):
    def broken(key: str, value: str) -> None:
        raise ConnectionError("GCS away")

    monkeypatch.setattr(autoscaler, "put_cluster_record", broken)
    monkeypatch.setattr(autoscaler, "cluster_record", lambda key: None)
    scaler = ReplicaAutoscaler("queue_depth", target_ongoing_requests=4)
    idle = {"a": autoscaling_stats(8, 0.1, None, None)}
    scaler(ctx(1, idle, at=1.0, now=1.0))
    assert scaler(ctx(2, idle, at=1.1, now=1.1))[0] == 2.0
