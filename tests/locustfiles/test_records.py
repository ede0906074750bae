"""`StreamRecord`: the client's TTFT, ITL and TPOT, and its JSON line."""

from __future__ import annotations

import pytest

from locustfiles.records import StreamRecord
from tests.locustfiles.helpers import START, make_record


def test_latencies_from_chunk_arrivals() -> None:
    record = make_record(ttft_ms=30, gaps_ms=(10, 20, 30))
    assert record.ttft_ms == 30
    assert record.itl_ms() == [10, 20, 30]
    assert record.tpot_ms == pytest.approx(60 / 3)
    assert record.end == pytest.approx(START + (30 + 60 + 1) / 1000)


def test_tpot_divides_by_tokens_when_a_chunk_carries_several() -> None:
    # 4 chunks but 7 tokens (speculative decoding can send several per chunk)
    assert make_record(ttft_ms=10, gaps_ms=(6, 6, 6), tokens=7).tpot_ms == pytest.approx(3.0)


def test_no_chunk_no_latencies() -> None:
    record = make_record(ttft_ms=-1, outcome="error", error="HTTP 429")
    assert record.ttft_ms is None and record.tpot_ms is None and record.itl_ms() == []
    assert make_record(gaps_ms=()).tpot_ms is None  # one chunk: no TPOT


def test_json_line_round_trip() -> None:
    record = make_record(tier="flex", tokens=4, outcome="dropped")
    line = record.to_json()
    assert "\n" not in line
    assert StreamRecord.from_json(line) == record
