"""Questions that earlier runs of a store used, and the alpha each comparison has already spent on them
(docs/gate.md, "Error spent once"; the accounting is flyspec/gate/stats/spending.py).

``--exclude-run`` leaves a run's questions out. The ledger keeps every route a user can take on the same
questions within one alpha: a fixed run and then a sequential continuation, a rerun under another name, a
tune after a run. Each is another look at the same comparison, identified by its two arms' identities
(never by incidental sampling settings such as max_tokens), and every look that can say PASS spends
error: a fixed run at alpha 0.025 and then a sequential run at 0.025 on the same questions say PASS for a
candidate exactly at the margin about 3.3% of the time. A look is refused unless the budget its
comparison registered on those questions (``alpha_budget``, default the first look's alpha) has its alpha
left. A sequential run that continues a fixed run carries that run's answers (``carry``): they lead its
registered order and are stored in it, so they count once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from flyspec.gate.data.order import QuestionKey
from flyspec.gate.data.registration import ComparisonPlan, comparison_plans
from flyspec.gate.data.store import AnswerRecord, GateStore, RunRecord
from flyspec.gate.stats.spending import Look, NextLook, comparison_key, next_look


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


def _identity(identity: Any) -> dict[str, Any] | None:
    """An arm as the ledger tells arms apart: its registered identity without the model a server reported
    (a later look at the same server may word it differently)."""
    if not isinstance(identity, dict):
        return None
    return {k: v for k, v in identity.items() if k != "served_model"}


def _key(registration: dict[str, Any], plan: ComparisonPlan) -> str | None:
    arms = registration.get("arms", {})
    base, cand = _identity(arms.get(plan.baseline[0])), _identity(arms.get(plan.candidate[0]))
    return None if base is None or cand is None else comparison_key(base, cand)


def _look_kind(kind: str, registration: dict[str, Any]) -> str:
    return "tune" if kind == "tune" else str(registration.get("design", "fixed"))


def _budget(registration: dict[str, Any], plan: ComparisonPlan) -> float | None:
    budget = registration.get("alpha_budget")
    return max(float(budget), plan.alpha) if budget is not None else None


def store_looks(store: GateStore, before: float) -> dict[str, list[Look]]:
    """Every look of the store's gate and tune runs registered before ``before``, by comparison key,
    oldest first (a pilot or calibration run decides nothing and is no look)."""
    out: dict[str, list[Look]] = {}
    for run in store.runs():
        if run.created_at >= before or run.kind not in ("gate", "tune"):
            continue
        questions = frozenset((q.dataset, q.question_id) for q in store.questions(run.run_id))
        for plan in comparison_plans(run.kind, run.registration):
            key = _key(run.registration, plan)
            if key is None:
                continue
            kind = _look_kind(run.kind, run.registration)
            carries = run.registration.get("carries")
            look = Look(run.run_id, kind, plan.alpha, questions, _budget(run.registration, plan), carries)
            out.setdefault(key, []).append(look)
    return out


@dataclass(frozen=True)
class Ledger:
    """What the ledger says about a new run: per comparison name, what its look may do."""

    looks: dict[str, NextLook]

    @property
    def carry(self) -> str | None:
        """The fixed run the candidate's sequential continuation carries (None: nothing to carry)."""
        first = next(iter(self.looks.values()), None)
        return first.carry if first is not None else None


def ledger(
    store: GateStore, run_id: str, kind: str, registration: dict[str, Any], questions: Iterable[QuestionKey]
) -> Ledger:
    """The ledger's verdict on every comparison a run registers (a resumed run's own looks excluded)."""
    existing = store.get_run(run_id)
    born = existing.created_at if existing is not None else float("inf")
    earlier = store_looks(store, born)
    keys = frozenset(questions)
    looks: dict[str, NextLook] = {}
    for plan in comparison_plans(kind, registration):
        key = _key(registration, plan)
        if key is None:
            continue
        mine = [look for look in earlier.get(key, []) if look.run_id != run_id]
        looks[plan.name] = next_look(_look_kind(kind, registration), keys, mine, plan.alpha)
    return Ledger(looks)


def check_alpha_left(
    store: GateStore,
    run_id: str,
    kind: str,
    registration: dict[str, Any],
    questions: Iterable[QuestionKey],
) -> Ledger:
    """Refuse a run (``gate run`` or ``gate tune``) one of whose comparisons would spend more alpha than
    earlier looks at it on these questions left; returns the ledger's verdict otherwise."""
    verdict = ledger(store, run_id, kind, registration, questions)
    for name, look in verdict.looks.items():
        plan = next(p for p in comparison_plans(kind, registration) if p.name == name)
        if look.allowed and look.alpha >= plan.alpha - 1e-12:
            continue
        what = f"run {run_id!r} ({name} against the baseline)"
        if not look.allowed:
            raise ValueError(f"{what}: {look.message}")
        left = look.budget - look.spent
        raise ValueError(
            f"{what}: earlier look(s) {', '.join(repr(i) for i in look.earlier)} on these questions spent "
            f"{look.spent:g} of the comparison's error budget {look.budget:g}, so this look may spend at "
            f"most the {left:g} left: give --alpha at most {left:g}"
            + (f" (it then carries fixed run {look.carry!r}'s answers, counted once)" if look.carry else "")
            + ", or test on questions they have not used ("
            + " ".join(f"--exclude-run {i}" for i in look.earlier)
            + ")."
        )
    return verdict


def carried_answers(store: GateStore, carry: str, lanes: Sequence[tuple[str, int]]) -> list[AnswerRecord]:
    """The answers of fixed run ``carry`` in ``lanes``, to be stored in the continuation that carries them."""
    wanted = set(lanes)
    return [a for a in store.answers(carry) if (a.arm, a.repeat) in wanted]


def carried_order(store: GateStore, carry: str) -> list[QuestionKey]:
    """The registered order of the fixed run a continuation carries (its questions lead the new order)."""
    return [(q.dataset, q.question_id) for q in store.questions(carry)]


def fixed_run(store: GateStore, run_id: str) -> RunRecord | None:
    """``run_id`` if it is a fixed gate run of the store, else None."""
    run = store.get_run(run_id)
    if run is None or run.kind != "gate" or run.registration.get("design") != "fixed":
        return None
    return run
