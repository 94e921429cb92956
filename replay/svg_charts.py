"""Inline SVG charts for the HTML run report: no JavaScript library, nothing fetched at view time.

Each chart is one <svg class="chart"> string with its axes, ticks, series and legend; every point
carries a <title> (the browser's own tooltip).
"""

from __future__ import annotations

import math
from html import escape

__all__ = ["bar_chart", "line_chart"]

WIDTH, HEIGHT = 640, 260
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 28, 40
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b")

Series = dict[str, list[tuple[float, float]]]  # legend -> (x, y) points, x ascending


def _ticks(low: float, high: float, count: int = 5) -> list[float]:
    if high <= low:
        return [low]
    raw = (high - low) / count
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 5, 10) if m * step >= raw)
    first = math.ceil(low / step) * step
    return [first + i * step for i in range(int((high - first) / step + 1e-9) + 1)]


def _label(value: float) -> str:
    return f"{value:.3g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.1e}"


def _frame(title: str, x_label: str, y_label: str, body: str, legend: list[str],
           x_ticks: list[tuple[float, str]], y_ticks: list[tuple[float, str]]) -> str:
    parts = [f'<svg class="chart" role="img" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" '
             f'xmlns="http://www.w3.org/2000/svg"><title>{escape(title)}</title>',
             f'<text x="{LEFT}" y="16" class="title">{escape(title)}</text>',
             f'<line x1="{LEFT}" y1="{HEIGHT - BOTTOM}" x2="{WIDTH - RIGHT}" y2="{HEIGHT - BOTTOM}" class="axis"/>',
             f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{HEIGHT - BOTTOM}" class="axis"/>']
    for x, text in x_ticks:
        parts.append(f'<text x="{x:.1f}" y="{HEIGHT - BOTTOM + 14}" class="tick" text-anchor="middle">{text}</text>')
    for y, text in y_ticks:
        parts.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{WIDTH - RIGHT}" y2="{y:.1f}" class="grid"/>'
                     f'<text x="{LEFT - 6}" y="{y + 4:.1f}" class="tick" text-anchor="end">{text}</text>')
    parts.append(f'<text x="{(LEFT + WIDTH - RIGHT) / 2}" y="{HEIGHT - 6}" class="tick" text-anchor="middle">'
                 f'{escape(x_label)}</text>')
    parts.append(f'<text x="14" y="{(TOP + HEIGHT - BOTTOM) / 2}" class="tick" text-anchor="middle" '
                 f'transform="rotate(-90 14 {(TOP + HEIGHT - BOTTOM) / 2})">{escape(y_label)}</text>')
    parts.append(body)
    for i, name in enumerate(legend):
        x = WIDTH - RIGHT - 150
        y = TOP + 4 + 14 * i
        parts.append(f'<rect x="{x}" y="{y}" width="10" height="10" fill="{COLORS[i % len(COLORS)]}"/>'
                     f'<text x="{x + 14}" y="{y + 9}" class="tick">{escape(name)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def line_chart(title: str, series: Series, *, x_label: str = "step", y_label: str = "", log_y: bool = False) -> str:
    """One line per series; log_y drops points <= 0 (a KL of exactly 0 has no place on a log axis)."""
    if log_y:
        series = {name: [(x, y) for x, y in points if y > 0] for name, points in series.items()}
    series = {name: points for name, points in series.items() if points}
    if not series:
        return ""
    ys = [math.log10(y) if log_y else y for points in series.values() for _, y in points]
    xs = [x for points in series.values() for x, _ in points]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = min(ys), max(ys)
    if y1 <= y0:
        y0, y1 = y0 - 1, y1 + 1
    decades = range(math.floor(y0), math.ceil(y1) + 1)
    y_ticks = [float(t) for t in decades[::max(1, len(decades) // 6)]] if log_y else _ticks(y0, y1)
    y0, y1 = min(y0, *y_ticks), max(y1, *y_ticks)

    def sx(x: float) -> float:
        return LEFT + (x - x0) / (x1 - x0) * (WIDTH - LEFT - RIGHT)

    def sy(y: float) -> float:
        return HEIGHT - BOTTOM - ((math.log10(y) if log_y else y) - y0) / (y1 - y0) * (HEIGHT - TOP - BOTTOM)

    body = []
    for i, (name, points) in enumerate(series.items()):
        color = COLORS[i % len(COLORS)]
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in points)
        body.append(f'<polyline class="series" fill="none" stroke="{color}" stroke-width="1.6" points="{path}"/>')
        if len(points) <= 200:
            body.extend(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2" fill="{color}"><title>{escape(name)} '
                        f'at {_label(x)}: {_label(y)}</title></circle>' for x, y in points)
    x_ticks = [(sx(t), _label(t)) for t in _ticks(x0, x1) if x0 <= t <= x1]
    y_marks = [(sy(10 ** t if log_y else t), f"1e{int(t)}" if log_y else _label(t)) for t in y_ticks]
    return _frame(title, x_label, y_label + (" (log)" if log_y else ""), "".join(body), list(series), x_ticks, y_marks)


def bar_chart(title: str, bars: list[tuple[str, float]], *, x_label: str = "", y_label: str = "") -> str:
    """One bar per (label, value), values >= 0."""
    if not bars:
        return ""
    top = max(max(v for _, v in bars), 1e-12)
    y_ticks = _ticks(0.0, top)
    top = max(top, y_ticks[-1])
    slot = (WIDTH - LEFT - RIGHT) / len(bars)
    body, x_ticks = [], []
    every = max(1, len(bars) // 12)
    for i, (label, value) in enumerate(bars):
        height = value / top * (HEIGHT - TOP - BOTTOM)
        x = LEFT + i * slot
        body.append(f'<rect class="series" x="{x + slot * 0.15:.1f}" y="{HEIGHT - BOTTOM - height:.1f}" '
                    f'width="{slot * 0.7:.1f}" height="{height:.1f}" fill="{COLORS[0]}">'
                    f'<title>{escape(label)}: {_label(value)}</title></rect>')
        if i % every == 0:
            x_ticks.append((x + slot / 2, escape(label)))
    y_marks = [(HEIGHT - BOTTOM - t / top * (HEIGHT - TOP - BOTTOM), _label(t)) for t in y_ticks]
    return _frame(title, x_label, y_label, "".join(body), [], x_ticks, y_marks)
