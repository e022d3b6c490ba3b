"""The shadow app: an OpenAI-compatible proxy to the baseline, a mirror sink, /metrics and, for a
registered run, /decision (the decision object of ``gate report --json``) and /status (for a person).

Every /v1 request goes to the baseline and its answer goes back unchanged (server-sent events passed on as
they arrive); only after the client has the whole answer is a copy offered to the mirror. Copies from
nginx arrive at /mirror/v1/...; Envoy and Istio send theirs to /v1 with ``-shadow`` appended to the Host.
Both are answered 202 at once. /status plots the interval against the margin as inline SVG from the
report's own walk: the page loads nothing, and every text in it is escaped.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from html import escape

from aiohttp import ClientResponse
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, Gauge, generate_latest
from starlette.background import BackgroundTask
from yarl import URL

from flyspec.gate.data.store import GateStore
from flyspec.gate.report.decisions import Step, interval_path
from flyspec.gate.shadow.live import LiveDecision
from flyspec.gate.shadow.mirror import (
    UPSTREAM_ERRORS,
    BaselineCapture,
    Mirror,
    PairSink,
    ShadowMetrics,
    ShadowSettings,
    Skip,
)
from flyspec.gate.shadow.pairs import CHAT, COMPLETIONS, MIRROR, PROXY
from flyspec.gate.shadow.run import ShadowRun

# Hop-by-hop headers (RFC 9110 7.6.1) and those the HTTP layer sets itself are never copied across.
_HOP = {"connection", "keep-alive", "te", "trailer", "transfer-encoding", "upgrade", "host", "content-length"}
_HOP |= {"proxy-authenticate", "proxy-authorization", "proxy-connection"}
# Answers travel uncompressed from the upstream so the proxy can read the text it passes through.
_REQUEST_DROP = _HOP | {"accept-encoding"}
_RESPONSE_DROP = _HOP | {"date", "server"}
MAX_KEPT_ANSWER_BYTES = 8 << 20
"""A streamed answer longer than this is passed on but not kept for the mirror (``too_long``)."""
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


async def _on_loop(offer: Callable[..., None], *args: object) -> None:
    # A coroutine, so Starlette runs it on the event loop: a plain function would run in a worker thread,
    # and the mirror's asyncio queue is not thread-safe.
    offer(*args)


async def _forward(mirror: Mirror, request: Request, route: str, mirrored: bool) -> Response:
    """The request path: forward to the baseline, pass its answer on, then offer the copy (``mirrored``)."""
    raw = await request.body()
    # A copy sent by Envoy's request_mirror_policies or Istio (Host ends with -shadow); a copy of a
    # route that is not paired is dropped, not forwarded.
    if request.headers.get("host", "").rsplit(":", 1)[0].endswith("-shadow"):
        return _accept_copy(mirror, route, raw) if mirrored else Response(status_code=202)
    start = time.monotonic()
    baseline = mirror.baseline
    sent = {k: v for k, v in request.headers.items() if k.lower() not in _REQUEST_DROP}
    sent["accept-encoding"] = "identity"
    query = request.url.query
    url = URL(baseline.url(route) + (f"?{query}" if query else ""), encoded=True)  # as the client sent it
    try:
        upstream = await baseline.session.request(request.method, url, data=raw or None, headers=sent)
    except UPSTREAM_ERRORS as exc:
        return _bad_gateway(mirror, exc, mirrored)
    headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _RESPONSE_DROP}
    if upstream.headers.get("content-type", "").startswith("text/event-stream"):
        relay = _Relay(upstream, start, route, raw, mirror if mirrored else None)
        # The copy is offered after the last chunk: by the background task when the response ends, or
        # when the client hangs up (the official openai client closes the connection at `data: [DONE]`).
        background = BackgroundTask(_on_loop, relay.offer)
        return StreamingResponse(relay.chunks(), upstream.status, headers, background=background)
    try:
        body = await upstream.read()
    except UPSTREAM_ERRORS as exc:
        return _bad_gateway(mirror, exc, mirrored)
    finally:
        upstream.release()
    background = None
    if mirrored:
        capture = BaselineCapture(upstream.status, body, False, time.monotonic() - start)
        background = BackgroundTask(_on_loop, mirror.offer, route, raw, PROXY, capture)
    return Response(body, status_code=upstream.status, headers=headers, background=background)


def _bad_gateway(mirror: Mirror, exc: Exception, mirrored: bool) -> JSONResponse:
    if mirrored:
        mirror.metrics.skip(Skip.BASELINE_ERROR)
    message = f"flyspec gate shadow: the baseline did not answer ({type(exc).__name__}: {exc or 'no detail'})"
    return JSONResponse({"error": {"message": message, "type": "bad_gateway", "code": 502}}, status_code=502)


def _accept_copy(mirror: Mirror, route: str, raw: bytes) -> Response:
    """A mirrored copy: answered 202 at once; both arms are asked by the mirror's workers."""
    mirror.offer(route, raw, MIRROR, None)
    return JSONResponse({"status": "accepted"}, status_code=202)


