"""Request metrics of the HTTP layer (`firstlight_*`, named after vLLM's), plus engine stats.

One `Metrics` object per app, passed around (no global registry). Latencies a client sees are
measured here: TTFT = request arrival → first token chunk written (streamed) or received
(non-streamed); ITL = gaps between token chunks; TPOT = (last − first chunk) / (tokens − 1)
of the longest choice. Queue, prefill and decode times are the engine's own (`Timings`).

Labels: model, class, feature, prompt_version. Tag values are bounded: the first
`max_label_values` distinct values of a label are kept, later ones become "other", and a
missing tag is "none", so a client cannot grow the series count without limit.

Engine gauges and counters are not stored: `engine_stats` is called at snapshot time and its
typed `EngineStats` are converted by `metric_snapshot.engine_snapshot`. `snapshot()` is plain
data; in Ray Serve mode each process snapshots, and one scrape renders
`render(*other_snapshots)`.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from app.metric_snapshot import (
    PREFIX,
    Snapshot,
    SnapshotCollector,
    engine_snapshot,
    merge_snapshots,
    render_snapshot,
)
from engine.stats import EngineStats

logger = logging.getLogger("firstlight.metrics")

CONTENT_TYPE = CONTENT_TYPE_LATEST
LABELS = ("model", "class", "feature", "prompt_version")
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
    0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
RequestLabels = tuple[str, str, str, str]  # values of LABELS
# () → [(base labels, stats)], e.g. [({"model": "demo"}, engine.stats())]
EngineStatsSource = Callable[[], Iterable[tuple[Mapping[str, str], EngineStats]]]

HISTOGRAMS = {
    "time_to_first_token_seconds": (
        "Time from request arrival to the first token chunk (not streamed: the first token)."
    ),
    "inter_token_latency_seconds": "Gap between consecutive token chunks of a stream.",
    "request_time_per_output_token_seconds": "Mean time per output token after the first.",
    "e2e_request_latency_seconds": "Time from request arrival to the last byte.",
    "request_queue_time_seconds": "Time the request waited in the engine queue.",
    "request_prefill_time_seconds": "Time from first scheduling to the first token (engine).",
    "request_decode_time_seconds": "Time from the first token to the last (engine).",
}
ENGINE_TIMINGS = {
    "queue_s": "request_queue_time_seconds",
    "prefill_s": "request_prefill_time_seconds",
    "decode_s": "request_decode_time_seconds",
}
COUNTERS = {  # name → (help, extra label)
    "request_success": ("Finished requests (one per choice) by finish reason.", "finish_reason"),
    "request_cancelled": ("Requests whose client left before the end.", None),
    "request_error": ("Requests answered with an error after validation, by code.", "code"),
    "prompt_tokens": ("Prompt tokens of finished requests.", None),
    "generation_tokens": ("Generated tokens of finished requests.", None),
}


@dataclass(slots=True)
class BoundedValues:
    """The first `limit` distinct values pass; later ones read "other"; None reads "none"."""

    limit: int
    seen: set[str] = field(default_factory=set)

    def __call__(self, value: str | None) -> str:
        if value is None:
            return "none"
        value = value[:64]
        if value in self.seen:
            return value
        if len(self.seen) < self.limit:
            self.seen.add(value)
            return value
        return "other"


@dataclass(slots=True)
class _Family:
    kind: str
    help: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...] = ()
    series: dict[tuple[str, ...], list[float]] = field(default_factory=dict)

    def add(self, key: tuple[str, ...], value: float) -> None:
        values = self.series.get(key)
        if self.kind == "histogram":
            if values is None:
                values = self.series[key] = [0.0] * (len(self.buckets) + 2)  # counts + sum
            values[bisect.bisect_left(self.buckets, value)] += 1
            values[-1] += value
        elif values is None:
            self.series[key] = [value]
        else:
            values[0] += value

    def snapshot(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.kind, "help": self.help, "labels": list(self.labels)}
        if self.kind == "histogram":
            out["buckets"] = list(self.buckets)
            out["series"] = [
                {"labels": list(k), "counts": v[:-1], "sum": v[-1]} for k, v in self.series.items()
            ]
        else:
            out["series"] = [{"labels": list(k), "value": v[0]} for k, v in self.series.items()]
        return out


class Metrics:
    def __init__(
        self, *, max_label_values: int = 32, engine_stats: EngineStatsSource | None = None
    ) -> None:
        self.engine_stats = engine_stats
        self._feature = BoundedValues(max_label_values)
        self._prompt_version = BoundedValues(max_label_values)
        self._families: dict[str, _Family] = {
            name: _Family("histogram", doc, LABELS, LATENCY_BUCKETS)
            for name, doc in HISTOGRAMS.items()
        }
        for name, (doc, extra) in COUNTERS.items():
            self._families[name] = _Family("counter", doc, LABELS + ((extra,) if extra else ()))
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(SnapshotCollector(self.snapshot))

    def labels(self, model: str, request_class: str, tags: Mapping[str, str]) -> RequestLabels:
        return (
            model,
            request_class,
            self._feature(tags.get("feature")),
            self._prompt_version(tags.get("prompt_version")),
        )

    def record_request(
        self,
        labels: RequestLabels,
        *,
        ttft_s: float | None,
        itl_s: Sequence[float],
        tpot_s: float | None,
        e2e_s: float,
        engine_timings: Mapping[str, float | None],
        finish_reasons: Iterable[str | None],
        prompt_tokens: int,
        generation_tokens: int,
    ) -> None:
        """One request that ran to its end (all choices finished)."""
        families = self._families
        if ttft_s is not None:
            families["time_to_first_token_seconds"].add(labels, ttft_s)
        itl = families["inter_token_latency_seconds"]
        for gap in itl_s:
            itl.add(labels, gap)
        if tpot_s is not None:
            families["request_time_per_output_token_seconds"].add(labels, tpot_s)
        families["e2e_request_latency_seconds"].add(labels, e2e_s)
        for key, name in ENGINE_TIMINGS.items():
            value = engine_timings.get(key)
            if value is not None:
                families[name].add(labels, value)
        for reason in finish_reasons:
            families["request_success"].add((*labels, reason or "unknown"), 1)
        families["prompt_tokens"].add(labels, prompt_tokens)
        families["generation_tokens"].add(labels, generation_tokens)

    def record_cancelled(self, labels: RequestLabels) -> None:
        self._families["request_cancelled"].add(labels, 1)

    def record_error(self, labels: RequestLabels, code: str) -> None:
        self._families["request_error"].add((*labels, code), 1)

    def snapshot(self) -> Snapshot:
        """This process's request metrics plus the engine stats, as plain data."""
        snapshot = {PREFIX + name: f.snapshot() for name, f in self._families.items()}
        if self.engine_stats is None:
            return snapshot
        try:
            engines = [engine_snapshot(stats, base) for base, stats in self.engine_stats()]
        except Exception:  # a broken stats source must not break the scrape
            logger.exception("engine stats unavailable")
            return snapshot
        return merge_snapshots(snapshot, *engines)

    def render(self, *others: Snapshot) -> bytes:
        """Prometheus text of this process merged with `others` (e.g. other replicas)."""
        if not others:
            return generate_latest(self.registry)
        return render_snapshot(merge_snapshots(self.snapshot(), *others))
