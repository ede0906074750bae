"""`analyze`: per-class latencies, goodput against SLOs, time bins, and the server's TTFT
histogram over the run beside the client's."""

from __future__ import annotations

import pytest

from locustfiles.analysis import (
    Histogram,
    RunInputs,
    analyze,
    counter_total,
    default_window,
    parse_histograms,
    percentile,
)
from locustfiles.settings import SLO
from tests.locustfiles.helpers import START, make_record, scrape, status

SLOS = {"interactive": SLO(ttft_ms=100, tpot_ms=10), "flex": SLO(ttft_ms=1000, tpot_ms=50)}


def run_of(records, duration_s: float = 10.0, **kw) -> RunInputs:
    return RunInputs(records=records, start=START, end=START + duration_s, slos=SLOS, **kw)


def test_percentile_interpolates_between_ranks() -> None:
    assert percentile([], 0.5) is None
    assert percentile([7.0], 0.99) == 7.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 0.5) == pytest.approx(2.5)
    assert percentile(list(range(101)), 0.99) == pytest.approx(99)


def test_goodput_counts_completed_requests_within_both_slos() -> None:
    records = [
        make_record(at=1, ttft_ms=50, gaps_ms=(5, 5)),  # within both
        make_record(at=2, ttft_ms=150, gaps_ms=(5, 5)),  # TTFT over
        make_record(at=3, ttft_ms=50, gaps_ms=(20, 20)),  # TPOT over
        make_record(at=4, ttft_ms=30, gaps_ms=(5,), outcome="dropped"),  # neither
        make_record(at=5, ttft_ms=-1, outcome="error", error="HTTP 429"),
        make_record(at=6, ttft_ms=900, gaps_ms=(40,), tier="flex"),  # flex: within
    ]
    summary = analyze(run_of(records))
    interactive, flex = summary.classes["interactive"], summary.classes["flex"]
    assert (interactive.sent, interactive.ok, interactive.dropped, interactive.errors) == (
        5, 3, 1, 1,
    )  # fmt: skip
    assert interactive.met_slo == 1
    assert interactive.goodput_rps == pytest.approx(0.1)
    assert interactive.throughput_rps == pytest.approx(0.3)
    assert interactive.ttft.count == 4  # the dropped stream's first chunk counts
    assert interactive.tpot.count == 3  # only completed requests have a TPOT
    assert (flex.ok, flex.met_slo) == (1, 1)
    assert summary.notes == ["no /status sample answered: no replica or queue figures",
                             "no /metrics scrape: no server-side TTFT",
                             "errors seen: HTTP 429"]  # fmt: skip


def test_series_put_samples_in_the_bin_they_happened_in() -> None:
    records = [
        make_record(at=0.5, ttft_ms=10, gaps_ms=(1000,)),  # first chunk in bin 0, gap in bin 1
        make_record(at=1.2, ttft_ms=30, gaps_ms=()),
        make_record(at=3.5, ttft_ms=500, gaps_ms=()),
    ]
    series = analyze(run_of(records, duration_s=4.0, window_s=1.0)).series["interactive"]
    assert [x for x, _ in series.ttft_p50] == [0.5, 1.5, 2.5, 3.5]
    assert [y for _, y in series.ttft_p50] == [10, 30, None, 500]
    assert [y for _, y in series.itl_p50] == [None, 1000, None, None]
    assert [y for _, y in series.throughput] == [0, 2, 0, 1]  # by the time they ended
    assert [y for _, y in series.goodput] == [0, 1, 0, 0]  # the first one's gap breaks TPOT
    assert [y for _, y in analyze(run_of([])).series["flex"].goodput] == [0] * 10


def test_default_window_gives_about_twenty_bins() -> None:
    assert default_window(75) == 4
    assert default_window(15) == 1
    assert default_window(3) == 1


def test_histograms_parse_from_what_metrics_renders() -> None:
    text = scrape({"interactive": [0.004, 0.012, 0.013, 0.03], "bulk": [0.2]})
    histograms = parse_histograms(text, "firstlight_time_to_first_token_seconds")
    interactive = histograms["interactive"]
    assert interactive.count == 4
    assert interactive.mean() == pytest.approx((0.004 + 0.012 + 0.013 + 0.03) / 4)
    assert 0.01 < interactive.quantile(0.5) <= 0.015  # both middle values are in (0.01, 0.015]
    assert histograms["bulk"].count == 1
    assert counter_total(scrape({}, cancelled=3), "firstlight_request_cancelled") == 3


def test_histogram_minus_keeps_only_what_the_run_added() -> None:
    before = Histogram((0.01, 0.1), (1, 2, 0), 0.2)
    after = Histogram((0.01, 0.1), (1, 5, 1), 1.5)
    during = after.minus(before)
    assert during.counts == (0, 3, 1) and during.count == 4
    assert during.mean() == pytest.approx(1.3 / 4)
    assert Histogram((0.01,), (0, 0), 0.0).mean() is None


def test_server_ttft_over_the_run_beside_the_clients_completed_requests() -> None:
    before = scrape({"interactive": [1.0, 1.0]}, cancelled=1)  # traffic before the run
    after = scrape({"interactive": [1.0, 1.0, 0.021, 0.023], "bulk": [0.05]}, cancelled=3)
    records = [
        make_record(at=1, ttft_ms=22),
        make_record(at=2, ttft_ms=24),
        make_record(at=3, ttft_ms=5, outcome="dropped"),  # the server has no TTFT for it
        make_record(at=4, ttft_ms=51, tier="flex"),
    ]
    summary = analyze(run_of(records, metrics_before=before, metrics_after=after))
    interactive = summary.classes["interactive"].server
    assert interactive is not None
    assert interactive.requests == 2 and interactive.client_requests == 2
    assert interactive.mean_ms == pytest.approx(22.0)
    assert interactive.client_mean_ms == pytest.approx(23.0)
    assert 20 < interactive.p50_ms <= 25  # its bucket
    flex = summary.classes["flex"].server
    assert flex is not None and flex.requests == 1 and flex.mean_ms == pytest.approx(50.0)
    assert summary.server_cancelled == 2


def test_replicas_and_queues_from_status_samples() -> None:
    samples = [
        (START - 1, status(1)),
        (START + 2, status(2, running=3, waiting=1)),
        (START + 4, status(1)),
    ]
    summary = analyze(run_of([make_record()], status_samples=samples, users=[(START, 4)]))
    assert summary.server.replicas == [(-1, 1), (2, 2), (4, 1)]
    assert summary.max_replicas == 2
    assert summary.server.running["interactive"] == [(-1, 0), (2, 3), (4, 0)]
    assert summary.server.waiting["interactive"][1] == (2, 1)
    assert summary.users == [(0, 4)]
