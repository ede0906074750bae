"""The control plane's data: what replicas and ingresses report, and the view they get back.

Plain Python (no Ray), so the control plane deployment stays a thin shell and this logic is
tested without a cluster. Messages are dataclasses with slots; snapshots are
`app.metric_snapshot` plain data.

Flow (never per token): every ModelReplica pushes a `ReplicaReport` (its `AsyncEngine.stats()`,
a typed `EngineStats`, and the change of its prefix cache as a `SketchUpdate`) every ~0.5 s;
every ingress pushes an `IngressReport` (its HTTP metrics snapshot) and gets back a
`ClusterSnapshot`: the `ClusterView` for admission/routing plus the metrics of everything
*except* itself, so it renders one `/metrics` for the whole application by merging its own
fresh snapshot with that. Every router asks for the sketch diffs it has not seen and the
replicas' stats (`ClusterState.sync_router`). A source silent for longer than the TTL leaves
the view.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from app.metric_snapshot import (
    COLD_START_BUCKETS,
    Snapshot,
    engine_snapshot,
    histogram_snapshot,
    merge_snapshots,
)
from engine.errors import QueueFull, Unavailable
from engine.kv.sketch import HeldBlocks, SketchUpdate
from engine.request import Request, RequestClass
from engine.sched.admission import requests_ahead, retry_after_s
from engine.stats import EngineStats, sum_engine_stats

R = TypeVar("R")


@dataclass(slots=True)
class ReplicaReport:
    replica_id: str
    model: str
    stats: EngineStats  # its AsyncEngine.stats()
    healthy: bool = True
    sketch: SketchUpdate | None = None  # its prefix cache's change since its last report
    cold_start_s: float | None = None  # scale-up decision to its first token (once known)


@dataclass(slots=True)
class IngressReport:
    ingress_id: str
    metrics: Snapshot  # the ingress's own HTTP metrics (no engine stats)


@dataclass(slots=True, frozen=True)
class ReplicaView:
    """One replica as admission and routing see it: its last reported engine stats."""

    replica_id: str
    model: str
    stats: EngineStats
    age_s: float  # seconds since its last report, when the view was built

    @classmethod
    def from_report(cls, report: ReplicaReport, age_s: float) -> ReplicaView:
        return cls(report.replica_id, report.model, report.stats, age_s)

    @property
    def running(self) -> int:
        return self.stats.running.total

    @property
    def waiting(self) -> int:
        return self.stats.waiting.total

    @property
    def kv_usage(self) -> float:
        return self.stats.kv.usage

    @property
    def kv_free_blocks(self) -> int:
        return self.stats.kv.num_free_blocks


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


@dataclass(slots=True, frozen=True)
class RouterSync:
    """A router's sync answer: the live replicas, the updates that bring its copy of their
    prefix sketches to the control plane's, and their latest engine stats."""

    live: tuple[str, ...]
    updates: dict[str, SketchUpdate]
    stats: dict[str, EngineStats] = field(default_factory=dict)


