"""The plot of /status: the run's interval against the margin over time, as inline SVG built on the server
(the page loads nothing and runs no script). The steps are the report's own walk replayed
(flyspec/gate/report/decisions.py); a long run is thinned to ``MAX_POINTS`` buckets, each drawn at its
last step, so the interval as it stands is always the last point. Every text is escaped."""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape

from flyspec.gate.report.decisions import Step

MAX_POINTS = 400
WIDTH, HEIGHT = 640, 260
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 12, 40


def thinned(steps: Sequence[Step], limit: int = MAX_POINTS) -> list[Step]:
    """At most ``limit`` steps: all of them, or the last step of each of ``limit`` equal buckets."""
    if limit < 1:
        raise ValueError(f"limit={limit}: must be at least 1")
    if len(steps) <= limit:
        return list(steps)
    size = len(steps) / limit
    return [steps[math.ceil((i + 1) * size) - 1] for i in range(limit)]


def interval_svg(steps: Sequence[Step], margin: float, title: str) -> str:
    """The SVG (or a sentence before the first counted pair): the band between the bounds after each pair,
    in points, with the lines at ``-margin`` and at 0."""
    points = thinned(steps)
    if not points:
        return "<p>No pair is counted yet: the plot starts with the first pair in arrival order.</p>"
    lows = [100 * s.low for s in points]
    highs = [100 * s.high for s in points]
    floor = min(*lows, -100 * margin, 0.0)
    ceiling = max(*highs, -100 * margin, 0.0)
    pad = 0.05 * (ceiling - floor) or 1.0
    floor, ceiling = floor - pad, ceiling + pad
    last = points[-1].n
    width, height = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(n: int) -> float:
        return LEFT + width * n / last

    def y(value: float) -> float:
        return TOP + height * (ceiling - value) / (ceiling - floor)

    def line(values: list[float]) -> str:
        return " ".join(f"{x(s.n):.1f},{y(v):.1f}" for s, v in zip(points, values, strict=True))

    def level(value: float, colour: str, text: str, dash: str = "") -> str:
        return (
            f'<line x1="{LEFT}" x2="{LEFT + width}" y1="{y(value):.1f}" y2="{y(value):.1f}" '
            f'stroke="{colour}"{dash}/><text x="{LEFT - 4}" y="{y(value) + 4:.1f}" text-anchor="end" '
            f'font-size="11" fill="{colour}">{escape(text)}</text>'
        )

    band = line(highs) + " " + " ".join(reversed(line(lows).split()))
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" role="img" '
        f'class="interval-plot" data-steps="{len(points)}" data-pairs="{last}">'
        f"<title>{escape(title)}</title>"
        f'<polygon points="{band}" fill="#cfe2f3" stroke="none"/>'
        f'<polyline class="high" points="{line(highs)}" fill="none" stroke="#1f77b4"/>'
        f'<polyline class="low" points="{line(lows)}" fill="none" stroke="#1f77b4"/>'
        + level(0.0, "#555555", "0")
        + level(-100 * margin, "#d62728", f"-margin {-100 * margin:+.1f}", ' stroke-dasharray="6 4"')
        + f'<text x="{LEFT + width / 2:.1f}" y="{HEIGHT - 8}" text-anchor="middle" font-size="11">'
        f"{escape(f'pairs in arrival order (1 to {last}); the band is the interval in points')}</text>"
        "</svg>"
    )
