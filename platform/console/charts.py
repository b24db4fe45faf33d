"""Server-rendered SVG charts: no JavaScript, no CDN, readable at a glance."""

from html import escape

PALETTE = ("#4f7cff", "#f59e0b", "#10b981", "#ef4444", "#8b5cf6", "#06b6d4", "#84cc16", "#ec4899")
WIDTH, HEIGHT = 720, 240
LEFT, RIGHT, TOP, BOTTOM = 56, 12, 12, 44


def _nice_max(value: float) -> float:
    if value <= 0:
        return 1.0
    magnitude = 10 ** (len(str(int(value))) - 1)
    for step in (1, 2, 2.5, 5, 10):
        if value <= step * magnitude:
            return step * magnitude
    return 10 * magnitude


def _short(value: float) -> str:
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= limit:
            return f"{value / limit:.3g}{suffix}"
    return f"{value:.3g}"


def stacked_bars(labels: list[str], series: dict[str, list[float]], unit: str) -> str:
    """A stacked bar per label (x), one colour per series; an SVG string."""
    totals = [sum(values[i] for values in series.values()) for i in range(len(labels))]
    top = _nice_max(max(totals, default=0))
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    slot = plot_w / max(len(labels), 1)
    parts = [
        f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
        f'aria-label="{escape(unit)} per day" xmlns="http://www.w3.org/2000/svg">'
    ]
    for tick in range(5):
        value = top * tick / 4
        y = TOP + plot_h - plot_h * tick / 4
        parts.append(
            f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>'
            f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end" class="axis">'
            f"{_short(value)}</text>"
        )
    every = max(1, len(labels) // 10)
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
                f"{values[i]:,.0f} {escape(unit)}</title></rect>"
            )
        if i % every == 0:
            parts.append(
                f'<text x="{LEFT + (i + 0.5) * slot:.1f}" y="{HEIGHT - BOTTOM + 16}" '
                f'text-anchor="middle" class="axis">{escape(label)}</text>'
            )
    for index, (color, name) in enumerate(zip(PALETTE * 4, series, strict=False)):
        x = LEFT + (index % 5) * 130
        y = HEIGHT - 12 + (index // 5) * 0
        parts.append(
            f'<rect x="{x}" y="{y - 9}" width="10" height="10" fill="{color}"/>'
            f'<text x="{x + 14}" y="{y}" class="legend">{escape(name[:18])}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)