class SketchStore:
    """The latest prefix sketch of every replica, and its last `history` diffs, so a router
    that is a few versions behind gets one merged diff instead of the whole set."""

    def __init__(self, history: int = 32) -> None:
        self._held: dict[str, HeldBlocks] = {}
        self._diffs: dict[str, deque[SketchUpdate]] = {}
        self.history = history

    def __contains__(self, replica_id: str) -> bool:
        return replica_id in self._held

    def apply(self, replica_id: str, update: SketchUpdate) -> bool:
        """Apply a replica's update; False: it does not fit (send a full one next)."""
        held = self._held.setdefault(replica_id, HeldBlocks())
        diffs = self._diffs.setdefault(replica_id, deque(maxlen=self.history))
        epoch = held.epoch
        if not held.apply(update):
            return False
        if update.full or update.epoch != epoch:
            diffs.clear()
        elif not update.empty:
            diffs.append(update)
        return True

    def remove(self, replica_id: str) -> None:
        self._held.pop(replica_id, None)
        self._diffs.pop(replica_id, None)

    def sync(self, have: Mapping[str, tuple[int, int]], live: Iterable[str]) -> RouterSync:
        """For each live replica with a sketch: nothing when `have` is current, one merged
        diff when its version is still in the history, else the full set."""
        live = tuple(live)
        updates: dict[str, SketchUpdate] = {}
        for rid in live:
            held = self._held.get(rid)
            if held is None:
                continue
            epoch, version = have.get(rid, (-1, -1))
            if (epoch, version) == (held.epoch, held.version):
                continue
            diffs = [d for d in self._diffs[rid] if d.base >= version]
            if epoch == held.epoch and diffs and diffs[0].base == version:
                updates[rid] = _merged(diffs, held)
            else:
                updates[rid] = held.as_full()
        return RouterSync(live, updates)


def _merged(diffs: list[SketchUpdate], held: HeldBlocks) -> SketchUpdate:
    net: dict[int, bool] = {}
    for diff in diffs:
        net.update(dict.fromkeys(diff.removed, False))
        net.update(dict.fromkeys(diff.added, True))
    return SketchUpdate(
        held.epoch,
        diffs[0].base,
        diffs[-1].version,
        tuple(h for h, present in net.items() if present),
        tuple(h for h, present in net.items() if not present),
        extra_key=held.extra_key,
        block_size=held.block_size,
    )


@dataclass(slots=True)
class _Seen(Generic[R]):
    report: R
    at: float  # monotonic time of arrival at the control plane


