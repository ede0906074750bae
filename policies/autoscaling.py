"""How many model replicas a deployment wants, from what its replicas report.

Serve calls the autoscaler every control-loop tick (actors/autoscaler.py adapts it); the
policy sees each replica's latest signals and returns the replica count it wants. Serve
then applies `upscale_delay_s` / `downscale_delay_s` (a want must hold that long before it
acts), the scaling factors and `min_replicas` / `max_replicas`, and scales a deployment at
zero replicas up at once when a request arrives for it.

Signals per replica (reported every few seconds): requests in its engine (running +
waiting), KV-pool usage, and TTFT p95 per class over its recent window. A replica whose
newest report is older than `stale_after_s` is unknown. While fewer than half of the
running replicas are known the policy holds still (returns the current target): a decision
from missing data would scale a healthy deployment in or a loaded one out. While some are
unknown, the known ones stand for them (their queue depth is scaled up to the running count)
and the policy never scales in.

`slo` (the default) wants the most of:
* queue depth: the requests in the engines (and queued at callers) over
  `target_ongoing_requests` per replica;
* pressure: one more replica than now while the mean KV usage exceeds `kv_high`, or the
  interactive TTFT p95 exceeds `ttft_slo_s` (bulk's over `bulk_ttft_slo_s`) on a replica that
  has queued work;
and it sheds a replica only when the queue depth wants fewer and no pressure signal is above
half its threshold (hysteresis, so it does not flap around a threshold).

`queue_depth`: the queue-depth rule alone (what Serve's default policy does), for comparison.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from policies.base import Policy, register


@dataclass(slots=True, frozen=True)
class ReplicaSignals:
    ongoing: float  # requests running + waiting in the engine
    kv_usage: float  # 0..1
    ttft_p95_interactive_s: float | None  # None: no interactive first token in the window
    ttft_p95_bulk_s: float | None
    age_s: float  # how long ago the newest of these was reported


@dataclass(slots=True, frozen=True)
class ScalingSignals:
    current: int  # running replicas
    target: int  # Serve's target now
    replicas: Sequence[ReplicaSignals]  # one per running replica that has reported
    queued: float = 0.0  # requests queued at callers, not yet taken by any replica


class AutoscalingPolicy(Policy, family=True):
    def __init__(self, target_ongoing_requests: float = 16.0, stale_after_s: float = 10.0):
        if target_ongoing_requests <= 0 or stale_after_s <= 0:
            raise ValueError("target_ongoing_requests and stale_after_s must be positive")
        self.target_ongoing_requests = target_ongoing_requests
        self.stale_after_s = stale_after_s

    def fresh(self, signals: ScalingSignals) -> list[ReplicaSignals] | None:
        """The replicas known from fresh reports; None when the data is too stale to act."""
        fresh = [r for r in signals.replicas if r.age_s <= self.stale_after_s]
        if signals.current > 0 and 2 * len(fresh) < signals.current:
            return None
        return fresh

    def by_queue_depth(self, signals: ScalingSignals, fresh: Sequence[ReplicaSignals]) -> float:
        """Replicas wanted for the requests in the engines and queued at callers; with some
        replicas unknown, the known ones stand for them, and never fewer than now."""
        ongoing = sum(r.ongoing for r in fresh)
        if fresh and len(fresh) < signals.current:
            ongoing *= signals.current / len(fresh)
        wanted = (ongoing + signals.queued) / self.target_ongoing_requests
        if len(fresh) < signals.current:
            wanted = max(wanted, signals.current)
        return wanted

    @abstractmethod
    def desired(self, signals: ScalingSignals) -> float:
        """The replica count wanted now (Serve rounds up and bounds it)."""


@register("queue_depth")
class QueueDepth(AutoscalingPolicy):
    def desired(self, signals: ScalingSignals) -> float:
        fresh = self.fresh(signals)
        if fresh is None:
            return signals.target
        return self.by_queue_depth(signals, fresh)


@register("slo")
class SLOAware(AutoscalingPolicy):
    def __init__(
        self,
        target_ongoing_requests: float = 16.0,
        stale_after_s: float = 10.0,
        kv_high: float = 0.9,
        ttft_slo_s: float = 1.0,
        bulk_ttft_slo_s: float = 30.0,
    ) -> None:
        super().__init__(target_ongoing_requests, stale_after_s)
        if not 0.0 < kv_high <= 1.0 or ttft_slo_s <= 0 or bulk_ttft_slo_s <= 0:
            raise ValueError("slo: kv_high in (0, 1], TTFT SLOs positive")
        self.kv_high = kv_high
        self.ttft_slo_s = ttft_slo_s
        self.bulk_ttft_slo_s = bulk_ttft_slo_s

    def pressure(self, fresh: Sequence[ReplicaSignals]) -> float:
        """The worst signal as a fraction of its threshold (>= 1: over it)."""
        if not fresh:
            return 0.0
        kv = sum(r.kv_usage for r in fresh) / len(fresh) / self.kv_high
        ttft = 0.0
        for r in fresh:
            if r.ongoing <= 0:  # a p95 from a burst that has drained says nothing about now
                continue
            if r.ttft_p95_interactive_s is not None:
                ttft = max(ttft, r.ttft_p95_interactive_s / self.ttft_slo_s)
            if r.ttft_p95_bulk_s is not None:
                ttft = max(ttft, r.ttft_p95_bulk_s / self.bulk_ttft_slo_s)
        return max(kv, ttft)

    def desired(self, signals: ScalingSignals) -> float:
        fresh = self.fresh(signals)
        if fresh is None:
            return signals.target
        by_queue = self.by_queue_depth(signals, fresh)
        pressure = self.pressure(fresh)
        if pressure >= 1.0:
            return max(by_queue, signals.current + 1)
        if math.ceil(by_queue) < signals.current and pressure > 0.5:
            return signals.current  # the queue would shed one, the latency signals not yet
        return by_queue
