"""The routes a shadow run adds to the app: ``/decision`` (the decision object of ``gate report --json``
for this run, built by the report itself), ``/status`` (the run for a person: the interval against the
margin, the counts, the judge's agreement with gold, the claim in words) and the decision's gauges on
``/metrics``. /status plots the interval after each pair (status_plot.py). Each is built from the store
when asked, in a worker thread, so it agrees with ``gate report`` run at the same moment and never holds
the event loop that serves clients."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from html import escape

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse

from flyspec.gate.data.store import GateStore
from flyspec.gate.report.decisions import Step, interval_path
from flyspec.gate.shadow.metrics import ShadowMetrics
from flyspec.gate.shadow.run import LiveDecision, ShadowRun
from flyspec.gate.shadow.status_plot import interval_svg


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:+.1f} pts"


def interval_steps(run: ShadowRun) -> list[Step]:
    """The run's interval after each pair it counts, replayed from the store (the report's walk)."""
    with GateStore(run.path) as store:
        return interval_path(store, run.run_id)


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


def add_run_routes(app: FastAPI, run: ShadowRun, metrics: ShadowMetrics) -> None:
    """Add /decision and /status for ``run``, and its decision gauges to ``metrics``."""

    async def current() -> LiveDecision:
        state = await asyncio.to_thread(run.decision)
        metrics.show(state)
        return state

    metrics.track(current)

    @app.get("/decision")
    async def decision() -> JSONResponse:
        return JSONResponse((await current()).decision)

    @app.get("/status")
    async def status() -> HTMLResponse:
        state = await current()
        return HTMLResponse(status_page(run, state, await asyncio.to_thread(interval_steps, run)))
