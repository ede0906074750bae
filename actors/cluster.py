"""The control plane's data: what replicas and ingresses report, and the view they get back.

Plain Python (no Ray), so the control plane deployment stays a thin shell and this logic is
tested without a cluster. Messages are dataclasses with slots; snapshots are
`app.metric_snapshot` plain data.

Flow (never per token): every ModelReplica pushes a `ReplicaReport` (its `AsyncEngine.stats()`)
every ~0.5 s; every ingress pushes an `IngressReport` (its HTTP metrics snapshot) and gets back
a `ClusterSnapshot`: the `ClusterView` for admission/routing plus the metrics of everything
*except* itself, so it renders one `/metrics` for the whole application by merging its own
fresh snapshot with that. A source silent for longer than the TTL leaves the view.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from app.metric_snapshot import Snapshot, engine_snapshot, merge_snapshots
from engine.errors import Unavailable
from engine.request import Request


@dataclass(slots=True)
class ReplicaReport:
    replica_id: str
    model: str
    stats: dict[str, Any]  # AsyncEngine.stats(): plain numbers and {class: number} maps
    healthy: bool = True


@dataclass(slots=True)
class IngressReport:
    ingress_id: str
    metrics: Snapshot  # the ingress's own HTTP metrics (no engine stats)


@dataclass(slots=True, frozen=True)
class ReplicaView:
    """One replica as admission and routing see it."""

    replica_id: str
    model: str
    kv_usage: float
    kv_free_blocks: int
    running: int
    waiting: int
    waiting_by_class: dict[str, int]
    age_s: float  # seconds since its last report, when the view was built

    @classmethod
    def from_report(cls, report: ReplicaReport, age_s: float) -> ReplicaView:
        stats = report.stats
        waiting = _by_class(stats.get("num_requests_waiting"))
        return cls(
            replica_id=report.replica_id,
            model=report.model,
            kv_usage=float(stats.get("kv_cache_usage_perc", 0.0)),
            kv_free_blocks=int(stats.get("kv_num_free_blocks", 0)),
            running=sum(_by_class(stats.get("num_requests_running")).values()),
            waiting=sum(waiting.values()),
            waiting_by_class=waiting,
            age_s=age_s,
        )


def _by_class(value: Any) -> dict[str, int]:
    if isinstance(value, dict):
        return {str(k): int(v) for k, v in value.items()}
    return {"all": int(value or 0)}


@dataclass(slots=True, frozen=True)
class ClusterView:
    """Live replicas as of `built_at` (wall clock). Empty until the first report arrives."""

    replicas: tuple[ReplicaView, ...] = ()
    built_at: float = 0.0

    def for_model(self, model: str) -> tuple[ReplicaView, ...]:
        return tuple(r for r in self.replicas if r.model == model)


@dataclass(slots=True, frozen=True)
class ClusterSnapshot:
    """What an ingress gets back from a sync: the view and everyone else's metrics."""

    view: ClusterView
    metrics: Snapshot


@dataclass(slots=True)
class _Seen:
    report: Any
    at: float  # monotonic time of arrival at the control plane


@dataclass(slots=True)
class ClusterState:
    """The control plane's memory: latest report per source, expired after `ttl_s`."""

    ttl_s: float = 3.0
    replicas: dict[str, _Seen] = field(default_factory=dict)
    ingresses: dict[str, _Seen] = field(default_factory=dict)

    def report_replica(self, report: ReplicaReport, now: float | None = None) -> None:
        self.replicas[report.replica_id] = _Seen(report, _now(now))

    def remove_replica(self, replica_id: str) -> None:
        self.replicas.pop(replica_id, None)

    def report_ingress(self, report: IngressReport, now: float | None = None) -> None:
        self.ingresses[report.ingress_id] = _Seen(report, _now(now))

    def expire(self, now: float | None = None) -> None:
        now = _now(now)
        for table in (self.replicas, self.ingresses):
            for key in [k for k, seen in table.items() if now - seen.at > self.ttl_s]:
                del table[key]

    def view(self, now: float | None = None) -> ClusterView:
        now = _now(now)
        self.expire(now)
        replicas = tuple(
            ReplicaView.from_report(seen.report, now - seen.at)
            for seen in self.replicas.values()
            if seen.report.healthy
        )
        return ClusterView(replicas=replicas, built_at=time.time())

    def metrics_except(self, ingress_id: str | None) -> Snapshot:
        """Engine metrics of every replica (labelled by replica) plus the HTTP metrics of
        every ingress other than `ingress_id`, merged."""
        parts = [
            engine_snapshot(
                seen.report.stats, {"model": seen.report.model, "replica": seen.report.replica_id}
            )
            for seen in self.replicas.values()
        ]
        parts += [seen.report.metrics for key, seen in self.ingresses.items() if key != ingress_id]
        return merge_snapshots(*parts)

    def sync(self, report: IngressReport, now: float | None = None) -> ClusterSnapshot:
        self.report_ingress(report, now)
        view = self.view(now)
        return ClusterSnapshot(view=view, metrics=self.metrics_except(report.ingress_id))


def _now(now: float | None) -> float:
    return time.monotonic() if now is None else now


@dataclass(slots=True)
class ClusterCache:
    """An ingress's local copy of the last `ClusterSnapshot`, refreshed in the background.

    Requests only read it (never a remote call). It is trusted only while fresh (synced
    within `stale_after_s`): a stale cache (control plane unreachable) refuses nothing and lets
    Serve route as usual.
    """

    model: str
    stale_after_s: float
    snapshot: ClusterSnapshot = field(default_factory=lambda: ClusterSnapshot(ClusterView(), {}))
    synced_at: float | None = None  # monotonic
    seen_replica: bool = False  # no "no replica" 503s before the first replica was ever seen

    def update(self, snapshot: ClusterSnapshot, now: float | None = None) -> None:
        self.snapshot = snapshot
        self.synced_at = _now(now)
        self.seen_replica = self.seen_replica or bool(snapshot.view.for_model(self.model))

    def fresh(self, now: float | None = None) -> bool:
        return self.synced_at is not None and _now(now) - self.synced_at <= self.stale_after_s

    def admit(self, request: Request, now: float | None = None) -> None:
        """Refuse early (503, no hop) when no replica of the model is live.

        Full queues are not refused here: a view up to a sync period old would turn away
        requests a replica has room for again, so 429 stays with the engine's own bounded
        queue (and Serve's `max_queued_requests`), one hop away."""
        if not self.fresh(now):
            return
        if not self.snapshot.view.for_model(self.model) and self.seen_replica:
            raise Unavailable(f"no replica of {self.model!r} is running")

    def stats(self) -> dict[str, Any]:
        """Sums over live replicas (what `ReplicaClient.stats()` returns)."""
        replicas = self.snapshot.view.for_model(self.model)
        return {
            "num_replicas": len(replicas),
            "num_requests_running": sum(r.running for r in replicas),
            "num_requests_waiting": sum(r.waiting for r in replicas),
            "kv_num_free_blocks": sum(r.kv_free_blocks for r in replicas),
        }
