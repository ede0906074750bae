"""`line_chart`: well-formed SVG, round ticks, gaps where nothing was measured, escaping."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from locustfiles.svg import Series, line_chart, nice_ticks

NS = "{http://www.w3.org/2000/svg}"


def test_ticks_are_round_and_cover_the_range() -> None:
    assert nice_ticks(0, 10) == [0, 2, 4, 6, 8, 10]
    assert nice_ticks(0, 0.37) == [0, 0.1, 0.2, 0.3, 0.4]
    ticks = nice_ticks(3, 1234)
    assert ticks[0] <= 3 and ticks[-1] >= 1234 and len(ticks) <= 8
    assert nice_ticks(5, 5) == [5, 5.2, 5.4, 5.6, 5.8, 6]  # an empty range still gets an axis


def test_a_missing_value_breaks_the_line_and_every_point_has_a_tooltip() -> None:
    points = [(0.0, 1.0), (1.0, 2.0), (2.0, None), (3.0, 4.0), (4.0, 5.0)]
    svg = ET.fromstring(line_chart("TTFT", [Series("p50", points)], x_label="s", y_label="ms"))
    assert len(svg.findall(f"{NS}polyline")) == 2
    titles = [c.find(f"{NS}title").text for c in svg.findall(f"{NS}circle")]
    assert titles == ["p50: 1 at 0", "p50: 2 at 1", "p50: 4 at 3", "p50: 5 at 4"]


def test_text_is_escaped_and_an_empty_chart_still_draws() -> None:
    chart = line_chart("a <b> & c", [Series("x<y", [])], x_label="t", y_label="n")
    svg = ET.fromstring(chart)  # parses: nothing unescaped
    assert "a <b> & c" in "".join(svg.itertext())
    assert svg.findall(f"{NS}polyline") == []
