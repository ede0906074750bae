"""A `LoadSummary` as a self-contained HTML page (inline SVG plots, inline CSS, no script,
nothing fetched) and as the few lines `make load` prints at the end.

The page: the per-class table (requests by outcome, TTFT/ITL/TPOT percentiles, throughput,
goodput against the class's SLOs), client vs server TTFT, then the plots over time: TTFT
p50/p95 per class with its SLO, ITL p50/p99, goodput and throughput, users and replicas,
running and waiting requests. Locust's own statistics table (its `_stats.csv`) and the run's
settings follow.
"""

from __future__ import annotations

import csv
import time
from collections.abc import Mapping, Sequence
from html import escape
from pathlib import Path

from locustfiles.analysis import ClassSummary, Latency, LoadSummary
from locustfiles.svg import Series, line_chart

CSS = """
body { font-family: sans-serif; margin: 24px; color: #222; max-width: 1100px; }
table { border-collapse: collapse; margin: 8px 0 20px; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: right; }
th:first-child, td:first-child { text-align: left; }
th { background: #f3f3f3; }
.bad { color: #b00; font-weight: bold; }
.note { color: #555; font-size: 13px; }
svg { display: block; margin: 8px 0 16px; }
"""


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def class_rows(summary: LoadSummary) -> list[list[str]]:
    def lat(latency: Latency) -> list[str]:
        return [ms(latency.p50), ms(latency.p90), ms(latency.p99)]

    rows = []
    for c in summary.classes.values():
        share = f"{100 * c.met_slo / c.ok:.0f}%" if c.ok else "-"
        rows.append(
            [
                escape(c.tier), str(c.sent), str(c.ok), str(c.dropped),
                f'<span class="bad">{c.errors}</span>' if c.errors else "0",
                *lat(c.ttft), *lat(c.itl), ms(c.tpot.p50), ms(c.tpot.p99),
                f"{c.slo.ttft_ms:g} / {c.slo.tpot_ms:g}",
                f"{c.throughput_rps:.2f}", f"{c.goodput_rps:.2f}", share,
            ]
        )  # fmt: skip
    return rows


CLASS_HEADER = (
    "class", "sent", "completed", "dropped", "errors",
    "TTFT p50", "p90", "p99", "ITL p50", "p90", "p99", "TPOT p50", "p99",
    "SLO TTFT / TPOT (ms)", "completed/s", "goodput/s", "within SLO",
)  # fmt: skip


def ttft_rows(summary: LoadSummary) -> list[list[str]]:
    rows = []
    for c in summary.classes.values():
        s = c.server
        if s is None:
            continue
        rows.append(
            [
                escape(c.tier), str(s.client_requests), ms(s.client_p50_ms),
                ms(s.client_mean_ms), str(s.requests), ms(s.p50_ms), ms(s.mean_ms),
            ]
        )  # fmt: skip
    return rows


TTFT_HEADER = (
    "class", "client: completed", "client p50 (ms)", "client mean",
    "server: requests", "server p50 (buckets)", "server mean (sum/count)",
)  # fmt: skip


def charts(summary: LoadSummary) -> list[str]:
    x_label = "seconds into the run"
    end = summary.duration_s
    out = []
    for tier, series in summary.series.items():
        slo = summary.classes[tier].slo.ttft_ms
        lines = [Series("p50", series.ttft_p50), Series("p95", series.ttft_p95)]
        title = f"TTFT, {tier} (bins of {summary.window_s:g} s)"
        highest = max((y for _, y in series.ttft_p95 if y is not None), default=0.0)
        if slo <= 2 * highest:
            lines.append(Series(f"SLO {slo:g} ms", [(0.0, slo), (end, slo)], "#888", True))
        else:  # drawn, it would flatten the measured lines against the axis
            title += f"; SLO {slo:g} ms, far above"
        out.append(line_chart(title, lines, x_label=x_label, y_label="ms"))
    out.append(
        line_chart(
            "ITL (gap between chunks)",
            [
                Series(f"{tier} {name}", points, dashed=name == "p99")
                for tier, s in summary.series.items()
                for name, points in (("p50", s.itl_p50), ("p99", s.itl_p99))
            ],
            x_label=x_label,
            y_label="ms",
        )
    )
    out.append(
        line_chart(
            "Goodput (completed within both SLOs) and throughput (completed)",
            [
                Series(f"{tier} {name}", points, dashed=name == "completed")
                for tier, s in summary.series.items()
                for name, points in (("goodput", s.goodput), ("completed", s.throughput))
            ],
            x_label=x_label,
            y_label="requests / s",
        )
    )
    out.append(
        line_chart(
            "Users (Locust) and replicas (engines in /status)",
            [Series("users", summary.users), Series("replicas", summary.server.replicas)],
            x_label=x_label,
            y_label="count",
        )
    )
    server = summary.server
    queues = [Series(f"running {c}", p) for c, p in server.running.items()]
    queues += [Series(f"waiting {c}", p, dashed=True) for c, p in server.waiting.items()]
    if queues:
        out.append(
            line_chart(
                "Requests in the engines, by server class (/status)",
                queues,
                x_label=x_label,
                y_label="requests",
            )
        )
    return out


