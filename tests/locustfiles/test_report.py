"""The report page and the printed summary, from a synthetic run."""

from __future__ import annotations

import re
from pathlib import Path

from locustfiles.analysis import RunInputs, analyze
from locustfiles.report import render_html, summary_lines
from locustfiles.settings import LoadSettings
from tests.locustfiles.helpers import START, make_record, scrape, status

STATS_CSV = """Type,Name,Request Count,Failure Count,Median Response Time,Average Response Time,\
Min Response Time,Max Response Time,Average Content Size,Requests/s,Failures/s,50%,66%,75%,80%,\
90%,95%,98%,99%,99.9%,99.99%,100%
SSE,ttft[interactive],2,0,20,21.5,20,23,0,0.2,0,20,23,23,23,23,23,23,23,23,23,23
"""


def summary():
    records = [
        make_record(at=1, ttft_ms=20),
        make_record(at=2, ttft_ms=23, tokens=4),
        make_record(at=3, ttft_ms=8, outcome="dropped", user="DropUser"),
        make_record(at=4, ttft_ms=400, gaps_ms=(30,) * 20, tier="flex", user="FlexUser"),
    ]
    inputs = RunInputs(
        records=records,
        start=START,
        end=START + 10,
        slos=LoadSettings().slos(),
        users=[(START + t, n) for t, n in ((0, 4), (5, 8))],
        status_samples=[(START + t, status(1 + t // 5)) for t in range(10)],
        metrics_before=scrape({}),
        metrics_after=scrape({"interactive": [0.019, 0.022], "bulk": [0.39]}, cancelled=1),
    )
    return analyze(inputs)


def test_page_is_self_contained_with_per_class_tables_and_plots(tmp_path: Path) -> None:
    stats = tmp_path / "locust_stats.csv"
    stats.write_text(STATS_CSV)
    page = render_html(summary(), title="load", settings={"steps": "4,8"}, stats_csv=stats)
    assert page.count("<svg") == 6  # TTFT per class, ITL, goodput, users + replicas, queues
    assert "<script" not in page and "<link" not in page
    urls = set(re.findall(r"https?://[^\s\"'<]+", page)) - {"http://www.w3.org/2000/svg"}
    assert urls == set()  # nothing fetched from anywhere
    for text in ("interactive", "flex", "TTFT p50", "goodput/s", "ttft[interactive]", "4,8"):
        assert text in page
    assert "SLO 250 ms" in page  # the interactive SLO is drawn on its TTFT plot


def test_printed_summary_has_per_class_lines_and_client_vs_server_ttft() -> None:
    lines = summary_lines(summary())
    assert lines[0].lstrip().startswith("interactive sent 3, completed 2, dropped 1, errors 0")
    assert lines[1].lstrip().startswith("flex")
    ttft = next(line for line in lines if "TTFT interactive" in line)
    assert "client p50 21.5 / mean 21.5 ms; server p50" in ttft
    assert "/ mean 20.5 ms; client - server mean +1.0 ms (2 / 2 requests)" in ttft
    assert "  replicas: up to 2" in lines
    assert "  dropped by the client: 1; cancelled on the server: 1" in lines
    errors = make_record(at=5, ttft_ms=-1, outcome="error", error="HTTP 404")
    inputs = RunInputs(records=[errors], start=START, end=START + 1, slos=LoadSettings().slos())
    assert "  note: errors seen: HTTP 404" in summary_lines(analyze(inputs))
