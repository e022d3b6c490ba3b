"""The labelling page (`/label`, docs/shadow.md): a FastAPI router over a judged run's gold-label queue, the
one `flyspec gate label` works on (flyspec/gate/data/results.py). Pairs are shown blind, in the order the
run's seeded coin drew; every answer is hostile (static/label.js renders it as text only, and the
Content-Security-Policy lets no inline script run). A pair's first label is its gold label; a second
person's is stored beside it as agreement, never part of the decision.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from fastapi import APIRouter, Body, Depends, HTTPException, Request
from fastapi.responses import FileResponse, JSONResponse

from flyspec.checks import is_loopback
from flyspec.gate.data.results import PendingPair, drawn, gold_rule, record, record_second, request_texts
from flyspec.gate.data.store import GateStore, LabelRecord, RunRecord
from flyspec.gate.grading.graders import JUDGE
from flyspec.gate.report.build import LabelProgress
from flyspec.gate.shadow.pairs import SqlitePairStore

STATIC = Path(__file__).with_name("static")
ASSETS = {"label.js": "text/javascript", "label.css": "text/css"}
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'",
    "X-Content-Type-Options": "nosniff",
    # The token may ride in the page's address: never send it on to another site.
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
KEYS = {"a": "a", "b": "b", "e": "t"}
"""The page's keys and the label each stores: A better, B better, E equally good (``t`` in the store)."""

Progress = Callable[[Path, str], LabelProgress]
"""The run's decision and label advice by store path and run name (``label_progress``)."""


class LabelRefused(ValueError):
    """A label the queue does not take (the page answers it 409 with this message)."""


@dataclass(frozen=True)
class Queue:
    """One look at a run's drawn pairs, in order, by (dataset, question id): each with its gold label (None:
    it waits); and the second labels."""

    run: RunRecord
    pairs: dict[tuple[str, str], tuple[PendingPair, LabelRecord | None]]
    seconds: list[LabelRecord]


def open_queue(
    store: GateStore, run_id: str | None, requests: Callable[[RunRecord], dict[str, str]]
) -> Queue:
    """The queue of ``run_id`` (the latest judged run when None), with its requests' texts."""
    run, gold = gold_rule(store, run_id)
    pairs = {
        (p.question.dataset, p.question.question_id): (p, label)
        for p, label in drawn(store, run, gold, requests(run))
    }
    return Queue(run, pairs, store.second_labels(run.run_id))


def label_requests(path: str | Path) -> Callable[[RunRecord], dict[str, str]]:
    """A run's request texts by prompt hash: its datasets' and, for a live-traffic run, its pairs'."""

    def requests(run: RunRecord) -> dict[str, str]:
        texts = request_texts(run)
        if run.registered.shadow is None:
            return texts
        pairs = SqlitePairStore(path, run.run_id)
        try:
            questions = [pair.question(JUDGE) for pair in pairs.pairs()]
        finally:
            pairs.close()
        for q in questions:
            turns = (f"[{m['role']}] {m['content']}" for m in q.messages or [])
            texts[q.prompt_hash] = q.prompt if q.prompt is not None else "\n".join(turns)
        return texts

    return requests


def _pair_view(pair: PendingPair, mode: str) -> dict[str, object]:
    q = pair.question
    return {
        "dataset": q.dataset,
        "question_id": q.question_id,
        "position": q.position,
        "request": pair.request,
        "reference": pair.reference,
        "a": pair.answer_a,
        "b": pair.answer_b,
        "mode": mode,
    }


def _progress(store_path: Path, queue: Queue, decision: Progress) -> dict[str, object]:
    # more_labels is None when the advice needs a higher label rate than the run's draw can give.
    first = {key: label for key, (_, label) in queue.pairs.items() if label is not None}
    reading = decision(store_path, queue.run.run_id)
    needed, rate, gold_rate = reading["labels_needed"], reading["advised_rate"], reading["gold_rate"]
    more = None
    if needed is not None and rate is not None and gold_rate is not None and rate <= gold_rate:
        more = max(0, needed - len(first))
    twice = agreed = 0
    for second in queue.seconds:
        gold = first.get((second.dataset, second.question_id))
        if gold is not None and gold.pair_sha256 == second.pair_sha256:
            twice += 1
            agreed += gold.value == second.value
    return {
        "run": queue.run.run_id,
        "labelled": len(first),
        "waiting": len(queue.pairs) - len(first),
        **reading,
        "more_labels": more,
        "labellers": {"twice": twice, "agreed": agreed},
    }


