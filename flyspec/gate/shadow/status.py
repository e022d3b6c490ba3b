"""What production tooling and people read of a registered shadow run: ``/decision`` (the decision object
of ``gate report --json``), ``/status`` (the run for a person, with the interval against the margin over
time as inline SVG from the report's own walk: the page loads nothing, every text is escaped) and the
decision's gauges on ``/metrics``. Each is built from the store when asked, in a worker thread, so it
agrees with ``gate report`` at the same moment and never holds the event loop that serves clients.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from html import escape

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse
from prometheus_client import Gauge

from flyspec.gate.data.store import GateStore
from flyspec.gate.report.decisions import Step, interval_path
from flyspec.gate.shadow.mirror import ShadowMetrics
from flyspec.gate.shadow.run import LiveDecision, ShadowRun

MAX_POINTS = 400
WIDTH, HEIGHT = 640, 260
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 12, 40
_GAUGES = (
    ("flyspec_shadow_interval_low", "Low end of the run's interval of the net difference."),
    ("flyspec_shadow_interval_high", "High end of the run's interval of the net difference."),
    ("flyspec_shadow_decision", "The run's decision: -1 FAIL, 0 INCONCLUSIVE, 1 PASS."),
    ("flyspec_shadow_labels_waiting", "Drawn pairs waiting for a person's gold label."),
    ("flyspec_shadow_judge_agreement", "The judge's agreement with gold (NaN before a label)."),
)


def add_run_routes(app: FastAPI, run: ShadowRun, metrics: ShadowMetrics) -> None:
    """Add /decision and /status for ``run``, and its decision gauges (updated per scrape) to ``metrics``."""
    gauges = [Gauge(name, help_text, registry=metrics.registry) for name, help_text in _GAUGES]

    async def current() -> LiveDecision:
        state = await asyncio.to_thread(run.decision)
        agreement = float("nan") if state.judge_agreement is None else state.judge_agreement
        values = (state.low, state.high, state.code, state.labels_waiting, agreement)
        for gauge, value in zip(gauges, values, strict=True):
            gauge.set(value)
        return state

    metrics.refresh = current

    @app.get("/decision")
    async def decision() -> JSONResponse:
        return JSONResponse((await current()).decision)

    def steps() -> list[Step]:  # the run's interval after each pair it counts, replayed from the store
        with GateStore(run.path) as store:
            return interval_path(store, run.run_id)

    @app.get("/status")
    async def status() -> HTMLResponse:
        state = await current()
        return HTMLResponse(status_page(run, state, await asyncio.to_thread(steps)))


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:+.1f} pts"


def status_page(run: ShadowRun, state: LiveDecision, steps: Sequence[Step] = ()) -> str:
    """The /status page: plain HTML with the interval over time as inline SVG, every value escaped."""
    d = state.decision
    margin = float(d.get("margin") or run.plan.margin)
    agreement = (
        "no gold label yet" if state.judge_agreement is None else f"{100 * state.judge_agreement:.0f}%"
    )
    shadow = run.registration.shadow
    claim = shadow.claim if shadow is not None else ""
    rows = [
        ("Decision", str(d.get("decision"))),
        ("Interval of the net difference", f"[{_pct(state.low)}, {_pct(state.high)}]"),
        (
            "Margin",
            f"-{100 * margin:.1f} pts (PASS once the low end is above it, FAIL once the high end is below)",
        ),
        ("Pairs stored", str(state.pairs)),
        ("Pairs the decision counts (in arrival order)", str(d.get("n"))),
        ("Alpha", str(d.get("alpha"))),
    ]
    if run.plan.judge is not None:
        label = f"flyspec gate label --store {run.path} --run {run.run_id}"
        rows += [
            ("Gold labels waiting", f"{state.labels_waiting} (give them with `{label}`)"),
            ("Judge agreement with gold", agreement),
        ]
    table = "".join(f"<tr><th>{escape(k)}</th><td>{escape(v)}</td></tr>" for k, v in rows)
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>flyspec gate shadow</title></head><body>"
        f"<h1>flyspec gate shadow: run {escape(run.run_id)}</h1><table>{table}</table>"
        "<h2>The interval against the margin, pair by pair</h2>"
        f"{interval_svg(steps, margin, f'The interval of run {run.run_id} against -margin')}"
        f"<h2>The claim</h2><p>{escape(claim)}</p>"
        f"<p>{escape(shadow.errors if shadow is not None else '')}</p></body></html>"
    )


def thinned(steps: Sequence[Step]) -> list[Step]:
    """At most ``MAX_POINTS`` steps: all of them, or the last step of each of ``MAX_POINTS`` equal buckets."""
    if len(steps) <= MAX_POINTS:
        return list(steps)
    size = len(steps) / MAX_POINTS
    return [steps[math.ceil((i + 1) * size) - 1] for i in range(MAX_POINTS)]


def interval_svg(steps: Sequence[Step], margin: float, title: str) -> str:
    """The band between the bounds after each pair, in points, against ``-margin`` and 0 (as SVG)."""
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
