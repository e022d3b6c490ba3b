"""Questions that earlier runs of a store used, and the alpha each comparison has already spent on them
(docs/gate.md, "Error spent once").

``--exclude-run`` leaves a run's questions out. The ledger keeps every route a user can take on the same
questions within the registered alpha: a fixed run, then a sequential continuation; a rerun under
another name; a tune after a run. Each of those is another look at the same comparison, and every look
that can say PASS spends error: a fixed run at alpha 0.025 followed by a sequential run at 0.025 on the
same questions says PASS for a candidate exactly at the margin about 3.3% of the time. So a comparison,
identified by its two arms (not by incidental sampling settings such as max_tokens), has one alpha
budget, registered by its first look (``alpha_budget``, default that look's alpha); a later look on
questions an earlier one used may spend only what is left. A sequential run is one look however often
it is resumed or extended (its confidence sequence holds at every number of questions).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from flyspec.gate.data.order import QuestionKey
from flyspec.gate.data.registration import comparison_plans
from flyspec.gate.data.store import GateStore, RunRecord

_SHOWN = 3
_EPSILON = 1e-12
LOOK_KINDS = ("gate", "tune")


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


def arm_identity(identity: dict[str, Any]) -> str:
    """An arm as the ledger tells arms apart: its registered identity without the model a server reported
    (a later look at the same server may word it differently)."""
    import json

    return json.dumps({k: v for k, v in identity.items() if k != "served_model"}, sort_keys=True)


@dataclass(frozen=True)
class Look:
    """One comparison tested by one run: the two arms' identities, the alpha it spent, the budget its run
    registered, and the questions it registered."""

    run_id: str
    name: str
    baseline: str
    candidate: str
    alpha: float
    budget: float
    questions: frozenset[QuestionKey]
    design: str


def looks(store: GateStore, run: RunRecord) -> list[Look]:
    """Every comparison ``run`` tests (none for a pilot or a calibration run)."""
    if run.kind not in LOOK_KINDS:
        return []
    arms = run.registration.get("arms", {})
    questions = frozenset((q.dataset, q.question_id) for q in store.questions(run.run_id))
    out = []
    for plan in comparison_plans(run.kind, run.registration):
        base, cand = arms.get(plan.baseline[0]), arms.get(plan.candidate[0])
        if not isinstance(base, dict) or not isinstance(cand, dict):
            continue
        family = run.registration.get("family", {}).get("alpha", 0.0)
        budget = float(run.registration.get("alpha_budget", family))
        out.append(
            Look(
                run.run_id,
                plan.name,
                arm_identity(base),
                arm_identity(cand),
                plan.alpha,
                max(budget, plan.alpha),
                questions,
                str(run.registration.get("design", "fixed")),
            )
        )
    return out


def check_alpha_left(
    store: GateStore,
    run_id: str,
    kind: str,
    registration: dict[str, Any],
    questions: Iterable[QuestionKey],
) -> None:
    """Refuse a run (``gate run`` or ``gate tune``) one of whose comparisons would spend more than its
    budget has left on questions that earlier runs of the store tested the same comparison on (runs
    registered before this one; a resume of a run is not another look)."""
    existing = store.get_run(run_id)
    born = existing.created_at if existing is not None else float("inf")
    keys = frozenset(questions)
    mine = RunRecord(run_id, kind, born, registration["margin"], registration["alpha"], 0, registration, {})
    for look in _new_looks(store, mine, keys):
        earlier = [
            (other, len(keys & other.questions))
            for r in store.runs()
            if r.run_id != run_id and r.created_at < born
            for other in looks(store, r)
            if (other.baseline, other.candidate) == (look.baseline, look.candidate) and keys & other.questions
        ]
        if not earlier:
            continue
        budget = min(o.budget for o, _ in earlier)
        spent = sum(o.alpha for o, _ in earlier)
        if spent + look.alpha <= budget + _EPSILON:
            continue
        raise ValueError(_refusal(store, run_id, look, earlier, budget, spent))


def _new_looks(store: GateStore, run: RunRecord, keys: frozenset[QuestionKey]) -> list[Look]:
    arms = run.registration.get("arms", {})
    out = []
    for plan in comparison_plans(run.kind, run.registration):
        base, cand = arms.get(plan.baseline[0]), arms.get(plan.candidate[0])
        if isinstance(base, dict) and isinstance(cand, dict):
            design = str(run.registration.get("design", "fixed"))
            args = (run.run_id, plan.name, arm_identity(base), arm_identity(cand), plan.alpha, plan.alpha)
            out.append(Look(*args, keys, design))
    return out


def _refusal(
    store: GateStore, run_id: str, look: Look, earlier: list[tuple[Look, int]], budget: float, spent: float
) -> str:
    listing = ", ".join(
        f"{o.run_id!r} ({o.design}, alpha {o.alpha:g}, {n} shared questions)" for o, n in earlier[:_SHOWN]
    )
    more = f" and {len(earlier) - _SHOWN} more" if len(earlier) > _SHOWN else ""
    excludes = " ".join(f"--exclude-run {o.run_id}" for o, _ in earlier)
    left = max(0.0, budget - spent)
    room = (
        f"--alpha {left:.4g} (what is left), or "
        if left > _EPSILON
        else "register a first run with --alpha-budget larger than its --alpha to keep room for a second "
        "look, or "
    )
    sequential = next((o for o, _ in earlier if o.design == "sequential"), None)
    resume = (
        f"rerun run {sequential.run_id!r} itself (a sequential run continues, or extends with a larger "
        "--max-questions, without spending more), or "
        if sequential is not None
        else ""
    )
    return (
        f"run {run_id!r} would test its {look.name!r} arm against the baseline on questions that earlier "
        f"run(s) {listing}{more} of {store.path} already tested the same two arms on: together they would "
        f"spend alpha {spent + look.alpha:.4g} of this comparison's {budget:g}, and every extra look makes a "
        "wrong PASS more likely than the alpha you registered (a fixed run and then a sequential run on "
        "the same questions, each at 0.025, reach about 0.033). Valid ways forward: "
        f"{resume}{room}test on questions those runs have not used (`{excludes}`)."
    )
