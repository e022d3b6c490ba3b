"""Questions that earlier runs of a store used: what ``--exclude-run`` leaves out, and the refusal to extend
a fixed run silently (docs/gate.md, "Fixed runs are not extended").

A fixed run is decided once, at its registered size. Registering a bigger fixed run with the same arms and
sampling over the same questions (``--run small --limit 20``, then ``--run bigger --limit 100``) would
decide again on answers already seen, with more questions added: the same optional stopping as adding
questions to the first run, which makes a wrong PASS more likely than alpha (docs/gate.md, "Why a fixed
design must not be re-tested after every question"). Such a run is refused unless ``--exclude-run``
leaves the earlier run's questions out; a user who wants evidence that may grow after a look runs
``--sequential``, whose confidence sequence holds at every number of questions.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from flyspec.gate.data.order import QuestionKey
from flyspec.gate.data.store import GateStore, RunRecord

_SHOWN = 3


def used_questions(store: GateStore, names: Sequence[str]) -> set[QuestionKey]:
    """The registered questions of the named runs; ValueError naming a run the store does not hold."""
    runs = [r.run_id for r in store.runs()]
    missing = [n for n in names if n not in runs]
    if missing:
        raise ValueError(
            f"--exclude-run {', '.join(missing)}: no such run in {store.path} "
            f"(runs: {', '.join(runs) or 'none'})"
        )
    return {(q.dataset, q.question_id) for n in names for q in store.questions(n)}


def _compared(registration: dict[str, Any]) -> dict[str, Any]:
    """What makes two runs the same comparison: the arms (without the model a server reported, which a
    later look at the same server may word differently) and the sampling."""
    arms = registration.get("arms", {})
    return {
        "arms": {
            name: {k: v for k, v in identity.items() if k != "served_model"}
            for name, identity in arms.items()
            if isinstance(identity, dict)
        },
        "sampling": registration.get("sampling"),
    }


def check_not_extended(
    store: GateStore, run_id: str, registration: dict[str, Any], questions: Iterable[QuestionKey]
) -> None:
    """Refuse a fixed run that would decide again on questions an earlier gate run of the store answered
    with the same arms and sampling (registered before this run; runs left out with ``--exclude-run`` no
    longer share questions with it)."""
    existing = store.get_run(run_id)
    born = existing.created_at if existing is not None else float("inf")
    keys = set(questions)
    mine = _compared(registration)
    earlier: list[tuple[RunRecord, int]] = []
    for other in store.runs():
        if other.run_id == run_id or other.kind != "gate" or other.created_at >= born:
            continue
        if _compared(other.registration) != mine:
            continue
        shared = keys & {(d, q) for _, _, d, q in store.answered_keys(other.run_id)}
        if shared:
            earlier.append((other, len(shared)))
    if not earlier:
        return
    listing = ", ".join(f"{r.run_id!r} ({n} questions)" for r, n in earlier[:_SHOWN])
    more = f" and {len(earlier) - _SHOWN} more" if len(earlier) > _SHOWN else ""
    excludes = " ".join(f"--exclude-run {r.run_id}" for r, _ in earlier)
    raise ValueError(
        f"fixed run {run_id!r} would answer questions that earlier run(s) {listing}{more} of {store.path} "
        "already answered with the same arms and sampling: deciding again on them after seeing a result, "
        "with questions added, is optional stopping and makes a wrong PASS more likely than alpha. Use "
        f"`{excludes}` to test on questions those runs have not used, or `--sequential` for a run whose "
        "evidence may grow validly after a look."
    )