def state(store_path: Path, queue: Queue, labeller: str, decision: Progress) -> dict[str, object]:
    """The pairs ``labeller`` may label (those waiting first, then pairs someone else labelled, for a
    second label) and the progress."""
    done = {(s.dataset, s.question_id) for s in queue.seconds if s.detail.get("labeller") == labeller}
    waiting, second = [], []
    for key, (pair, label) in queue.pairs.items():
        if label is None:
            waiting.append(_pair_view(pair, "gold"))
        elif label.detail.get("labeller") != labeller and key not in done:
            second.append(_pair_view(pair, "second"))
    return {"pairs": waiting + second, "progress": _progress(store_path, queue, decision)}


def submit(store: GateStore, queue: Queue, body: Mapping[str, object]) -> str:
    """Store one label from the page; returns which kind was stored (``gold`` or ``second``)."""
    dataset, question_id = str(body.get("dataset", "")), str(body.get("question_id", ""))
    key, labeller, second = body.get("key"), str(body.get("labeller", "")).strip(), bool(body.get("second"))
    if not isinstance(key, str) or key not in KEYS:
        raise ValueError(f"key {key!r}: a (A is better), b (B is better) or e (equally good)")
    if not labeller or len(labeller) > 80:
        raise ValueError("labeller: give your name (1 to 80 characters); it is stored with each label")
    where = f"pair {dataset}/{question_id}"
    if (dataset, question_id) not in queue.pairs:
        raise LabelRefused(
            f"{where} is not waiting for a label: the run did not draw it for a gold label, or its two "
            "answers are missing or identical"
        )
    pair, gold = queue.pairs[(dataset, question_id)]
    if gold is None:
        if second:
            raise LabelRefused(f"{where} has no gold label yet: label it first, not a second time")
        if record(store, queue.run, pair, KEYS[key], labeller) is None:
            raise LabelRefused(f"{where} was labelled meanwhile; reload for the next pair")
        return "gold"
    by = gold.detail.get("labeller", "someone in the terminal")
    if not second:
        raise LabelRefused(
            f"{where} is not waiting: {by} labelled it already (a label is never replaced); it is offered "
            "again as a second label"
        )
    if by == labeller or not record_second(store, queue.run, pair, KEYS[key], labeller):
        raise LabelRefused(f"{where}: {labeller} labelled it already")
    return "second"


def check_label_host(host: str, token: str | None) -> None:
    """Refuse to serve the page off loopback without a token (ValueError naming the rule)."""
    if token is not None and not token.strip():
        raise ValueError("--label-token is empty: give a token or leave the option out")
    if not is_loopback(host) and token is None:
        raise ValueError(
            f"--host {host} is not loopback: the labelling page is then served only with --label-token TOKEN "
            "(anyone who reaches the port could otherwise read the traffic and label it)"
        )


def label_router(
    store_path: str | Path,
    run_id: str | None,
    token: str | None,
    *,
    progress: Progress,
    requests: Callable[[RunRecord], dict[str, str]] = request_texts,
) -> APIRouter:
    """The labelling page and its JSON API under ``/label`` for run ``run_id`` of the store (the latest
    judged run when None), asking for ``token`` when one is given."""
    path = Path(store_path)
    router = APIRouter()

    def authorised(request: Request) -> None:
        given = request.headers.get("x-label-token") or request.query_params.get("token") or ""
        if token is not None and not secrets.compare_digest(given.encode(), token.encode()):
            raise HTTPException(401, "the labelling page needs its token (?token=... or X-Label-Token)")

    # The page and its API need the token; the script and the style sheet are the same for everyone.
    guarded = [Depends(authorised)]

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
    def label(body: dict[str, object] = Body(...)) -> JSONResponse:
        """Store one label: ``{dataset, question_id, key: a|b|e, labeller, second}``."""
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
