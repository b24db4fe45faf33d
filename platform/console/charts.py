"""Server-rendered SVG charts: no JavaScript, no CDN, readable at a glance.

The SVG scales to its container's width (a phone's too); every bar and point carries a
``<title>`` with its exact figure."""

import math
from html import escape

PALETTE = ("#4f7cff", "#f59e0b", "#10b981", "#ef4444", "#8b5cf6", "#06b6d4", "#84cc16", "#ec4899")
WIDTH, HEIGHT = 720, 240
LEFT, RIGHT, TOP, BOTTOM = 56, 12, 12, 44
NUM_TICKS = 4  # at most, above zero
MAX_X_LABELS = 8


def axis_ticks(value: float, *, is_integer: bool = False) -> list[float]:
    """Ticks from 0 to at least ``value`` in steps of 1, 2, 2.5 or 5 times a power of ten,
    at most ``NUM_TICKS`` above zero; whole steps only when ``is_integer`` (a count of
    requests has no 0.25)."""
    if value <= 0:
        return [0.0, 1.0]
    raw_step = value / NUM_TICKS
    magnitude = 10 ** math.floor(math.log10(raw_step))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw_step - 1e-12)
    if is_integer:
        step = max(1.0, math.ceil(step))
    count = math.ceil(value / step - 1e-9)
    return [i * step for i in range(count + 1)]


def short_number(value: float) -> str:
    """1234 -> "1.23k", 2_500_000 -> "2.5M", 12.5 -> "12.5"."""
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= limit:
            return f"{value / limit:.3g}{suffix}"
    return f"{value:.3g}"


def exact_number(value: float) -> str:
    """With thousands separators: 12,345 or 12.5."""
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.1f}"


def _tick_label(tick: float, unit: str, top: float) -> str:
    """A tick's text: milliseconds in seconds on an axis that reaches a second."""
    if unit == "ms" and top >= 1000:
        return f"{short_number(tick / 1000)}s"
    return f"{short_number(tick)}{unit}"


def _frame(ticks: list[float], unit: str, label: str) -> list[str]:
    plot_h = HEIGHT - TOP - BOTTOM
    parts = [
        f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
        f'aria-label="{escape(label)}" xmlns="http://www.w3.org/2000/svg">'
    ]
    for tick in ticks:
        y = TOP + plot_h - plot_h * tick / ticks[-1]
        parts.append(
            f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>'
            f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end" class="axis">'
            f"{escape(_tick_label(tick, unit, ticks[-1]))}</text>"
        )
    return parts


def _x_labels(labels: list[str]) -> list[str]:
    slot = (WIDTH - LEFT - RIGHT) / max(len(labels), 1)
    every = max(1, math.ceil(len(labels) / MAX_X_LABELS))
    return [
        f'<text x="{LEFT + (i + 0.5) * slot:.1f}" y="{HEIGHT - BOTTOM + 16}" '
        f'text-anchor="middle" class="axis">{escape(label)}</text>'
        for i, label in enumerate(labels)
        if i % every == 0
    ]


def _legend(names: list[str]) -> list[str]:
    parts = []
    for index, (color, name) in enumerate(zip(PALETTE * 4, names, strict=False)):
        x = LEFT + (index % 5) * 130
        parts.append(
            f'<rect x="{x}" y="{HEIGHT - 21}" width="10" height="10" fill="{color}"/>'
            f'<text x="{x + 14}" y="{HEIGHT - 12}" class="legend">{escape(name[:18])}</text>'
        )
    return parts


def stacked_bars(
    labels: list[str], series: dict[str, list[float]], unit: str, *, is_integer: bool = True
) -> str:
    """A stacked bar per label (x), one colour per series; an SVG string."""
    totals = [sum(values[i] for values in series.values()) for i in range(len(labels))]
    ticks = axis_ticks(max(totals, default=0), is_integer=is_integer)
    top = ticks[-1]
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    slot = plot_w / max(len(labels), 1)
    parts = _frame(ticks, "", f"{unit} per period")
    for i, label in enumerate(labels):
        x = LEFT + i * slot + slot * 0.15
        y = TOP + plot_h
        for color, (name, values) in zip(PALETTE * 4, series.items(), strict=False):
            height = plot_h * values[i] / top
            if height <= 0:
                continue
            y -= height
            parts.append(
                f'<rect x="{x:.1f}" y="{y:.1f}" width="{slot * 0.7:.1f}" height="{height:.1f}" '
                f'fill="{color}"><title>{escape(label)} · {escape(name)}: '
                f"{exact_number(values[i])} {escape(unit)}</title></rect>"
            )
    parts += _x_labels(labels)
    parts += _legend(list(series))
    parts.append("</svg>")
    return "".join(parts)


def lines(labels: list[str], series: dict[str, list[float | None]], unit: str) -> str:
    """A line per series over the labels (x); None is a gap (no data in that period), and a
    lone point between gaps is drawn as a dot. An SVG string."""
    values = [v for points in series.values() for v in points if v is not None]
    ticks = axis_ticks(max(values, default=0))
    top = ticks[-1]
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    slot = plot_w / max(len(labels), 1)
    parts = _frame(ticks, unit, f"{', '.join(series)} ({unit}) per period")
    for color, (name, points) in zip(PALETTE * 4, series.items(), strict=False):
        run: list[str] = []
        for i, value in enumerate([*points, None]):
            if value is not None:
                x, y = LEFT + (i + 0.5) * slot, TOP + plot_h - plot_h * value / top
                run.append(f"{x:.1f},{y:.1f}")
                parts.append(
                    f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{color}">'
                    f"<title>{escape(labels[i])} · {escape(name)}: "
                    f"{exact_number(value)} {escape(unit)}</title></circle>"
                )
                continue
            if len(run) > 1:
                parts.append(
                    f'<polyline points="{" ".join(run)}" fill="none" stroke="{color}" '
                    'stroke-width="2"/>'
                )
            run = []
    parts += _x_labels(labels)
    parts += _legend(list(series))
    parts.append("</svg>")
    return "".join(parts)
