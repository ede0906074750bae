"""Autoscaling policies: replicas wanted from queue depth, KV usage and TTFT, holding still
on stale data."""

from __future__ import annotations

import math

import pytest

from policies.autoscaling import (
    AutoscalingPolicy,
    QueueDepth,
    ReplicaSignals,
    ScalingSignals,
    SLOAware,
)
from policies.base import create


def replica(
    ongoing: float = 0,
    kv: float = 0.1,
    ttft: float | None = None,
    bulk_ttft: float | None = None,
    age: float = 1.0,
) -> ReplicaSignals:
    return ReplicaSignals(ongoing, kv, ttft, bulk_ttft, age)


def signals(*replicas: ReplicaSignals, current: int | None = None, queued: float = 0):
    n = len(replicas) if current is None else current
    return ScalingSignals(current=n, target=n, replicas=replicas, queued=queued)


def test_queue_depth_wants_ongoing_over_the_per_replica_target():
    policy = QueueDepth(target_ongoing_requests=8)
    assert policy.desired(signals(replica(ongoing=20), replica(ongoing=12))) == 4.0
    assert policy.desired(signals(replica(ongoing=2), queued=6)) == 1.0
    assert math.ceil(policy.desired(signals(replica(), replica()))) == 0


def test_slo_scales_out_on_pressure_even_with_a_short_queue():
    policy = SLOAware(target_ongoing_requests=16, kv_high=0.9, ttft_slo_s=0.5)
    quiet = signals(replica(ongoing=4, ttft=0.05))
    assert math.ceil(policy.desired(quiet)) == 1
    slow = signals(replica(ongoing=4, ttft=0.8))  # TTFT p95 over its SLO with work queued
    assert policy.desired(slow) == 2
    full_kv = signals(replica(ongoing=3, kv=0.95), replica(ongoing=3, kv=0.97))
    assert policy.desired(full_kv) == 3
    slow_bulk = signals(replica(ongoing=2, bulk_ttft=45.0))
    assert policy.desired(slow_bulk) == 2


def test_an_old_p95_from_a_drained_replica_does_not_scale_out():
    policy = SLOAware(ttft_slo_s=0.5)
    assert math.ceil(policy.desired(signals(replica(ongoing=0, ttft=3.0)))) == 0


def test_slo_sheds_a_replica_only_when_latency_is_well_under_its_slo():
    policy = SLOAware(target_ongoing_requests=16, ttft_slo_s=1.0)
    warm = signals(replica(ongoing=2, ttft=0.7), replica(ongoing=1, ttft=0.6))
    assert policy.desired(warm) == 2  # the queue wants 1, TTFT is at 70% of its SLO
    cool = signals(replica(ongoing=2, ttft=0.1), replica(ongoing=1, ttft=0.1))
    assert math.ceil(policy.desired(cool)) == 1


def test_stale_data_holds_the_current_target():
    policy = SLOAware(stale_after_s=5.0)
    stale = ScalingSignals(
        current=2, target=2, replicas=[replica(ongoing=100, age=9.0), replica(age=1.0)]
    )
    assert policy.desired(stale) == 2  # half known: no scale-in from what is missing
    loaded = ScalingSignals(
        current=2, target=2, replicas=[replica(ongoing=40, age=1.0), replica(age=9.0)]
    )
    assert QueueDepth(16, stale_after_s=5.0).desired(loaded) == 5.0  # 40 stands for 80
    gone = ScalingSignals(current=3, target=3, replicas=[replica(ongoing=100, age=1.0)])
    assert policy.desired(gone) == 3  # 1 of 3 known: holds still
    assert QueueDepth(stale_after_s=5.0).desired(gone) == 3


def test_registry_and_bad_options():
    assert isinstance(create(AutoscalingPolicy, "slo"), SLOAware)
    assert isinstance(create(AutoscalingPolicy, "queue_depth"), QueueDepth)
    with pytest.raises(ValueError):
        SLOAware(kv_high=0)
    with pytest.raises(ValueError):
        QueueDepth(target_ongoing_requests=0)
