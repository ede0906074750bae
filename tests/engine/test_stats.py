"""Typed engine stats: class counts and summing replicas into one engine view."""

from __future__ import annotations

import pytest

from engine.request import RequestClass
from engine.stats import AdmissionStats, ClassCounts, EngineStats, KVStats, sum_engine_stats


def engine(usage: float, blocks: int, rate: float | None, waiting: ClassCounts) -> EngineStats:
    return EngineStats(
        model="demo",
        running=ClassCounts(interactive=1),
        waiting=waiting,
        kv=KVStats(blocks, blocks // 2, usage, prefix_cache_queries=10, prefix_cache_hits=4),
        admission=AdmissionStats(8, 2, rate),
        num_preemptions=1,
        generation_tokens=100,
    )


def test_class_counts_read_scheduler_maps_and_label_in_a_fixed_order():
    counts = ClassCounts.from_mapping({"bulk": 3})
    assert counts == ClassCounts(interactive=0, bulk=3)
    assert counts.plus(RequestClass.INTERACTIVE, 2).of(RequestClass.INTERACTIVE) == 2
    assert list((counts + ClassCounts(1, 1)).items()) == [("interactive", 1), ("bulk", 4)]
    assert (counts + ClassCounts(1, 1)).total == 5


def test_sum_of_replicas_adds_counts_and_weights_kv_usage_by_blocks():
    total = sum_engine_stats(
        "demo",
        [
            engine(0.5, 100, 2.0, ClassCounts(bulk=3)),
            engine(0.0, 300, None, ClassCounts(interactive=1)),
        ],
    )
    assert total.waiting == ClassCounts(interactive=1, bulk=3)
    assert total.running.total == 2
    assert total.kv.num_blocks == 400 and total.kv.num_free_blocks == 200
    assert total.kv.usage == pytest.approx(50 / 400)
    assert total.kv.prefix_cache_hits == 8
    assert total.admission == AdmissionStats(16, 4, 2.0)  # an unknown rate adds nothing
    assert (total.num_preemptions, total.generation_tokens) == (2, 200)
    empty = sum_engine_stats("demo", [])
    assert empty.kv.usage == 0.0 and empty.admission.drain_rate_per_s is None
