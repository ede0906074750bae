"""Line charts as inline SVG text: the report's plots, with no plotting library and nothing
fetched (the HTML file is self-contained).

`line_chart` draws each `Series` as a polyline over shared axes with "nice" ticks (1, 2 or
5 × 10^k); a point whose y is None breaks its line. Every point carries a `<title>`, so a
browser shows its value on hover. All text is escaped.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#17becf")


@dataclass(frozen=True, slots=True)
class Series:
    label: str
    points: Sequence[tuple[float, float | None]]
    color: str = ""  # empty: the next colour of the palette
    dashed: bool = False


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """About `count` round tick values covering [low, high]."""
    if not (math.isfinite(low) and math.isfinite(high)) or high <= low:
        high = low + 1
    raw = (high - low) / max(count, 1)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    first = math.floor(low / step) * step
    ticks = []
    value = first
    while value < high + step * 0.999:
        ticks.append(round(value, 10))
        value += step
    return ticks


def _fmt(value: float) -> str:
    if value == 0 or abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}".rstrip("0").rstrip(".")
    return f"{value:.3g}"


def line_chart(
    title: str,
    series: Sequence[Series],
    *,
    x_label: str,
    y_label: str,
    width: int = 760,
    height: int = 280,
    y_min: float | None = 0.0,
) -> str:
    """An `<svg>` element. Axes span every point of every series (y from `y_min` when given,
    else from the smallest value)."""
    left, right, top, bottom = 64, 16, 34, 64
    xs = [x for s in series for x, _ in s.points]
    ys = [y for s in series for _, y in s.points if y is not None]
    x_ticks = nice_ticks(min(xs, default=0.0), max(xs, default=1.0))
    y_low = y_min if y_min is not None else min(ys, default=0.0)
    y_ticks = nice_ticks(y_low, max(ys, default=y_low + 1.0))
    x0, x1, y0, y1 = x_ticks[0], x_ticks[-1], y_ticks[0], y_ticks[-1]
    plot_w, plot_h = width - left - right, height - top - bottom

    def px(x: float) -> float:
        return left + plot_w * (x - x0) / (x1 - x0)

    def py(y: float) -> float:
        return top + plot_h * (1 - (y - y0) / (y1 - y0))

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}" '
        'font-family="sans-serif" font-size="11">',
        f'<text x="{left}" y="18" font-size="13" font-weight="bold">{escape(title)}</text>',
    ]
    for y in y_ticks:
        out.append(
            f'<line x1="{left}" x2="{width - right}" y1="{py(y):.1f}" y2="{py(y):.1f}" '
            'stroke="#ddd"/>'
            f'<text x="{left - 6}" y="{py(y) + 4:.1f}" text-anchor="end">{_fmt(y)}</text>'
        )
    for x in x_ticks:
        out.append(
            f'<line x1="{px(x):.1f}" x2="{px(x):.1f}" y1="{top}" y2="{top + plot_h}" '
            'stroke="#eee"/>'
            f'<text x="{px(x):.1f}" y="{top + plot_h + 14}" text-anchor="middle">'
            f"{_fmt(x)}</text>"
        )
    out.append(
        f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" '
        'stroke="#999"/>'
        f'<text x="{left + plot_w / 2}" y="{top + plot_h + 30}" text-anchor="middle">'
        f"{escape(x_label)}</text>"
        f'<text transform="translate(14 {top + plot_h / 2}) rotate(-90)" '
        f'text-anchor="middle">{escape(y_label)}</text>'
    )
    colors = iter(PALETTE * (len(series) // len(PALETTE) + 1))
    legend_x = left
    for s in series:
        color = s.color or next(colors)
        dash = ' stroke-dasharray="5 4"' if s.dashed else ""
        for run in _runs(s.points):
            path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in run)
            out.append(
                f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="1.8"{dash}/>'
            )
            for x, y in run:
                out.append(
                    f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5" fill="{color}">'
                    f"<title>{escape(s.label)}: {_fmt(y)} at {_fmt(x)}</title></circle>"
                )
        out.append(
            f'<line x1="{legend_x}" x2="{legend_x + 18}" y1="{height - 12}" '
            f'y2="{height - 12}" stroke="{color}" stroke-width="2.5"{dash}/>'
            f'<text x="{legend_x + 22}" y="{height - 8}">{escape(s.label)}</text>'
        )
        legend_x += 30 + 7 * len(s.label)
    out.append("</svg>")
    return "\n".join(out)


def _runs(points: Sequence[tuple[float, float | None]]) -> list[list[tuple[float, float]]]:
    """The points split where y is None: each run is drawn as one line."""
    runs: list[list[tuple[float, float]]] = [[]]
    for x, y in points:
        if y is None:
            if runs[-1]:
                runs.append([])
        else:
            runs[-1].append((x, y))
    return [run for run in runs if run]