@dataclass(slots=True)
class ClusterState:
    """The control plane's memory: latest report per source, expired after `ttl_s`."""

    ttl_s: float = 3.0
    replicas: dict[str, _Seen[ReplicaReport]] = field(default_factory=dict)
    ingresses: dict[str, _Seen[IngressReport]] = field(default_factory=dict)
    sketches: SketchStore = field(default_factory=SketchStore)
    # replica id → its cold start (kept after it leaves: the histogram is the fleet's history)
    cold_starts: dict[str, float] = field(default_factory=dict)
    max_cold_starts: int = 1024

    def report_replica(self, report: ReplicaReport, now: float | None = None) -> bool:
        """Record `report`; False when its sketch diff does not fit (the replica then sends
        its whole sketch with the next report)."""
        self.replicas[report.replica_id] = _Seen(report, _now(now))
        if report.cold_start_s is not None and report.replica_id not in self.cold_starts:
            self.cold_starts[report.replica_id] = report.cold_start_s
            while len(self.cold_starts) > self.max_cold_starts:
                del self.cold_starts[next(iter(self.cold_starts))]
        if report.sketch is None:
            return True
        return self.sketches.apply(report.replica_id, report.sketch)

    def remove_replica(self, replica_id: str) -> None:
        self.replicas.pop(replica_id, None)
        self.sketches.remove(replica_id)

    def report_ingress(self, report: IngressReport, now: float | None = None) -> None:
        self.ingresses[report.ingress_id] = _Seen(report, _now(now))

    def expire(self, now: float | None = None) -> None:
        now = _now(now)
        for table in (self.replicas, self.ingresses):
            for key in [k for k, seen in table.items() if now - seen.at > self.ttl_s]:
                del table[key]
                self.sketches.remove(key)

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
        if self.cold_starts:
            parts.append(
                histogram_snapshot(
                    "cold_start_seconds",
                    "Scale-up decision to the first token served by the new replica.",
                    self.cold_starts.values(),
                    COLD_START_BUCKETS,
                )
            )
        return merge_snapshots(*parts)

    def sync_router(
        self, have: Mapping[str, tuple[int, int]], model: str, now: float | None = None
    ) -> RouterSync:
        """What a router of `model`'s replicas needs: every live one's sketch and stats."""
        replicas = self.view(now).for_model(model)
        sync = self.sketches.sync(have, [r.replica_id for r in replicas])
        return RouterSync(sync.live, sync.updates, {r.replica_id: r.stats for r in replicas})

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
    serverless: bool = False  # no replica is normal: requests wait for one to start
    snapshot: ClusterSnapshot = field(default_factory=lambda: ClusterSnapshot(ClusterView(), {}))
    synced_at: float | None = None  # monotonic
    seen_replica: bool = False  # no "no replica" 503s before the first replica was ever seen

    def update(self, snapshot: ClusterSnapshot, now: float | None = None) -> None:
        self.snapshot = snapshot
        self.synced_at = _now(now)
        self.seen_replica = self.seen_replica or bool(snapshot.view.for_model(self.model))

    def fresh(self, now: float | None = None) -> bool:
        return self.synced_at is not None and _now(now) - self.synced_at <= self.stale_after_s

    def replicas(self) -> tuple[ReplicaView, ...]:
        """The live replicas of this ingress's model, as of the last sync."""
        return self.snapshot.view.for_model(self.model)

    def admit(self, request: Request, now: float | None = None) -> None:
        """Refuse early (503, no hop) from a fresh view when no replica of the model is live
        (unless the model is serverless: then the request waits while one starts).

        Full queues are not refused from the view: its queue lengths are up to a sync period
        old, and a queue that has drained since would turn requests away for nothing (a
        burst's last refusals would outlive it). Requests this ingress has in flight are known
        without delay (`check_capacity`), and each engine decides for itself, one hop away."""
        if not self.fresh(now) or self.serverless:
            return
        if not self.replicas() and self.seen_replica:
            raise Unavailable(f"no replica of {self.model!r} is running")

    def check_capacity(
        self, request_class: RequestClass, count: int, in_flight: int, now: float | None = None
    ) -> None:
        """Refuse at once (429) when this ingress's own requests in flight, plus `count` more,
        exceed what the live replicas can hold for `request_class` by the engine's rule: every
        seat and waiting place (bulk: less the places kept for interactive requests).

        Counts only this ingress's requests, so it never refuses what the engines could take
        (with several ingresses each sees less than the whole); it needs no fresh report of
        the queues, so a burst is refused before any request's tokenizing and replica hop.
        A stale or empty view refuses nothing here (`admit` and the engines decide)."""
        if not self.fresh(now):
            return
        replicas = self.replicas()
        if not replicas:
            return
        bulk = request_class is RequestClass.BULK
        capacity = sum(
            a.max_running + a.max_waiting - (a.interactive_reserve if bulk else 0)
            for a in (r.stats.admission for r in replicas)
        )
        if in_flight + count > capacity:
            raise QueueFull(
                f"every replica is full for {request_class.value} requests "
                f"({in_flight} in flight, room for {capacity})",
                retry_after_s=self.retry_after_s(request_class),
            )

    def replica_stats(self) -> dict[str, EngineStats]:
        """The live replicas' latest stats by replica id (empty while the view is stale:
        then nothing is known about them)."""
        if not self.fresh():
            return {}
        return {r.replica_id: r.stats for r in self.replicas()}

    def retry_after_s(self, request_class: RequestClass) -> float:
        """When a replica should have room for `request_class` by the engine's own rule: the
        soonest over the live replicas (the floor when none is known). Also the value for a
        refusal that comes from elsewhere (Serve's backpressure), so clients get one rule."""
        waits = [
            retry_after_s(
                requests_ahead(request_class, r.stats.waiting), r.stats.admission.drain_rate_per_s
            )
            for r in self.replicas()
        ]
        return min(waits, default=retry_after_s(0, None))

    def stats(self) -> EngineStats:
        """The live replicas summed as one engine (what `ReplicaClient.stats()` returns)."""
        return sum_engine_stats(self.model, (r.stats for r in self.replicas()))