class _Relay:
    """One streamed answer passed on chunk by chunk and kept for the mirror (None: not mirrored)."""

    def __init__(
        self, upstream: ClientResponse, start: float, route: str, raw: bytes, mirror: Mirror | None
    ) -> None:
        self.upstream, self.start, self.route, self.raw, self.mirror = upstream, start, route, raw, mirror
        self.kept: list[bytes] = []
        self.size = 0
        self.first: float | None = None
        self.finished = False

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.upstream.content.iter_any():
                if self.first is None:
                    self.first = time.monotonic() - self.start
                self.size += len(chunk)
                if self.size <= MAX_KEPT_ANSWER_BYTES:
                    self.kept.append(chunk)
                yield chunk
            self.finished = True
        finally:
            if not self.finished:
                self.offer()
            if self.finished:
                self.upstream.release()
            else:  # the client left: the baseline's connection is dropped, not reused mid-answer
                self.upstream.close()

    def offer(self) -> None:
        """Offer the copy once, or count why it cannot be paired (too long, or the client left early)."""
        mirror, self.mirror = self.mirror, None
        if mirror is None:
            return
        if self.size > MAX_KEPT_ANSWER_BYTES:
            mirror.metrics.skip(Skip.TOO_LONG)
        elif not self.finished and b"data: [DONE]" not in b"".join(self.kept[-3:]):
            mirror.metrics.skip(Skip.CLIENT_GONE)
        else:
            latency = time.monotonic() - self.start
            capture = BaselineCapture(self.upstream.status, b"".join(self.kept), True, latency, self.first)
            mirror.offer(self.route, self.raw, PROXY, capture)


