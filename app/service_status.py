"""The service at a glance, as JSON: what the playground's live panel polls (`GET /status`).

Read from the same merged metric snapshot as `/metrics` (this process's metrics plus the
other processes' snapshots the app is given), so the panel and a Prometheus scrape never
disagree:

* one entry per engine: each engine snapshot has exactly one `kv_num_blocks` series, labelled
  by model (bare mode) or by model and replica (Serve mode), so its label values name it;
* running and waiting requests by class, summed over the engines;
* KV usage of the whole fleet: each engine's usage weighted by its pool size;
* TTFT p50/p95 by class over about the last minute. Histograms in a snapshot are cumulative,
  so `TTFTWindow` keeps the counts it saw at earlier polls and subtracts the one from about
  `window_s` ago (linear interpolation inside a bucket, as Prometheus' `histogram_quantile`);
* finished, cancelled and failed requests since start (counters).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from app.metric_snapshot import PREFIX, Snapshot
from engine.request import RequestClass

Counts = dict[str, list[float]]  # request class → non-cumulative bucket counts (+Inf last)
CLASSES = tuple(c.value for c in RequestClass)


@dataclass(slots=True, frozen=True)
class EngineStatus:
    """One engine (a replica in Serve mode)."""

    name: str
    running: int
    waiting: int
    kv_usage: float
    kv_blocks: int


@dataclass(slots=True, frozen=True)
class LatencySummary:
    """A latency histogram's quantiles over `window_s` seconds (None: since the start)."""

    window_s: float | None
    count: int
    p50_s: float | None
    p95_s: float | None


@dataclass(slots=True, frozen=True)
class ServiceStatus:
    engines: list[EngineStatus]
    running: dict[str, int]  # by request class
    waiting: dict[str, int]
    kv_usage: float | None  # None: no engine reported yet
    ttft: dict[str, LatencySummary]  # by request class
    finished: int
    cancelled: int
    errors: int


@dataclass(slots=True)
class TTFTWindow:
    """Cumulative TTFT bucket counts seen at earlier polls, kept for `window_s`.

    `recent(now, counts)` answers the counts added since the oldest kept sample, which is
    the newest one at least `window_s` old once polls have gone on that long (until then,
    since the first poll; at the first poll, since the start). Samples closer together than
    `min_gap_s` are not kept, so many pollers do not grow it."""

    window_s: float = 60.0
    min_gap_s: float = 1.0
    samples: deque[tuple[float, Counts]] = field(default_factory=deque)

    def recent(self, now: float, counts: Counts) -> tuple[float | None, Counts]:
        samples = self.samples
        while len(samples) >= 2 and samples[1][0] <= now - self.window_s:
            samples.popleft()
        span: float | None = None
        base: Counts = {}
        if samples:
            since, base = samples[0]
            span = now - since
        if not samples or now - samples[-1][0] >= self.min_gap_s:
            samples.append((now, {k: list(v) for k, v in counts.items()}))
        delta = {cls: _minus(values, base.get(cls)) for cls, values in counts.items()}
        return span, delta


def _minus(now: list[float], before: list[float] | None) -> list[float]:
    """Counts added since `before` (a source that restarted reads as having added none)."""
    if before is None:
        return list(now)
    return [max(0.0, a - b) for a, b in zip(now, before, strict=True)]


def histogram_quantile(q: float, bounds: Sequence[float], counts: Sequence[float]) -> float | None:
    """The `q` quantile of non-cumulative bucket `counts` (last one +Inf) with upper `bounds`;
    None when empty. A quantile in the +Inf bucket reads as the largest finite bound."""
    total = sum(counts)
    if total <= 0:
        return None
    rank, below = q * total, 0.0
    for i, count in enumerate(counts):
        if count > 0 and below + count >= rank:
            if i >= len(bounds):
                return float(bounds[-1])
            low = bounds[i - 1] if i else 0.0
            return low + (bounds[i] - low) * (rank - below) / count
        below += count
    return float(bounds[-1])


def service_status(snapshot: Snapshot, window: TTFTWindow, now: float) -> ServiceStatus:
    engines = _engines(snapshot)
    blocks = sum(e.kv_blocks for e in engines)
    ttft = snapshot.get(PREFIX + "time_to_first_token_seconds")
    span, recent = window.recent(now, _ttft_counts(ttft))
    bounds = ttft["buckets"] if ttft else []
    return ServiceStatus(
        engines=engines,
        running=_by_class(snapshot, "num_requests_running"),
        waiting=_by_class(snapshot, "num_requests_waiting"),
        kv_usage=sum(e.kv_usage * e.kv_blocks for e in engines) / blocks if blocks else None,
        ttft={
            cls: LatencySummary(
                window_s=span,
                count=int(sum(recent.get(cls, ()))),
                p50_s=histogram_quantile(0.5, bounds, recent.get(cls, ())),
                p95_s=histogram_quantile(0.95, bounds, recent.get(cls, ())),
            )
            for cls in CLASSES
        },
        finished=int(_total(snapshot, "request_success")),
        cancelled=int(_total(snapshot, "request_cancelled")),
        errors=int(_total(snapshot, "request_error")),
    )


def _series(snapshot: Snapshot, name: str) -> list[dict[str, Any]]:
    family = snapshot.get(PREFIX + name)
    return family["series"] if family else []


def _total(snapshot: Snapshot, name: str) -> float:
    return sum(s["value"] for s in _series(snapshot, name))


def _by_class(snapshot: Snapshot, name: str) -> dict[str, int]:
    """A per-class gauge summed over engines (its last label is `class`)."""
    out = dict.fromkeys(CLASSES, 0)
    for series in _series(snapshot, name):
        cls = series["labels"][-1]
        out[cls] = out.get(cls, 0) + int(series["value"])
    return out


def _engines(snapshot: Snapshot) -> list[EngineStatus]:
    """One entry per `kv_num_blocks` series: engine families share its base labels."""
    usage = {tuple(s["labels"]): s["value"] for s in _series(snapshot, "kv_cache_usage_perc")}
    load: dict[tuple[str, ...], list[int]] = {}
    for index, name in enumerate(("num_requests_running", "num_requests_waiting")):
        for series in _series(snapshot, name):
            key = tuple(series["labels"][:-1])  # without the class
            load.setdefault(key, [0, 0])[index] += int(series["value"])
    engines = []
    for series in _series(snapshot, "kv_num_blocks"):
        key = tuple(series["labels"])
        running, waiting = load.get(key, [0, 0])
        engines.append(
            EngineStatus(
                name=key[-1],  # the replica, or the model in bare mode
                running=running,
                waiting=waiting,
                kv_usage=float(usage.get(key, 0.0)),
                kv_blocks=int(series["value"]),
            )
        )
    return sorted(engines, key=lambda e: e.name)


def _ttft_counts(family: dict[str, Any] | None) -> Counts:
    """TTFT bucket counts summed by class (labels: model, class, feature, prompt_version)."""
    counts: Counts = {}
    if family is None:
        return counts
    position = family["labels"].index("class")
    for series in family["series"]:
        cls = series["labels"][position]
        current = counts.get(cls)
        if current is None:
            counts[cls] = list(series["counts"])
        else:
            counts[cls] = [a + b for a, b in zip(current, series["counts"], strict=True)]
    return counts
