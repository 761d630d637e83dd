"""Charts as inline SVG, drawn on the server: a run's metric curves with its checkpoints marked.

No chart library and no script: the page works offline and under a policy that forbids scripts,
and every label passes through ``html.escape``. Each series gets a chart of its own scale (a
learning rate next to a loss would be a flat line on the loss's axis), all on the same step axis;
each save event is a marker on the curve, styled by what points at it (latest, best, gate, pool);
resumes, warm starts and pivots are dashed rules.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from html import escape
from typing import Any

WIDTH, HEIGHT = 900, 320
PAD_LEFT, PAD_RIGHT, PAD_TOP, PAD_BOTTOM = 64, 16, 16, 40
COLOURS = ("#1f6feb", "#d9480f", "#2b8a3e", "#862e9c")
RESTART_EVENTS = ("resume", "warm_start", "pivot", "fresh")


def _ticks(low: float, high: float, count: int = 5) -> list[float]:
    if high <= low:
        return [low]
    step = (high - low) / (count - 1)
    return [low + i * step for i in range(count)]


def _label(value: float) -> str:
    return f"{value:.4g}"


def marker_class(marks: Sequence[str]) -> str:
    """The CSS class of a checkpoint marker: its most telling pointer."""
    kinds = {m.split(":", 1)[0] for m in marks}
    for kind in ("best", "latest", "gate", "pool"):
        if kind in kinds:
            return f"ckpt {kind}"
    return "ckpt"


def metric_charts(series: dict[str, list[list[float]]], events: Sequence[dict[str, Any]]) -> str:
    """One chart per series (the first full height), each with the run's save markers and
    restart rules, and one legend."""
    steps = [p[0] for points in series.values() for p in points]
    steps += [float(e["step"]) for e in events]
    if not steps:
        return '<p class="empty">No training history with steps to draw.</p>'
    span = (min(steps), max(steps))
    names = list(series) or [""]
    charts = [
        _chart(i, name, series.get(name, []), events, span, HEIGHT if i == 0 else HEIGHT // 2)
        for i, name in enumerate(names)
    ]
    return "".join(charts) + _legend(series)


def _chart(
    index: int,
    name: str,
    points: list[list[float]],
    events: Sequence[dict[str, Any]],
    span: tuple[float, float],
    height: int,
) -> str:
    """An SVG of one series against the step, with save markers and restart rules."""
    values = [p[1] for p in points]
    x_low, x_high = span
    y_low, y_high = (min(values), max(values)) if values else (0.0, 1.0)
    if x_high == x_low:
        x_high = x_low + 1
    if y_high == y_low:
        y_high = y_low + 1
    plot_w, plot_h = WIDTH - PAD_LEFT - PAD_RIGHT, height - PAD_TOP - PAD_BOTTOM

    def x(step: float) -> float:
        return PAD_LEFT + (step - x_low) / (x_high - x_low) * plot_w

    def y(value: float) -> float:
        return PAD_TOP + (1 - (value - y_low) / (y_high - y_low)) * plot_h

    parts = [
        f'<svg class="chart" data-index="{index}" viewBox="0 0 {WIDTH} {height}" role="img" '
        'aria-label="metrics by step, checkpoints marked" xmlns="http://www.w3.org/2000/svg">',
        f'<rect class="plot" x="{PAD_LEFT}" y="{PAD_TOP}" width="{plot_w}" height="{plot_h}"/>',
    ]
    for tick in _ticks(y_low, y_high):
        parts.append(
            f'<line class="grid" x1="{PAD_LEFT}" x2="{WIDTH - PAD_RIGHT}" '
            f'y1="{y(tick):.1f}" y2="{y(tick):.1f}"/>'
            f'<text class="tick" x="{PAD_LEFT - 6}" y="{y(tick) + 4:.1f}" '
            f'text-anchor="end">{escape(_label(tick))}</text>'
        )
    for tick in _ticks(x_low, x_high):
        parts.append(
            f'<text class="tick" x="{x(tick):.1f}" y="{height - PAD_BOTTOM + 16}" '
            f'text-anchor="middle">{escape(_label(round(tick)))}</text>'
        )
    parts.append(
        f'<text class="axis" x="{PAD_LEFT + plot_w / 2:.0f}" y="{height - 6}" '
        'text-anchor="middle">step</text>'
    )
    if points:
        path = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in points)
        parts.append(
            f'<text class="name" x="{PAD_LEFT + 6}" y="{PAD_TOP + 14}">{escape(name)}</text>'
            f'<polyline class="series" data-series="{escape(name)}" '
            f'stroke="{COLOURS[index % len(COLOURS)]}" points="{path}">'
            f"<title>{escape(name)}</title></polyline>"
        )
    first_steps = [p[0] for p in points]
    for event in events:
        step = float(event["step"])
        if event["event"] in RESTART_EVENTS:
            parts.append(
                f'<line class="restart" x1="{x(step):.1f}" x2="{x(step):.1f}" y1="{PAD_TOP}" '
                f'y2="{height - PAD_BOTTOM}"><title>{escape(event["event"])} at step '
                f"{int(step)}</title></line>"
            )
        elif event["event"] == "save":
            where = _value_at(points, first_steps, step)
            cy = y(where) if where is not None else height - PAD_BOTTOM
            marks = event.get("marks", [])
            label = f"{event.get('ref') or 'checkpoint'} (step {int(step)})"
            if marks:
                label += ": " + ", ".join(marks)
            if not event.get("exists", True):
                label += " (forgotten)"
            parts.append(
                f'<circle class="{marker_class(marks)}{"" if event.get("exists", True) else " gone"}" '
                f'cx="{x(step):.1f}" cy="{cy:.1f}" r="5"><title>{escape(label)}</title></circle>'
            )
    parts.append("</svg>")
    return "".join(parts)


def _legend(series: dict[str, list[list[float]]]) -> str:
    legend = "".join(
        f'<span class="key"><i class="s{i % len(COLOURS)}"></i>{escape(name)}</span>'
        for i, name in enumerate(series)
    )
    keys = (
        '<span class="key"><b class="ckpt best"></b>best</span>'
        '<span class="key"><b class="ckpt latest"></b>latest</span>'
        '<span class="key"><b class="ckpt gate"></b>gate</span>'
        '<span class="key"><b class="ckpt pool"></b>pool</span>'
        '<span class="key"><b class="ckpt"></b>checkpoint</span>'
        '<span class="key"><b class="ckpt gone"></b>forgotten</span>'
        '<span class="key"><s></s>resume / pivot</span>'
    )
    return f'<div class="legend">{legend}{keys}</div>'


def _value_at(points: list[list[float]], steps: list[float], step: float) -> float | None:
    """The series' value at the recorded step nearest ``step``."""
    if not points:
        return None
    i = bisect.bisect_left(steps, step)
    if i == len(steps) or (i > 0 and step - steps[i - 1] < steps[i] - step):
        i -= 1
    return points[i][1]