def create_shadow_app(settings: ShadowSettings, sink: PairSink | ShadowRun) -> FastAPI:
    """The shadow process's app, handing every mirrored pair to ``sink``; a registered ``ShadowRun`` also
    starts and stops with the app, adds its routes, and stops the mirroring once it decides."""
    mirror = Mirror(settings, sink)
    run = sink if isinstance(sink, ShadowRun) else None
    if run is not None:
        mirror.budget.admitted = run.stored  # --max-pairs counts the pairs of earlier processes too
        run.on_decided = mirror.close

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if run is not None:
            await asyncio.to_thread(run.start)
        mirror.start()
        try:
            yield
        finally:
            await mirror.stop()
            if run is not None:
                await asyncio.to_thread(run.close)

    app = FastAPI(
        title="flyspec gate shadow", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )

    async def forward(request: Request) -> Response:
        """Chat and completions are mirrored; every other /v1 route (models, embeddings, ...) is passed on."""
        route = "/" + request.path_params["rest"]
        return await _forward(
            mirror, request, route, request.method == "POST" and route in (CHAT, COMPLETIONS)
        )

    # A plain Starlette route: the request path skips FastAPI's parameter solving, which cost a paced
    # stream about 0.4 ms of added latency in a minimal relay on loopback.
    app.add_route("/v1/{rest:path}", forward, methods=["GET", "POST", "PUT", "PATCH", "DELETE"])

    @app.post("/mirror/v1/chat/completions", status_code=202)
    async def mirror_chat(request: Request) -> Response:
        return _accept_copy(mirror, CHAT, await request.body())

    @app.post("/mirror/v1/completions", status_code=202)
    async def mirror_completions(request: Request) -> Response:
        return _accept_copy(mirror, COMPLETIONS, await request.body())

    @app.get("/health")
    async def health() -> PlainTextResponse:
        return PlainTextResponse("ok")

    refresh = _add_run_routes(app, run, mirror.metrics) if run is not None else None

    @app.get("/metrics")
    async def metrics() -> Response:
        if refresh is not None:
            await refresh()
        return Response(generate_latest(mirror.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _add_run_routes(
    app: FastAPI, run: ShadowRun, metrics: ShadowMetrics
) -> Callable[[], Awaitable[LiveDecision]]:
    """Add /decision and /status for ``run`` and its decision gauges to ``metrics``; returns what brings
    the gauges up to date from the run's live walk (before each scrape). /decision and /status build the
    report from the store when asked, in a worker thread, so they agree with ``gate report`` at that
    moment and never hold the event loop."""
    gauges = [Gauge(name, help_text, registry=metrics.registry) for name, help_text in _GAUGES]

    async def current() -> LiveDecision:
        state = await asyncio.to_thread(run.live)
        agreement = float("nan") if state.judge_agreement is None else state.judge_agreement
        values = (state.low, state.high, state.code, state.labels_waiting, agreement)
        for gauge, value in zip(gauges, values, strict=True):
            gauge.set(value)
        return state

    @app.get("/decision")
    async def decision() -> JSONResponse:
        return JSONResponse(await asyncio.to_thread(run.decision))

    def page() -> str:  # the report's decision and its walk replayed from the store: one moment's view
        with GateStore(run.path) as store:
            steps = interval_path(store, run.run_id)
        return status_page(run, run.decision(), run.live(), run.pairs.count(), steps)

    @app.get("/status")
    async def status() -> HTMLResponse:
        return HTMLResponse(await asyncio.to_thread(page))

    return current


def status_page(
    run: ShadowRun,
    decision: Mapping[str, object],
    live: LiveDecision,
    pairs: int,
    steps: Sequence[Step] = (),
) -> str:
    """The /status page: plain HTML with the interval over time as inline SVG, every value escaped."""
    d = decision
    margin, low, high, agreement = (d.get(k) for k in ("margin", "low", "high", "judge_agreement"))
    margin = margin if isinstance(margin, float) else run.plan.margin
    interval = "no pair counted yet"
    if isinstance(low, float) and isinstance(high, float):
        interval = f"[{100 * low:+.1f} pts, {100 * high:+.1f} pts]"
    agreement_text = f"{100 * agreement:.0f}%" if isinstance(agreement, float) else "no gold label yet"
    shadow = run.registration.shadow
    assert shadow is not None  # a shadow run registers its claim
    rows = [
        ("Decision", str(d.get("decision"))),
        ("Interval of the net difference", interval),
        (
            "Margin",
            f"-{100 * margin:.1f} pts (PASS once the low end is above it, FAIL once the high end is below)",
        ),
        ("Pairs stored", str(pairs)),
        ("Pairs the decision counts (in arrival order)", str(d.get("n"))),
        ("Alpha", str(d.get("alpha"))),
    ]
    if run.plan.judge is not None:
        label = f"flyspec gate label --store {run.path} --run {run.run_id}"
        rows += [
            ("Gold labels waiting", f"{live.labels_waiting} (give them with `{label}`)"),
            ("Judge agreement with gold", agreement_text),
        ]
    table = "".join(f"<tr><th>{escape(k)}</th><td>{escape(v)}</td></tr>" for k, v in rows)
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>flyspec gate shadow</title></head><body>"
        f"<h1>flyspec gate shadow: run {escape(run.run_id)}</h1><table>{table}</table>"
        "<h2>The interval against the margin, pair by pair</h2>"
        f"{interval_svg(steps, margin, f'The interval of run {run.run_id} against -margin')}"
        f"<h2>The claim</h2><p>{escape(shadow.claim)}</p><p>{escape(shadow.errors)}</p></body></html>"
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
