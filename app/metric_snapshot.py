"""Metric snapshots: plain data that crosses processes, merges, and renders as Prometheus text.

A snapshot maps a family name to

    {"type": "counter" | "gauge" | "histogram", "help": str, "labels": [label names],
     "buckets": [upper bounds] (histograms only),
     "series": [{"labels": [values], "value": float}                        # counter, gauge
                | {"labels": [values], "counts": [per bucket, +Inf last], "sum": float}]}

Counter family names carry no `_total` (the text format adds it). Merging sums series with
equal label values, gauges included: a gauge that must not be summed across processes (KV
usage of each replica) needs a label that tells the processes apart (e.g. `replica`).

`engine_snapshot` turns one engine's typed `EngineStats` into a snapshot: each family below
reads one field, so a renamed field fails the type check instead of rendering 0. Families
exist only for what an engine produces: the `spec_decode_*` families (vLLM's names) only for
an engine that speculates.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from engine.stats import ClassCounts, EngineStats

logger = logging.getLogger("firstlight.metrics")

Snapshot = dict[str, dict[str, Any]]
PREFIX = "firstlight_"


def merge_snapshots(*snapshots: Snapshot) -> Snapshot:
    """One snapshot holding the sums of `snapshots` (inputs are not modified)."""
    merged: Snapshot = {}
    index: dict[str, dict[tuple[str, ...], dict[str, Any]]] = {}
    for snapshot in snapshots:
        for name, family in snapshot.items():
            target = merged.get(name)
            if target is None:
                target = merged[name] = {k: v for k, v in family.items() if k != "series"}
                target["series"] = []
                index[name] = {}
            if target["labels"] != family["labels"] or target.get("buckets") != family.get(
                "buckets"
            ):
                logger.warning("metric %s has different labels or buckets across sources", name)
                continue
            for series in family["series"]:
                _add_series(target, index[name], series)
    return merged


def _add_series(
    family: dict[str, Any], index: dict[tuple[str, ...], dict[str, Any]], series: dict[str, Any]
) -> None:
    key = tuple(series["labels"])
    existing = index.get(key)
    if existing is None:
        copy = {**series, "labels": list(key)}
        if "counts" in copy:
            copy["counts"] = list(copy["counts"])
        index[key] = copy
        family["series"].append(copy)
    elif "counts" in series:
        existing["counts"] = [
            a + b for a, b in zip(existing["counts"], series["counts"], strict=True)
        ]
        existing["sum"] += series["sum"]
    else:
        existing["value"] += series["value"]


def to_metric_families(snapshot: Snapshot) -> Iterable[Metric]:
    """prometheus_client metric families of `snapshot` (cumulative histogram buckets)."""
    for name, family in sorted(snapshot.items()):
        kind, doc, labels = family["type"], family["help"], family["labels"]
        if kind == "histogram":
            bounds = [floatToGoString(b) for b in family["buckets"]] + ["+Inf"]
            hist = HistogramMetricFamily(name, doc, labels=labels)
            for series in family["series"]:
                running, buckets = 0.0, []
                for bound, count in zip(bounds, series["counts"], strict=True):
                    running += count
                    buckets.append((bound, running))
                hist.add_metric(series["labels"], buckets, series["sum"])
            yield hist
        else:
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            metric = cls(name, doc, labels=labels)
            for series in family["series"]:
                metric.add_metric(series["labels"], series["value"])
            yield metric


class SnapshotCollector:
    """A prometheus_client collector that renders `source()` at every scrape."""

    def __init__(self, source: Callable[[], Snapshot]) -> None:
        self.source = source

    def collect(self) -> Iterable[Metric]:
        return to_metric_families(self.source())


def render_snapshot(snapshot: Snapshot) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(lambda: snapshot))
    return generate_latest(registry)


def _family(
    kind: str, doc: str, names: list[str], series: list[tuple[list[str], float]]
) -> dict[str, Any]:
    return {
        "type": kind,
        "help": doc,
        "labels": names,
        "series": [{"labels": values, "value": value} for values, value in series],
    }


def engine_snapshot(stats: EngineStats, labels: Mapping[str, str]) -> Snapshot:
    """One engine's stats as a snapshot whose series all carry the base `labels`."""
    names, values = list(labels), list(labels.values())

    def one(kind: str, doc: str, value: float) -> dict[str, Any]:
        return _family(kind, doc, names, [(values, float(value))])

    def per_class(doc: str, counts: ClassCounts) -> dict[str, Any]:
        series = [([*values, cls], float(n)) for cls, n in counts.items()]
        return _family("gauge", doc, [*names, "class"], series)

    kv = stats.kv
    families = {
        "num_requests_running": per_class("Requests in the engine's running batch.", stats.running),
        "num_requests_waiting": per_class("Requests waiting to be scheduled.", stats.waiting),
        "kv_cache_usage_perc": one(
            "gauge", "Fraction of KV cache blocks in use (1 = full).", kv.usage
        ),
        "kv_num_blocks": one("gauge", "KV cache blocks in the pool.", kv.num_blocks),
        "kv_num_free_blocks": one("gauge", "KV cache blocks free.", kv.num_free_blocks),
        "prefix_cache_queries": one(
            "counter", "Prompt tokens looked up in the prefix cache.", kv.prefix_cache_queries
        ),
        "prefix_cache_hits": one(
            "counter", "Prompt tokens found in the prefix cache.", kv.prefix_cache_hits
        ),
        "num_preemptions": one(
            "counter", "Requests preempted for KV space (recomputed).", stats.num_preemptions
        ),
        "num_interrupted_steps": one(
            "counter",
            "Bulk-only engine steps stopped midway for an arriving interactive request.",
            stats.num_interrupted_steps,
        ),
        "num_aborted": one(
            "counter", "Requests aborted in the engine (client left, deadline).", stats.num_aborted
        ),
        "num_reader_stalls": one(
            "counter", "Streams cut because the reader stalled.", stats.num_reader_stalls
        ),
    }
    spec = stats.spec
    if spec is not None:
        per_pos = [([*values, str(j)], float(n)) for j, n in enumerate(spec.accepted_per_pos)]
        families |= {
            "spec_decode_num_drafts": one(
                "counter", "Sequence-steps that carried speculative drafts.", spec.num_drafts
            ),
            "spec_decode_num_draft_tokens": one(
                "counter", "Speculative draft tokens verified.", spec.num_draft_tokens
            ),
            "spec_decode_num_accepted_tokens": one(
                "counter", "Speculative draft tokens accepted.", spec.num_accepted_tokens
            ),
            "spec_decode_num_accepted_tokens_per_pos": _family(
                "counter",
                "Draft tokens accepted at each position of a run.",
                [*names, "position"],
                per_pos,
            ),
            "spec_decode_propose_seconds": one(
                "counter", "Wall time spent proposing drafts.", spec.propose_seconds
            ),
            "spec_decode_verify_seconds": one(
                "counter", "Wall time of steps that verified drafts.", spec.verify_seconds
            ),
            "spec_decode_proposer_up": one(
                "gauge",
                "Engines whose proposer answers (0: decoding without drafts).",
                spec.proposer_up,
            ),
        }
    return {PREFIX + name: family for name, family in families.items()}


def unlabelled(kind: str, doc: str, value: float) -> dict[str, Any]:
    """A counter or gauge family with one series and no labels."""
    return _family(kind, doc, [], [([], float(value))])


COLD_START_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)


def histogram_snapshot(
    name: str, doc: str, values: Iterable[float], buckets: tuple[float, ...]
) -> Snapshot:
    """One unlabelled histogram family of `values` (counts per bucket, +Inf last)."""
    values = list(values)
    counts = [sum(1 for v in values if v <= bound) for bound in buckets] + [len(values)]
    per_bucket = [counts[0]] + [b - a for a, b in itertools.pairwise(counts)]
    return {
        PREFIX + name: {
            "type": "histogram",
            "help": doc,
            "labels": [],
            "buckets": list(buckets),
            "series": [{"labels": [], "counts": per_bucket, "sum": float(sum(values))}],
        }
    }
