"""The shadow app: an OpenAI-compatible proxy to the baseline, a mirror sink, and /metrics.

Every /v1 request goes to the baseline and its answer goes back unchanged (server-sent events passed on as
they arrive); only after the client has the whole answer is a copy offered to the mirror. Copies from
nginx arrive at /mirror/v1/...; Envoy and Istio send theirs to /v1 with ``-shadow`` appended to the Host.
Both are answered 202 at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.background import BackgroundTask

from flyspec.gate.shadow.mirror import BaselineCapture, Mirror, PairSink, ShadowSettings, Skip
from flyspec.gate.shadow.pairs import CHAT, COMPLETIONS, MIRROR, PROXY
from flyspec.gate.shadow.run import ShadowRun
from flyspec.gate.shadow.status import add_run_routes

# Hop-by-hop headers (RFC 9110 7.6.1) and those the HTTP layer sets itself are never copied across.
_HOP = {"connection", "keep-alive", "te", "trailer", "transfer-encoding", "upgrade", "host", "content-length"}
_HOP |= {"proxy-authenticate", "proxy-authorization", "proxy-connection"}
# Answers travel uncompressed from the upstream so the proxy can read the text it passes through.
_REQUEST_DROP = _HOP | {"accept-encoding"}
_RESPONSE_DROP = _HOP | {"date", "server"}
MAX_KEPT_ANSWER_BYTES = 8 << 20
"""A streamed answer longer than this is passed on but not kept for the mirror (``too_long``)."""


def request_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """A client's request headers as forwarded upstream (authorization and content-type kept)."""
    out = {k: v for k, v in headers.items() if k.lower() not in _REQUEST_DROP}
    out["accept-encoding"] = "identity"
    return out


def response_headers(headers: httpx.Headers) -> dict[str, str]:
    """An upstream's response headers as passed back to the client (content-type kept)."""
    return {k: v for k, v in headers.items() if k.lower() not in _RESPONSE_DROP}


class _Proxy:
    """The request path: forwards to the baseline, passes its answer on, then offers the copy."""

    def __init__(self, mirror: Mirror) -> None:
        self.mirror = mirror

    async def forward(self, request: Request, route: str, mirrored: bool) -> Response:
        raw = await request.body()
        # A copy sent by Envoy's request_mirror_policies or Istio (Host ends with -shadow); a copy of a
        # route that is not paired is dropped, not forwarded.
        if request.headers.get("host", "").rsplit(":", 1)[0].endswith("-shadow"):
            return self.accept_copy(route, raw) if mirrored else Response(status_code=202)
        start = time.monotonic()
        baseline = self.mirror.baseline
        outgoing = baseline.client.build_request(
            request.method,
            baseline.url(route),
            content=raw or None,
            headers=request_headers(request.headers),
            params=request.query_params,
        )
        try:
            upstream = await baseline.client.send(outgoing, stream=True)
        except httpx.HTTPError as exc:
            return self._bad_gateway(exc, mirrored)
        headers = response_headers(upstream.headers)
        if upstream.headers.get("content-type", "").startswith("text/event-stream"):
            relay = _Relay(upstream, start, route, raw, self.mirror if mirrored else None)
            # The copy is offered after the last chunk: by the background task when the response ends, or
            # when the client hangs up (the official openai client closes the connection at `data: [DONE]`).
            background = BackgroundTask(relay.offer_after)
            return StreamingResponse(relay.chunks(), upstream.status_code, headers, background=background)
        try:
            body = await upstream.aread()
        except httpx.HTTPError as exc:
            return self._bad_gateway(exc, mirrored)
        finally:
            await upstream.aclose()
        background = None
        if mirrored:
            capture = BaselineCapture(upstream.status_code, body, False, time.monotonic() - start)
            background = BackgroundTask(self._offer, route, raw, capture)
        return Response(body, status_code=upstream.status_code, headers=headers, background=background)

    def _bad_gateway(self, exc: Exception, mirrored: bool) -> JSONResponse:
        if mirrored:
            self.mirror.metrics.skip(Skip.BASELINE_ERROR)
        message = (
            f"flyspec gate shadow: the baseline did not answer ({type(exc).__name__}: {exc or 'no detail'})"
        )
        return JSONResponse(
            {"error": {"message": message, "type": "bad_gateway", "code": 502}}, status_code=502
        )

    async def _offer(self, route: str, raw: bytes, capture: BaselineCapture) -> None:
        # A coroutine, so Starlette runs it on the event loop: a plain function would run in a worker
        # thread, and the mirror's asyncio queue is not thread-safe.
        self.mirror.offer(route, raw, PROXY, capture)

    def accept_copy(self, route: str, raw: bytes) -> Response:
        """A mirrored copy: answered 202 at once; both arms are asked by the mirror's workers."""
        self.mirror.offer(route, raw, MIRROR, None)
        return JSONResponse({"status": "accepted"}, status_code=202)


class _Relay:
    """One streamed answer passed on chunk by chunk and kept for the mirror (None: not mirrored)."""

    def __init__(
        self, upstream: httpx.Response, start: float, route: str, raw: bytes, mirror: Mirror | None
    ) -> None:
        self.upstream, self.start, self.route, self.raw, self.mirror = upstream, start, route, raw, mirror
        self.kept: list[bytes] = []
        self.size = 0
        self.first: float | None = None
        self.finished = False

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.upstream.aiter_raw():
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
            await self.upstream.aclose()

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
            capture = BaselineCapture(
                self.upstream.status_code, b"".join(self.kept), True, latency, self.first
            )
            mirror.offer(self.route, self.raw, PROXY, capture)

    async def offer_after(self) -> None:
        self.offer()


def create_shadow_app(settings: ShadowSettings, sink: PairSink | ShadowRun) -> FastAPI:
    """The shadow process's app, handing every mirrored pair to ``sink``; a registered ``ShadowRun`` also
    starts and stops with the app, adds its routes, and stops the mirroring once it decides."""
    mirror = Mirror(settings, sink)
    proxy = _Proxy(mirror)
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

    @app.api_route("/v1/{rest:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    async def forward(request: Request, rest: str) -> Response:
        """Chat and completions are mirrored; every other /v1 route (models, embeddings, ...) is passed on."""
        route = "/" + rest
        return await proxy.forward(request, route, request.method == "POST" and route in (CHAT, COMPLETIONS))

    @app.post("/mirror/v1/chat/completions", status_code=202)
    async def mirror_chat(request: Request) -> Response:
        return proxy.accept_copy(CHAT, await request.body())

    @app.post("/mirror/v1/completions", status_code=202)
    async def mirror_completions(request: Request) -> Response:
        return proxy.accept_copy(COMPLETIONS, await request.body())

    @app.get("/health")
    async def health() -> PlainTextResponse:
        return PlainTextResponse("ok")

    if run is not None:
        add_run_routes(app, run, mirror.metrics)

    @app.get("/metrics")
    async def metrics() -> Response:
        if mirror.metrics.refresh is not None:
            await mirror.metrics.refresh()
        return Response(generate_latest(mirror.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
