"""What a load run measured, from its raw inputs: plain data in, plain data out (no I/O).

Inputs: the client's `StreamRecord`s, Locust's user count over time, the server's `/status`
samples taken during the run, and two `/metrics` scrapes (before and after). `analyze`
turns them into a `LoadSummary`:

* per class (the client's tier: interactive, flex): requests by outcome, TTFT / ITL / TPOT
  percentiles, throughput and goodput (completed requests per second that met both of the
  class's SLOs; dropped streams count in neither);
* the same over time, in bins of `window_s`: a TTFT sample belongs to the bin of its first
  chunk, an ITL sample to the bin of the chunk that ends the gap, a completed request to the
  bin it ended in;
* the server's TTFT histogram over the run (the `after − before` bucket counts, per class),
  its p50 (interpolated inside a bucket, as Prometheus does) and its exact mean (sum /
  count), beside the client's p50 and mean over the same requests (completed ones: the
  server records TTFT only for requests that ran to their end);
* replicas (engines reporting in `/status`), running and waiting requests over time.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from app.service_status import histogram_quantile
from locustfiles.records import StreamRecord
from locustfiles.settings import CLASSES, SERVER_CLASS, SLO

TTFT_FAMILY = "firstlight_time_to_first_token_seconds"
CANCELLED_FAMILY = "firstlight_request_cancelled"
Point = tuple[float, float | None]  # (seconds into the run, value; None: nothing measured)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The `q` quantile (0..1) of `values`, interpolated between closest ranks; None if
    empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = q * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True, slots=True)
class Histogram:
    """Prometheus histogram counts: `counts` per bucket (not cumulative), +Inf last."""

    bounds: tuple[float, ...]  # finite upper bounds, ascending
    counts: tuple[float, ...]
    total: float  # the sum of the observed values

    @property
    def count(self) -> float:
        return sum(self.counts)

    def minus(self, before: Histogram | None) -> Histogram:
        """What was observed since `before` (same buckets)."""
        if before is None:
            return self
        counts = tuple(a - b for a, b in zip(self.counts, before.counts, strict=True))
        return Histogram(self.bounds, counts, self.total - before.total)

    def quantile(self, q: float) -> float | None:
        return histogram_quantile(q, self.bounds, self.counts)

    def mean(self) -> float | None:
        return self.total / self.count if self.count > 0 else None


def parse_histograms(text: str, family: str, by: str = "class") -> dict[str, Histogram]:
    """Histogram `family` of a Prometheus text scrape, its series summed by label `by`."""
    cumulative: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))
    totals: dict[str, float] = defaultdict(float)
    for metric in text_string_to_metric_families(text):
        if metric.name != family:
            continue
        for sample in metric.samples:
            key = sample.labels.get(by, "")
            if sample.name == family + "_bucket":
                cumulative[key][float(sample.labels["le"])] += sample.value
            elif sample.name == family + "_sum":
                totals[key] += sample.value
    out = {}
    for key, buckets in cumulative.items():
        bounds = sorted(buckets)
        running = [buckets[b] for b in bounds]
        counts = [b - a for a, b in zip([0.0, *running], running, strict=False)]
        finite = tuple(b for b in bounds if math.isfinite(b))
        out[key] = Histogram(finite, tuple(counts), totals[key])
    return out


def counter_total(text: str, family: str) -> float:
    """The sum of counter `family`'s series in a Prometheus text scrape (0 if absent)."""
    return sum(
        sample.value
        for metric in text_string_to_metric_families(text)
        if metric.name == family
        for sample in metric.samples
        if sample.name == family + "_total"
    )


