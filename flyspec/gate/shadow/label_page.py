"""The labelling page (`/label`): a FastAPI router over a judged run's gold-label queue, for people.

The page (static/label.html, label.js, label.css: no framework, nothing fetched from elsewhere) shows the
request and the two answers side by side, blind, and takes keys A / B / E (equal) / S (skip). Every answer
is hostile: the script renders it with ``textContent`` only, and the page's Content-Security-Policy lets no
inline script run. Whoever serves the router binds it (`flyspec gate label --web`, or the shadow process);
``label_router`` asks for ``token`` (header ``X-Label-Token`` or query ``token``) when one is given, and
``check_label_host`` refuses a non-loopback address without one. What the page reads and stores is
label_state.py's, on the same queue as `flyspec gate label` in the terminal.
"""

from __future__ import annotations

import ipaddress
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Body, Depends, HTTPException, Request
from fastapi.responses import FileResponse, JSONResponse

from flyspec.gate.data.labelling import request_texts
from flyspec.gate.data.store import GateStore, RunRecord
from flyspec.gate.shadow.label_state import LabelRefused, Progress, open_queue, state, submit

STATIC = Path(__file__).with_name("static")
ASSETS = {"label.js": "text/javascript", "label.css": "text/css"}
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'",
    "X-Content-Type-Options": "nosniff",
    # The token may ride in the page's address: never send it on to another site.
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) is this machine's loopback."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_label_host(host: str, token: str | None) -> None:
    """Refuse to serve the page off loopback without a token (ValueError naming the rule)."""
    if token is not None and not token.strip():
        raise ValueError("--label-token is empty: give a token or leave the option out")
    if not is_loopback(host) and token is None:
        raise ValueError(
            f"--host {host} is not loopback: the labelling page is then served only with --label-token TOKEN "
            "(anyone who reaches the port could otherwise read the traffic and label it)"
        )


def _guard(token: str | None) -> Callable[[Request], None]:
    def authorised(request: Request) -> None:
        if token is None:
            return
        given = request.headers.get("x-label-token") or request.query_params.get("token") or ""
        if not secrets.compare_digest(given.encode(), token.encode()):
            raise HTTPException(401, "the labelling page needs its token (?token=... or X-Label-Token)")

    return authorised


def label_router(
    store_path: str | Path,
    run_id: str | None,
    token: str | None,
    *,
    progress: Progress,
    requests: Callable[[RunRecord], dict[str, str]] = request_texts,
) -> APIRouter:
    """The labelling page and its JSON API under ``/label`` for run ``run_id`` of the store at
    ``store_path`` (the latest judged run when None). ``token``: required on the page and its API when
    given. ``progress``: the run's decision and label advice
    (``flyspec.gate.report.build.label_progress``; this layer does not import the report).
    ``requests``: the request text of each question by prompt hash (default: read from the run's
    datasets, as `gate label` does; the shadow process passes the stored traffic's)."""
    path = Path(store_path)
    router = APIRouter()
    # The page and its API need the token; the script and the style sheet are the same for everyone.
    guarded = [Depends(_guard(token))]

    @router.get("/label", include_in_schema=False, dependencies=guarded)
    def page() -> FileResponse:
        return FileResponse(STATIC / "label.html", media_type="text/html", headers=HEADERS)

    @router.get("/label/static/{name}", include_in_schema=False)
    def asset(name: str) -> FileResponse:
        if name not in ASSETS:
            raise HTTPException(404, f"no asset {name!r}")
        return FileResponse(STATIC / name, media_type=ASSETS[name], headers=HEADERS)

    @router.get("/label/api/queue", dependencies=guarded)
    def read(labeller: str = "") -> JSONResponse:
        """The pairs this labeller may label (waiting first) and the run's progress."""
        with GateStore(path) as store:
            view = state(path, open_queue(store, run_id, requests), labeller.strip(), progress)
        return JSONResponse(view, headers=HEADERS)

    @router.post("/label/api/labels", dependencies=guarded)
    def label(body: dict[str, Any] = Body(...)) -> JSONResponse:  # noqa: B008 - FastAPI's idiom
        """Store one label: ``{dataset, question_id, key: a|b|e, labeller, second}``; 409 when the pair
        does not wait for it, 400 for a malformed one."""
        with GateStore(path) as store:
            try:
                stored = submit(store, open_queue(store, run_id, requests), body)
            except LabelRefused as exc:
                return JSONResponse({"error": str(exc)}, 409, headers=HEADERS)
            except ValueError as exc:
                return JSONResponse({"error": str(exc)}, 400, headers=HEADERS)
            labeller = str(body["labeller"]).strip()
            view = state(path, open_queue(store, run_id, requests), labeller, progress)
            return JSONResponse({"stored": stored, **view}, headers=HEADERS)

    return router
