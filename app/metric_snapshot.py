"""Metric snapshots: plain data that crosses processes, merges, and renders as Prometheus text.

A snapshot maps a family name to

    {"type": "counter" | "gauge" | "histogram", "help": str, "labels": [label names],
     "buckets": [upper bounds] (histograms only),
     "series": [{"labels": [values], "value": float}                        # counter, gauge
                | {"labels": [values], "counts": [per bucket, +Inf last], "sum": float}]}

Counter family names carry no `_total` (the text format adds it). Merging sums series with
equal label values, gauges included: a gauge that must not be summed across processes (KV
usage of each replica) needs a label that tells the processes apart (e.g. `replica`).

`engine_snapshot` turns an `EngineClient.stats()` dict into a snapshot. Recognized keys (a
trailing `_total` is ignored) are those of `ENGINE_METRICS`; a value is a number, a mapping
{label value: number} (labelled by the table's label, e.g. per request class), or a list of
numbers (labelled by position). Other keys and shapes are skipped.
"""

from __future__ import annotations

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

logger = logging.getLogger("firstlight.metrics")

Snapshot = dict[str, dict[str, Any]]
PREFIX = "firstlight_"

# stats key → (type, help, label for mapping/list values)
ENGINE_METRICS: dict[str, tuple[str, str, str]] = {
    "num_requests_running": ("gauge", "Requests in the engine's running batch.", "class"),
    "num_requests_waiting": ("gauge", "Requests waiting to be scheduled.", "class"),
    "kv_cache_usage_perc": ("gauge", "Fraction of KV cache blocks in use (1 = full).", "kind"),
    "prefix_cache_queries": ("counter", "Prompt tokens looked up in the prefix cache.", "kind"),
    "prefix_cache_hits": ("counter", "Prompt tokens found in the prefix cache.", "kind"),
    "kv_num_blocks": ("gauge", "KV cache blocks in the pool.", "kind"),
    "kv_num_free_blocks": ("gauge", "KV cache blocks free.", "kind"),
    "num_preemptions": ("counter", "Requests preempted for KV space (recomputed).", "class"),
    "num_aborted": ("counter", "Requests aborted in the engine (client left, deadline).", "kind"),
    "num_reader_stalls": ("counter", "Streams cut because the reader stalled.", "kind"),
    "spec_decode_num_drafts": ("counter", "Speculative decoding draft proposals.", "kind"),
    "spec_decode_num_draft_tokens": ("counter", "Draft tokens proposed.", "kind"),
    "spec_decode_num_accepted_tokens": ("counter", "Draft tokens accepted.", "kind"),
    "spec_decode_num_accepted_tokens_per_pos": (
        "counter",
        "Draft tokens accepted at each draft position.",
        "position",
    ),
}


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


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def engine_snapshot(stats: Mapping[str, Any], labels: Mapping[str, str]) -> Snapshot:
    """The recognized entries of one engine's `stats()` as a snapshot with base `labels`."""
    snapshot: Snapshot = {}
    base_names, base_values = list(labels), list(labels.values())
    for key, value in stats.items():
        spec = ENGINE_METRICS.get(key.removesuffix("_total"))
        if spec is None:
            continue
        kind, doc, extra = spec
        if _is_number(value):
            names, series = base_names, [(base_values, float(value))]
        elif isinstance(value, Mapping) and all(_is_number(v) for v in value.values()):
            names = [*base_names, extra]
            series = [([*base_values, str(k)], float(v)) for k, v in value.items()]
        elif isinstance(value, list | tuple) and all(_is_number(v) for v in value):
            names = [*base_names, extra]
            series = [([*base_values, str(i)], float(v)) for i, v in enumerate(value)]
        else:
            continue
        snapshot[PREFIX + key.removesuffix("_total")] = {
            "type": kind,
            "help": doc,
            "labels": names,
            "series": [{"labels": values, "value": v} for values, v in series],
        }
    return snapshot