@dataclass(frozen=True, slots=True)
class Latency:
    """Percentiles of one latency, in ms (None: no samples)."""

    count: int
    p50: float | None
    p90: float | None
    p99: float | None
    mean: float | None

    @classmethod
    def of(cls, values: Sequence[float]) -> Latency:
        mean = sum(values) / len(values) if values else None
        return cls(
            len(values), percentile(values, 0.5), percentile(values, 0.9),
            percentile(values, 0.99), mean,
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class ServerTTFT:
    """The server's TTFT histogram over the run, beside the client's completed requests."""

    requests: int  # observations the server added during the run
    p50_ms: float | None  # interpolated within a bucket
    mean_ms: float | None  # exact: sum / count
    client_requests: int
    client_p50_ms: float | None
    client_mean_ms: float | None


@dataclass(frozen=True, slots=True)
class ClassSummary:
    tier: str
    slo: SLO
    sent: int
    ok: int
    dropped: int
    errors: int
    met_slo: int  # completed requests within both SLOs
    throughput_rps: float  # completed requests per second over the run
    goodput_rps: float  # of those, the ones within both SLOs
    ttft: Latency
    itl: Latency
    tpot: Latency
    server: ServerTTFT | None  # None: no /metrics scrapes


@dataclass(frozen=True, slots=True)
class ClassSeries:
    """One class over time; each list has one point per bin (x = the bin's middle)."""

    ttft_p50: list[Point]
    ttft_p95: list[Point]
    itl_p50: list[Point]
    itl_p99: list[Point]
    throughput: list[Point]  # completed requests / s
    goodput: list[Point]  # of those, within both SLOs


@dataclass(frozen=True, slots=True)
class ServerSeries:
    """From `/status` samples (x = seconds into the run)."""

    replicas: list[Point]
    running: dict[str, list[Point]]  # by server class
    waiting: dict[str, list[Point]]
    kv_usage: list[Point]


@dataclass(frozen=True, slots=True)
class LoadSummary:
    start: float  # wall-clock seconds
    duration_s: float
    window_s: float
    classes: dict[str, ClassSummary]
    series: dict[str, ClassSeries]
    users: list[Point]
    server: ServerSeries
    max_replicas: int | None  # None: no /status sample answered
    server_cancelled: float | None  # cancelled requests the server counted during the run
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class RunInputs:
    records: list[StreamRecord]
    start: float  # wall-clock seconds the run began
    end: float
    slos: Mapping[str, SLO]
    users: list[tuple[float, int]] = field(default_factory=list)  # (wall time, users)
    status_samples: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    metrics_before: str | None = None
    metrics_after: str | None = None
    window_s: float = 0.0  # 0: about 20 bins over the run


def default_window(duration_s: float) -> float:
    """About 20 bins over the run, at least 1 s each, in whole seconds."""
    return float(max(1, round(duration_s / 20)))


def analyze(inputs: RunInputs) -> LoadSummary:
    duration = max(inputs.end - inputs.start, 1e-9)
    window = inputs.window_s or default_window(duration)
    bins = max(1, math.ceil(duration / window))
    by_tier: dict[str, list[StreamRecord]] = {tier: [] for tier in CLASSES}
    for record in inputs.records:
        by_tier.setdefault(record.tier, []).append(record)
    server = _server_ttft(inputs)
    classes, series = {}, {}
    for tier, records in by_tier.items():
        slo = inputs.slos.get(tier) or SLO(math.inf, math.inf)
        classes[tier] = _class_summary(tier, records, slo, duration, server.get(tier))
        series[tier] = _class_series(records, slo, inputs.start, window, bins)
    status = _server_series(inputs.status_samples, inputs.start)
    replicas = [int(y) for _, y in status.replicas if y is not None]
    return LoadSummary(
        start=inputs.start,
        duration_s=duration,
        window_s=window,
        classes=classes,
        series=series,
        users=[(t - inputs.start, float(n)) for t, n in inputs.users],
        server=status,
        max_replicas=max(replicas) if replicas else None,
        server_cancelled=_cancelled(inputs),
        notes=_notes(inputs),
    )


def _class_summary(
    tier: str,
    records: list[StreamRecord],
    slo: SLO,
    duration: float,
    server: Histogram | None,
) -> ClassSummary:
    ok = [r for r in records if r.outcome == "ok"]
    met = [r for r in ok if slo.met(r.ttft_ms, r.tpot_ms)]
    ttfts = [r.ttft_ms for r in records if r.ttft_ms is not None]
    completed_ttfts = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    server_ttft = None
    if server is not None:
        p50, mean = server.quantile(0.5), server.mean()
        server_ttft = ServerTTFT(
            requests=int(server.count),
            p50_ms=None if p50 is None else p50 * 1000,
            mean_ms=None if mean is None else mean * 1000,
            client_requests=len(completed_ttfts),
            client_p50_ms=percentile(completed_ttfts, 0.5),
            client_mean_ms=Latency.of(completed_ttfts).mean,
        )
    return ClassSummary(
        tier=tier,
        slo=slo,
        sent=len(records),
        ok=len(ok),
        dropped=sum(r.outcome == "dropped" for r in records),
        errors=sum(r.outcome == "error" for r in records),
        met_slo=len(met),
        throughput_rps=len(ok) / duration,
        goodput_rps=len(met) / duration,
        ttft=Latency.of(ttfts),
        itl=Latency.of([gap for r in records for gap in r.itl_ms()]),
        tpot=Latency.of([r.tpot_ms for r in ok if r.tpot_ms is not None]),
        server=server_ttft,
    )


def _class_series(
    records: list[StreamRecord], slo: SLO, start: float, window: float, bins: int
) -> ClassSeries:
    def index(t: float) -> int:
        return min(max(int((t - start) // window), 0), bins - 1)

    ttft: list[list[float]] = [[] for _ in range(bins)]
    itl: list[list[float]] = [[] for _ in range(bins)]
    done, good = [0] * bins, [0] * bins
    for r in records:
        if r.ttft_ms is not None:
            ttft[index(r.start + r.ttft_ms / 1000)].append(r.ttft_ms)
        for at, gap in zip(r.chunks_ms[1:], r.itl_ms(), strict=True):
            itl[index(r.start + at / 1000)].append(gap)
        if r.outcome == "ok":
            done[index(r.end)] += 1
            good[index(r.end)] += slo.met(r.ttft_ms, r.tpot_ms)
    middles = [(i + 0.5) * window for i in range(bins)]

    def each(values: Iterable[float | None]) -> list[Point]:
        return list(zip(middles, values, strict=True))

    return ClassSeries(
        ttft_p50=each(percentile(v, 0.5) for v in ttft),
        ttft_p95=each(percentile(v, 0.95) for v in ttft),
        itl_p50=each(percentile(v, 0.5) for v in itl),
        itl_p99=each(percentile(v, 0.99) for v in itl),
        throughput=each(n / window for n in done),
        goodput=each(n / window for n in good),
    )


def _server_series(samples: list[tuple[float, dict[str, Any]]], start: float) -> ServerSeries:
    replicas: list[Point] = []
    kv: list[Point] = []
    running: dict[str, list[Point]] = defaultdict(list)
    waiting: dict[str, list[Point]] = defaultdict(list)
    for t, status in samples:
        x = t - start
        replicas.append((x, float(len(status.get("engines", ())))))
        kv.append((x, status.get("kv_usage")))
        for cls, n in status.get("running", {}).items():
            running[cls].append((x, float(n)))
        for cls, n in status.get("waiting", {}).items():
            waiting[cls].append((x, float(n)))
    return ServerSeries(replicas, dict(running), dict(waiting), kv)


def _server_ttft(inputs: RunInputs) -> dict[str, Histogram]:
    """The server's TTFT histogram per client tier over the run (empty without scrapes)."""
    if inputs.metrics_after is None:
        return {}
    after = parse_histograms(inputs.metrics_after, TTFT_FAMILY)
    before = parse_histograms(inputs.metrics_before or "", TTFT_FAMILY)
    out = {}
    for tier, server_class in SERVER_CLASS.items():
        if server_class in after:
            out[tier] = after[server_class].minus(before.get(server_class))
    return out


def _cancelled(inputs: RunInputs) -> float | None:
    if inputs.metrics_after is None:
        return None
    before = counter_total(inputs.metrics_before or "", CANCELLED_FAMILY)
    return counter_total(inputs.metrics_after, CANCELLED_FAMILY) - before


def _notes(inputs: RunInputs) -> list[str]:
    notes = []
    if not inputs.status_samples:
        notes.append("no /status sample answered: no replica or queue figures")
    if inputs.metrics_after is None:
        notes.append("no /metrics scrape: no server-side TTFT")
    errors = sorted({r.error for r in inputs.records if r.outcome == "error"})
    if errors:
        notes.append("errors seen: " + "; ".join(errors[:5]))
    return notes