def locust_table(stats_csv: Path) -> str:
    """Locust's own `_stats.csv` as a table (its percentiles are rounded: Locust bins)."""
    if not stats_csv.is_file():
        return '<p class="note">no Locust statistics file</p>'
    with stats_csv.open(newline="") as f:
        rows = list(csv.reader(f))
    if not rows:
        return '<p class="note">empty Locust statistics file</p>'
    keep = ["Type", "Name", "Request Count", "Failure Count", "Average Response Time",
            "50%", "90%", "99%", "Max Response Time", "Requests/s"]  # fmt: skip
    header = rows[0]
    index = [header.index(k) for k in keep if k in header]
    body = [[escape(_round(row[i])) for i in index] for row in rows[1:]]
    return _table([header[i] for i in index], body)


def _round(cell: str) -> str:
    try:
        value = float(cell)
    except ValueError:
        return cell
    return cell if value.is_integer() else f"{value:.2f}"


def render_html(
    summary: LoadSummary,
    *,
    title: str,
    settings: Mapping[str, object],
    stats_csv: Path | None = None,
) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(summary.start))
    cancelled = summary.server_cancelled
    facts = [
        f"started {started}, {summary.duration_s:.0f} s",
        f"replicas seen: {summary.max_replicas if summary.max_replicas is not None else '-'}",
    ]
    if cancelled is not None:
        dropped = sum(c.dropped for c in summary.classes.values())
        facts.append(f"streams dropped by the client: {dropped}, cancelled on the server: "
                     f"{cancelled:.0f}")  # fmt: skip
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{escape(title)}</title><style>{CSS}</style></head><body>",
        f"<h1>{escape(title)}</h1>",
        f"<p>{escape('; '.join(facts))}</p>",
        *(f'<p class="note">{escape(n)}</p>' for n in summary.notes),
        "<h2>Per class (client side, ms)</h2>",
        _table(CLASS_HEADER, class_rows(summary)),
        "<p class='note'>TTFT and ITL over every stream that produced them, dropped ones "
        "included; TPOT, goodput and throughput over completed streams. Goodput: completed "
        "requests per second whose TTFT and TPOT are both within the class's SLO.</p>",
        "<h2>TTFT: client vs server</h2>",
        _table(TTFT_HEADER, ttft_rows(summary)),
        "<p class='note'>Server: <code>firstlight_time_to_first_token_seconds</code> from "
        "<code>/metrics</code>, the bucket counts added during the run (p50 interpolated "
        "within its bucket; the mean is exact). Client: the same completed requests as "
        "Locust saw them. The client's TTFT also holds what the server's clock cannot see: "
        "sending the request, the server reading it before its handler starts, and the "
        "client's own scheduling (Locust shares the machine).</p>",
        "<h2>Over time</h2>",
        *charts(summary),
        "<h2>Locust statistics</h2>",
        locust_table(stats_csv) if stats_csv is not None else "",
        "<h2>Settings</h2>",
        _table(("setting", "value"), [[escape(k), escape(str(v))] for k, v in settings.items()]),
        "</body></html>",
    ]
    return "\n".join(parts)


def summary_lines(summary: LoadSummary) -> list[str]:
    """What `make load` prints: one line per class, then client vs server TTFT."""
    lines = []
    for c in summary.classes.values():
        lines.append(_class_line(c))
    for c in summary.classes.values():
        s = c.server
        if s is None or not s.requests:
            continue
        gap = (
            None if s.client_mean_ms is None or s.mean_ms is None else s.client_mean_ms - s.mean_ms
        )
        lines.append(
            f"  TTFT {c.tier:<11} client p50 {ms(s.client_p50_ms)} / mean {ms(s.client_mean_ms)} "
            f"ms; server p50 {ms(s.p50_ms)} (buckets) / mean {ms(s.mean_ms)} ms; client - "
            f"server mean {'-' if gap is None else f'{gap:+.1f}'} ms "
            f"({s.client_requests} / {s.requests} requests)"
        )
    if summary.max_replicas is not None:
        lines.append(f"  replicas: up to {summary.max_replicas}")
    if summary.server_cancelled is not None:
        dropped = sum(c.dropped for c in summary.classes.values())
        lines.append(
            f"  dropped by the client: {dropped}; cancelled on the server: "
            f"{summary.server_cancelled:.0f}"
        )
    lines += [f"  note: {note}" for note in summary.notes]
    return lines


def _class_line(c: ClassSummary) -> str:
    return (
        f"  {c.tier:<11} sent {c.sent}, completed {c.ok}, dropped {c.dropped}, errors "
        f"{c.errors} | TTFT p50 {ms(c.ttft.p50)} p99 {ms(c.ttft.p99)} ms | ITL p50 "
        f"{ms(c.itl.p50)} p99 {ms(c.itl.p99)} ms | TPOT p50 {ms(c.tpot.p50)} ms | goodput "
        f"{c.goodput_rps:.2f}/s of {c.throughput_rps:.2f}/s (SLO TTFT {c.slo.ttft_ms:g} ms, "
        f"TPOT {c.slo.tpot_ms:g} ms)"
    )
