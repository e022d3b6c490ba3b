"""Registering a run before its first answer (``register``): its settings, the arms' identities and its
questions, a resume with other settings refused, and the alpha ledger's checks (docs/gate.md, "Error spent
once"; the accounting is flyspec/gate/stats/spending.py, the records flyspec/gate/data/ledger.py): a run
whose comparisons' budgets lack its alpha is refused, and once registered its looks are recorded.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

from flyspec.gate.arms.base import Arm, Executor, Served
from flyspec.gate.arms.endpoint import OpenAIExecutor
from flyspec.gate.arms.judge import JUDGE_ARM, Judge
from flyspec.gate.data.ledger import (
    Entry,
    HasContent,
    UserLedger,
    comparison_key_of,
    look_claim,
    look_id,
    look_kind,
    question_key,
    run_entries,
    store_entries,
)
from flyspec.gate.data.questions import Question, QuestionKey
from flyspec.gate.data.spec import Registration
from flyspec.gate.data.store import GateStore, RegisteredQuestion, RunRecord
from flyspec.gate.runs.progress import log
from flyspec.gate.stats.decide import SUPERPOPULATION
from flyspec.gate.stats.spending import MAX_BUDGET, Look, NextLook, next_look


def register(
    store: GateStore,
    run_id: str,
    registration: Registration,
    questions: Sequence[Question],
    executors: Sequence[Executor],
    arms: Mapping[str, Arm],
    judge: Judge | None = None,
) -> bool:
    """Register ``run_id`` as ``registration`` before its first answer, or check that its resume has these
    settings; True when it is new. First on the served models the store recorded (the ledger's check, a
    sequential run's extension, a resume with other settings refused), then on what ``executors`` and the
    judge serve now (a server's card may name the model behind an alias); then its looks are recorded."""
    listed = [
        RegisteredQuestion(q.dataset, q.id, i, q.prompt_hash, q.answer, q.grader)
        for i, q in enumerate(questions)
    ]
    registration = store.keeping_bets(run_id, registration)
    guessed = identified(registration, arms, judge, stored_served(store, run_id))
    if registration.comparisons:
        check_alpha_left(store, run_id, guessed, questions)
    if guessed.sequential is not None and store.extend_sequential(run_id, guessed, listed):
        log(f"gate: run {run_id!r} continues to at most {len(questions)} questions")
    existing = store.get_run(run_id)
    extensions = existing.registered.extensions if existing is not None else ()
    store.check_resumable(run_id, replace(guessed, extensions=extensions), listed)
    final = replace(
        identified(registration, arms, judge, ask_served(executors, judge)), extensions=extensions
    )
    if registration.comparisons:
        check_alpha_left(store, run_id, final, questions)
    return commit(store, run_id, final, listed)


def commit(
    store: GateStore,
    run_id: str,
    registration: Registration,
    listed: list[RegisteredQuestion],
    holds_data: bool = False,
) -> bool:
    """Register ``run_id`` (its stored bets kept; a resume with other settings refused, as when answers
    exist when ``holds_data``: a shadow's mirrored pairs) and record its looks; True when it is new."""
    registration = store.keeping_bets(run_id, registration)
    if holds_data:
        store.check_resumable(run_id, registration, listed, holds_data=True)
    new = store.register(run_id, registration, listed)
    record_looks(store, run_id)
    return new


def stored_served(store: GateStore, run_id: str) -> Served:
    """The served models a registered run recorded (to check a resume before asking the servers); the
    judge's under the key ``judge``."""
    run = store.get_run(run_id)
    if run is None:
        return {JUDGE_ARM: None}
    reg = run.registered
    served: Served = {name: identity.get("served_model") for name, identity in reg.arms.items()}
    served[JUDGE_ARM] = dict(reg.judge.served_model) if reg.judge and reg.judge.served_model else None
    return served


def ask_served(executors: Iterable[Executor], judge: Judge | None = None) -> Served:
    """What every arm's server, and the judge's, reports serving now (ValueError when one does not serve
    the model named)."""
    served: Served = {}
    for ex in executors:
        served.update(ex.served_models())
    if judge is not None:
        served[JUDGE_ARM] = OpenAIExecutor(judge.endpoint).served_models()[JUDGE_ARM]
    return served


def identified(
    registration: Registration, arms: Mapping[str, Arm], judge: Judge | None, served: Served
) -> Registration:
    """``registration`` with each arm's identity, and the judge's, as registered: an endpoint's with the
    model ``served`` says its server serves."""
    identities = {name: arm.identity(served.get(name)) for name, arm in arms.items()}
    return replace(
        registration, arms=identities, judge=judge.identity(served.get(JUDGE_ARM)) if judge else None
    )


def population(store: GateStore, run_id: str, requested: str | None) -> str:
    """The claim a sequential run makes: as requested, else the one a registered run already makes (runs
    registered before the claim was a choice are ``finite``), else ``superpopulation``."""
    if requested is not None:
        return requested
    run = store.get_run(run_id)
    sequential = run.registered.sequential if run is not None else None
    return sequential.population if sequential is not None else SUPERPOPULATION


def store_carried(
    store: GateStore, run_id: str, carry: str, lanes: Sequence[tuple[str, int]], questions: Sequence[Question]
) -> None:
    """Store the carried fixed run's answers in its continuation (once: a resume finds them stored)."""
    keys = {(q.dataset, q.id) for q in questions}
    have = store.answered_keys(run_id)
    records = [
        a
        for a in store.answers(carry)
        if (a.arm, a.repeat) in lanes
        and (a.dataset, a.question_id) in keys
        and (a.arm, a.repeat, a.dataset, a.question_id) not in have
    ]
    if records:
        store.add_answers(run_id, records)
        log(f"gate: run {run_id!r} carries {len(records)} answers of fixed run {carry!r} (counted once)")


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


def _earlier(key: str, store: list[Entry], user: UserLedger, before: float, own: str | None) -> list[Look]:
    """The looks at comparison ``key`` registered before ``before``, from the store and the user's ledger
    (a look in both counted once, with the store's current path), oldest first, without ``own``."""
    found: dict[str, Entry] = {e.look.id: e for e in user.entries(key)}
    found.update({e.look.id: e for e in store if e.key == key})
    chosen = [e for e in found.values() if e.created_at < before and e.look.id != own]
    return [e.look for e in sorted(chosen, key=lambda e: (e.created_at, e.look.id))]


@dataclass(frozen=True)
class Ledger:
    """What the ledger says about a new run: per comparison name, what its look may do, and its key."""

    looks: dict[str, NextLook]
    keys: dict[str, str]
    path: Path

    @property
    def carry(self) -> str | None:
        """The fixed run the candidate's sequential continuation carries (None: nothing to carry)."""
        first = next(iter(self.looks.values()), None)
        return first.carry if first is not None else None


def ledger(
    store: GateStore,
    run_id: str,
    registration: Registration,
    questions: Iterable[HasContent],
    user: UserLedger | None = None,
) -> Ledger:
    """The ledger's verdict on every comparison a run registers (a resumed run's own look excluded)."""
    existing = store.get_run(run_id)
    before = existing.created_at if existing is not None else float("inf")
    own = look_id(existing) if existing is not None else None
    keys = frozenset(question_key(q) for q in questions)
    entries = store_entries(store)
    here = str(store.path.resolve())
    with nullcontext(user) if user is not None else UserLedger() as opened:
        looks: dict[str, NextLook] = {}
        names: dict[str, str] = {}
        for plan in registration.comparisons:
            key = comparison_key_of(registration, plan)
            if key is None:
                continue
            earlier = _earlier(key, entries, opened, before, own)
            budget = registration.alpha_budget
            if existing is not None and budget is not None:
                # A resume keeps the budget it registered; one above the cap (from before it) reads as it.
                budget = min(budget, max(plan.alpha, MAX_BUDGET))
            verdict = next_look(look_kind(registration), keys, earlier, plan.alpha, look_claim(plan), budget)
            if verdict.carry is not None and any(
                look.where != here for look in verdict.earlier if look.run_id == verdict.carry
            ):
                # Only a fixed run of this store can be carried: its answers are here.
                verdict = replace(verdict, carry=None)
            looks[plan.name], names[plan.name] = verdict, key
        return Ledger(looks, names, opened.path)


def check_alpha_left(
    store: GateStore,
    run_id: str,
    registration: Registration,
    questions: Iterable[HasContent],
    user: UserLedger | None = None,
) -> Ledger:
    """Refuse a run (``gate run`` or ``gate tune``) one of whose comparisons would spend more alpha than
    the earlier looks it is counted with left; returns the ledger's verdict otherwise."""
    verdict = ledger(store, run_id, registration, questions, user)
    for name, look in verdict.looks.items():
        plan = next(p for p in registration.comparisons if p.name == name)
        if look.allowed and look.alpha >= plan.alpha - 1e-12:
            continue
        what = f"run {run_id!r} ({name} against the baseline; alpha ledger {verdict.path})"
        if not look.allowed:
            raise ValueError(f"{what}: {look.message}")
        left = look.budget - look.spent
        raise ValueError(
            f"{what}: earlier look(s) at this comparison ("
            + ", ".join(repr(i) for i in look.earlier_ids)
            + f") spent {look.spent:g} of its error budget {look.budget:g}, so this look may spend at most "
            f"the {left:g} left: give --alpha at most {left:g}"
            + (f" (it then carries fixed run {look.carry!r}'s answers, counted once)." if look.carry else ".")
        )
    return verdict


def record_looks(store: GateStore, run_id: str) -> None:
    """After ``run_id`` is registered: check its looks again under the user ledger's write lock (a run
    registered meanwhile elsewhere counts), record them and every other look of the store in the user's
    ledger, and keep in the run's notes what the ledger said (once, at its first registration)."""
    run = store.get_run(run_id)
    if run is None or run.kind not in ("gate", "tune"):
        return
    questions = store.questions(run_id)
    with UserLedger() as user, user.exclusive():
        verdict = check_alpha_left(store, run_id, run.registered, questions, user)
        user.record(store_entries(store))
    if "ledger" not in run.notes:
        store.update_notes(run_id, {"ledger": _snapshot(run, verdict, run_entries(store, run))})


def _snapshot(run: RunRecord, verdict: Ledger, entries: list[Entry]) -> dict[str, object]:
    """What the report shows of the ledger: per comparison, the budget, what this look spends, and the
    earlier looks it was counted with (as the ledger saw them when the run was registered)."""
    mine = {e.comparison: e.look for e in entries}
    comparisons = {}
    for name, look in verdict.looks.items():
        own = mine.get(name)
        comparisons[name] = {
            "key": verdict.keys[name][:16],
            "claim": own.claim if own is not None else None,
            "alpha": own.alpha if own is not None else look.alpha,
            "budget": look.budget,
            "spent_before": look.spent,
            "earlier": [e.describe() for e in {e.id: e for e in look.earlier}.values()],
        }
    return {"path": str(verdict.path), "comparisons": comparisons}
