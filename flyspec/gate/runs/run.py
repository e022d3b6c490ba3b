"""The runner of every kind of run: plan -> register -> answer. ``gate run`` and ``gate pilot`` (``run``
here, which ``flyspec demo`` calls too) and ``gate tune`` with its calibration (flyspec/gate/runs/tune.py)
differ only in what they plan, register and answer, never in how.

The order of work is what makes the numbers trustworthy (docs/gate.md, "Running the gate"):

1. ``plan`` (flyspec/gate/runs/plan.py): every setting, arm, dataset row and reference answer is
   validated before the store is touched;
2. the store is locked (one writer process at a time) and the questions are chosen: the seeded order of
   flyspec/gate/data/questions.py, without the questions that pilots (and ``--exclude-run`` runs) used;
3. ``register``, before the first answer: margin, alpha, arms (an endpoint with the model its server
   reports), sampling, seeds, dataset and prompt hashes, and for a sequential run the method, the maximum
   number of questions and the order seed. A resume with other settings, or a comparison whose alpha the
   ledger has spent, is refused before any server is asked which model it serves;
4. ``answer``, per session: the executors start (an engine loads and warms up, outside the time budget),
   every arm answers at once in the registered order (flyspec/gate/runs/dispatch.py), each answer is
   graded in the main thread and committed the moment it arrives, and the store records why the session
   stopped, an error included;
5. a sequential run stops at the first crossing along the registered order (flyspec/gate/stats/monitor.py),
   at ``max_questions`` or at the time budget (answers already in flight are still stored), or at Ctrl-C
   (at once: answers in flight are dropped and asked again when the run continues).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

from flyspec.gate.arms.base import Executor
from flyspec.gate.arms.engine import size_for_work
from flyspec.gate.arms.registry import make_executors
from flyspec.gate.data.questions import Question
from flyspec.gate.data.spec import BASELINE, ComparisonPlan, Family, Gold, Registration
from flyspec.gate.data.store import GateStore, RunNotes
from flyspec.gate.grading.graders import sandbox_notes
from flyspec.gate.runs.exclusion import (
    carried_answers,
    carried_order,
    check_alpha_left,
    fixed_run,
    ledger,
    record_looks,
    used_questions,
)
from flyspec.gate.runs.judging import JudgedRunMonitor
from flyspec.gate.runs.plan import (
    ORDER_RULE,
    Chosen,
    Options,
    Plan,
    ask_served,
    choose,
    plan,
    registered,
    stored_served,
)
from flyspec.gate.runs.session import Session, SessionSettings, log
from flyspec.gate.runs.settings import ArmSpec, GateOptions
from flyspec.gate.stats.decide import SUPERPOPULATION
from flyspec.gate.stats.monitor import JUDGED_METHOD, Monitor, SequentialPlan

Lane = tuple[str, int]
GatePlan = Plan[GateOptions]
FAMILY_PROCEDURE = (
    "Bonferroni: each comparison is tested at its own share of alpha, and the shares add up to the run's "
    "alpha, so the chance of any wrong PASS or FAIL among them is at most alpha"
)

__all__ = ["RunResult", "describe_interrupt", "run", "run_gate", "run_pilot"]


@dataclass(frozen=True)
class RunResult:
    """How a call of ``run`` or ``tune`` ended: ``reason`` is ``complete``, ``boundary``,
    ``max_questions``, ``time_budget``, ``interrupted`` or ``error`` (the last three pause the run: the
    same call resumes it)."""

    run_id: str
    reason: str

    @property
    def interrupted(self) -> bool:
        return self.reason == "interrupted"


class Clock:
    """The answering time budget of one call, shared by every session of it."""

    def __init__(self, minutes: float | None) -> None:
        self.left = 60 * minutes if minutes is not None else None

    def spend(self, seconds: float) -> None:
        if self.left is not None:
            self.left -= seconds

    @property
    def out(self) -> bool:
        return self.left is not None and self.left <= 0


# ---------------------------------------------------------------------------- register, answer


def register(
    store: GateStore,
    planned: Plan[Options],
    run_id: str,
    registration: Registration,
    questions: Sequence[Question],
    executors: Sequence[Executor],
) -> bool:
    """Register ``run_id`` as ``registration`` (with the arms' identities) before its first answer, or
    check that its resume has these settings; True when it is new.

    First, on the served models the store recorded: a run's comparisons must have their alpha left in the
    ledger, a sequential run may continue past its maximum (the store records the extension), and a resume
    with other settings is refused. Then
    ``executors`` (and the judge) are asked what they serve, the ledger is checked again (a server's card
    may name the model behind an alias), the run is registered and its looks recorded in the ledger.
    """
    listed = registered(questions)
    registration = store.keeping_bets(run_id, registration)
    guessed = planned.identified(registration, stored_served(store, run_id))
    if registration.comparisons:
        check_alpha_left(store, run_id, guessed, questions)
    if guessed.sequential is not None and store.extend_sequential(run_id, guessed, listed):
        log(f"gate: run {run_id!r} continues to at most {len(questions)} questions")
    existing = store.get_run(run_id)
    extensions = existing.registered.extensions if existing is not None else ()
    store.check_resumable(run_id, replace(guessed, extensions=extensions), listed)
    final = replace(
        planned.identified(registration, ask_served(executors, planned.judge)), extensions=extensions
    )
    if registration.comparisons:
        check_alpha_left(store, run_id, final, questions)
    new = store.register(run_id, final, listed)
    record_looks(store, run_id)
    return new


def answer(
    store: GateStore,
    session: Session,
    executors: list[Executor],
    who: str,
    clock: Clock,
    detail: dict[str, str] | None = None,
    notes: Callable[[], RunNotes] | None = None,
) -> str:
    """Answer what ``session`` lacks with ``executors``, which are freed afterwards (so one engine is gone
    before the next one loads); returns why the session ended. The executors start (an engine loads and
    warms up, outside the time budget), the store records the session's start (and the run's ``notes``,
    facts the started executors know), then the session answers until done or stopped, and the store
    records why it stopped (``detail`` says which part of a tune), an error too."""
    run_id, monitor, detail = session.run_id, session.monitor, detail or {}
    try:
        if session.stopped and monitor is not None and monitor.stop is not None:
            stop = monitor.stop
            log(f"{who}: run {run_id!r} already stopped after {stop.stopped_at} questions; nothing to do")
            store.add_event(run_id, "stop", stop.reason, stop.stopped_at, {**detail, **session.stop_detail})
            return stop.reason
        if not any(session.jobs(ex) for ex in executors):
            store.add_event(run_id, "stop", "complete", detail=detail)
            return "complete"
        if clock.out:
            return "time_budget"
        for ex in executors:
            log(f"{who}: starting {ex.describe()}")
            ex.start()
        # After loading: a session's time from start to stop is answering time.
        store.add_event(run_id, "start", detail=detail)
        if notes is not None:
            store.update_notes(run_id, notes())
        reason = "error"
        try:
            reason = session.answer(executors)
        finally:
            why = session.reason or reason
            store.add_event(run_id, "stop", why, session.stopped_at, {**detail, **session.stop_detail})
        clock.spend(session.answering_s)
        return reason
    finally:
        executors.clear()
        gc.collect()


def population(store: GateStore, run_id: str, requested: str | None) -> str:
    """The claim a sequential run makes: as requested, else the one a registered run already makes (runs
    registered before the claim was a choice are ``finite``), else ``superpopulation``."""
    if requested is not None:
        return requested
    run = store.get_run(run_id)
    sequential = run.registered.sequential if run is not None else None
    return sequential.population if sequential is not None else SUPERPOPULATION


def announce_sandbox(graders: set[str], who: str) -> None:
    """Once at the start of a run with code questions: say which protections the code sandbox lacks here."""
    sandbox = sandbox_notes(graders)
    for missing in sandbox["missing"] if sandbox is not None else []:
        log(f"{who}: WARNING: the code sandbox runs without {missing}")


# ------------------------------------------------------------------------------ gate run, pilot


def run(options: GateOptions) -> RunResult:
    """Register (or resume) a gate run or pilot and answer what is not yet stored, until done or stopped."""
    planned = plan(options)
    run_id = options.name
    with GateStore(options.store) as store, store.lock(run_id):
        chosen = _choose(store, planned)
        if chosen.left_out_by:
            by = ", ".join(chosen.left_out_by)
            log(f"gate: leaving out {len(chosen.left_out)} questions used by run(s) {by}")
        claim = population(store, run_id, options.population)
        comparisons = _comparisons(options, chosen, claim, planned.gold)
        executors = make_executors(list(planned.arms.values()))
        # An engine's KV cache holds what this run can use, not max_num_seqs requests of max_model_len.
        size_for_work(executors, chosen.questions, options.max_tokens)
        registration = _registration(planned, chosen, comparisons)
        new = register(store, planned, run_id, registration, chosen.questions, executors)
        if chosen.carry is not None:
            _store_carried(store, run_id, chosen.carry, _lanes(planned), chosen.questions)
        clock = Clock(options.max_minutes)
        session = _session(store, planned, chosen, comparisons, clock)
        log(
            f"gate: run {run_id!r} {'registered' if new else 'resumed'} in {store.path} "
            f"({len(session.done)} of {session.total} answers stored; margin {options.margin}, alpha "
            f"{options.alpha}{', sequential' if registration.sequential else ''})"
        )
        announce_sandbox({q.grader for q in chosen.questions}, "gate")
        notes = partial(_notes, planned, executors)  # read once the executors started
        reason = answer(store, session, executors, "gate", clock, notes=notes)
    return RunResult(run_id, reason)


def _lanes(planned: GatePlan) -> list[Lane]:
    """Every arm once, or without a candidate (a noise pilot) the baseline twice."""
    if "candidate" in planned.arms:
        return [(name, 0) for name in planned.arms]
    return [("baseline", 0), ("baseline", 1)]


def _choose(store: GateStore, planned: GatePlan) -> Chosen:
    """The run's questions: the seeded order without every earlier pilot's (for a gate run) and
    --exclude-run's, led by the fixed run a sequential continuation carries (docs/gate.md, "Error spent
    once")."""
    options = planned.options
    existing = store.get_run(options.name)
    names = list(options.exclude_runs)
    used_questions(store, names)  # refuses a run the store does not hold
    if options.kind == "gate":
        born = existing.created_at if existing is not None else float("inf")
        names += [r.run_id for r in store.runs() if r.kind == "pilot" and r.created_at < born]
    names = [n for n in dict.fromkeys(names) if n != options.name]
    left_out = used_questions(store, names)
    chosen = choose(planned, left_out, names)
    carry = _carry(store, planned, chosen)
    if carry is None:
        return chosen
    return replace(choose(planned, left_out, names, carried_order(store, carry)), carry=carry)


def _carry(store: GateStore, planned: GatePlan, chosen: Chosen) -> str | None:
    """The fixed run whose answers a new sequential run (one candidate, no controls) carries: the ledger
    names one when that run is the only earlier look at the comparison on these questions."""
    o = planned.options
    existing = store.get_run(o.name)
    if existing is not None:
        return existing.registered.carries
    if o.kind != "gate" or not o.sequential or o.controls:
        return None
    claim = population(store, o.name, o.population)
    sequential = SequentialPlan(o.margin, o.alpha, chosen.pool, chosen.pool, o.question_order_seed, claim)
    budget = float(o.alpha_budget) if o.alpha_budget is not None else None
    guess = Registration(
        "gate", o.margin, o.alpha, alpha_budget=budget, design="sequential", sequential=sequential
    )
    guess = planned.identified(guess, stored_served(store, o.name))
    carry = ledger(store, o.name, guess, chosen.questions).carry
    return carry if carry is not None and fixed_run(store, carry) is not None else None


def _comparisons(
    options: GateOptions, chosen: Chosen, population: str, gold: Gold | None
) -> list[ComparisonPlan]:
    """The run's comparisons, the candidate's first: one per control too, each with its share of alpha. A
    judged run's sequence is the prediction-powered one at its gold-label rate."""
    if options.candidate is None:
        return []
    judged = (
        {"method": JUDGED_METHOD, "label_rate": gold.rate, "label_bet": gold.bet} if gold is not None else {}
    )
    n, order_seed = len(chosen.questions), options.question_order_seed

    def comparison(name: str, margin: float, alpha: float, role: str) -> ComparisonPlan:
        sequential = (
            SequentialPlan(margin, alpha, n, chosen.pool, order_seed, population, **judged)
            if options.sequential
            else None
        )
        return ComparisonPlan(name, BASELINE, (name, 0), margin, alpha, role, sequential)

    control_margin = options.control_margin if options.control_margin is not None else options.margin
    return [
        comparison("candidate", options.margin, options.candidate_alpha, "candidate"),
        *(
            comparison(name, control_margin, options.control_alpha_each, "control")
            for name in options.controls
        ),
    ]


def _registration(planned: GatePlan, chosen: Chosen, comparisons: list[ComparisonPlan]) -> Registration:
    """What a gate run or pilot registers before its first answer (the served models apart)."""
    o = planned.options
    registration = planned.registration(o.kind, chosen.questions)
    rule = ORDER_RULE
    if chosen.carry is not None:
        rule = (
            f"the questions of fixed run {chosen.carry!r} first, in its order (their answers carried), then "
            f"{ORDER_RULE}"
        )
    several = len(comparisons) > 1
    primary = comparisons[0] if several else None
    sequential = comparisons[0].sequential if comparisons else None
    pilot_mode = ("candidate" if "candidate" in planned.arms else "noise") if o.kind == "pilot" else None
    return replace(
        registration,
        # The candidate's margin and alpha stay the run's top-level ones for readers that know one
        # comparison; the family says how the run's alpha was split.
        margin=primary.margin if primary is not None else registration.margin,
        alpha=primary.alpha if primary is not None else registration.alpha,
        repeats=tuple(sorted({r for _, r in _lanes(planned)})),
        limit=o.limit,
        max_questions=o.max_questions,
        order=planned.order(chosen.pool, rule),
        excluded=planned.excluded(chosen.left_out_by, len(chosen.left_out)),
        design="sequential" if sequential is not None else "fixed",
        carries=chosen.carry,
        sequential=sequential,
        listed=tuple(comparisons) if several else (),
        family=Family(float(o.alpha), FAMILY_PROCEDURE) if several else None,
        pilot_mode=pilot_mode,
        gold=planned.gold,
    )


def _store_carried(
    store: GateStore, run_id: str, carry: str, lanes: list[Lane], questions: Sequence[Question]
) -> None:
    """Store the carried fixed run's answers in its continuation (once: a resume finds them stored)."""
    keys = {(q.dataset, q.id) for q in questions}
    have = store.answered_keys(run_id)
    records = [
        a
        for a in carried_answers(store, carry, lanes)
        if (a.dataset, a.question_id) in keys and (a.arm, a.repeat, a.dataset, a.question_id) not in have
    ]
    if records:
        store.add_answers(run_id, records)
        log(f"gate: run {run_id!r} carries {len(records)} answers of fixed run {carry!r} (counted once)")


def _session(
    store: GateStore, planned: GatePlan, chosen: Chosen, comparisons: list[ComparisonPlan], clock: Clock
) -> Session:
    questions = list(chosen.questions)
    order = [(q.dataset, q.id) for q in questions]
    monitors: dict[str, Monitor | JudgedRunMonitor] = {}
    for c in comparisons:
        if c.sequential is None:
            continue
        if planned.gold is not None:
            graders = {(q.dataset, q.id): q.grader for q in questions}
            monitors[c.name] = JudgedRunMonitor(order, c.sequential, c.lanes, planned.gold, graders)
        else:
            monitors[c.name] = Monitor(order, c.sequential, c.lanes)
    o = planned.options
    settings = SessionSettings.of(o, o.name, clock.left, judge=planned.judge, gold=planned.gold)
    return Session(store, settings, _lanes(planned), questions, monitors)


def _notes(planned: GatePlan, executors: list[Executor]) -> RunNotes:
    notes: RunNotes = {
        "arm_settings": {name: arm.public_dict() for name, arm in planned.arms.items()},
        "dataset_sources": {name: spec for name, (spec, _) in planned.datasets.items()},
        "executors": [ex.facts() for ex in executors],
    }
    sandbox = sandbox_notes({q.grader for _, qs in planned.datasets.values() for q in qs})
    if sandbox is not None:
        notes["code_sandbox"] = sandbox
    if planned.judge is not None:
        notes["judge_settings"] = planned.judge.public_dict()
    shared = [sorted(ex.arms) for ex in executors if ex.shared]
    if shared:
        notes["shared_engine"] = shared
        modes = {
            arm: mode
            for ex in executors
            if ex.shared
            for arm, mode in ex.facts().get("verification", {}).items()
        }
        words = {
            "engine": "the engine's verifier",
            "standard": "standard (lossless) verification",
            "target_only": "the target alone (lossless)",
            "draft_only": "the draft model alone",
        }
        notes["shared_engine_note"] = (
            "arms differing only in the verifier ran in one engine started with the lossy policy, their "
            "requests side by side in the same batches; each arm's requests were decoded by "
            + "; ".join(f"{arm}: {words.get(mode, mode)}" for arm, mode in sorted(modes.items()))
        )
    return notes


# ----------------------------------------------------------------------------------- public API


def run_gate(
    store: str | Path,
    datasets: str | Sequence[str],
    baseline: ArmSpec,
    candidate: ArmSpec,
    margin: float,
    alpha: float = 0.025,
    **settings: object,
) -> str:
    """Run (or resume) the paired gate of ``candidate`` against ``baseline``; returns the run id.

    Arms are dicts, JSON strings or JSON file paths (see flyspec.gate.arms). ``margin`` is the tolerated
    accuracy loss (0.02 = 2 points) and ``alpha`` the one-sided level; both are registered in the store
    before the first answer. ``settings`` are the other fields of ``GateOptions`` (``sequential``,
    ``max_questions``, ``max_minutes``, ``limit``, ``temperature``, ``max_tokens``, ``seed``, ``run_id``,
    ...).
    """
    options = GateOptions(store, datasets, baseline, margin, candidate, alpha=alpha, kind="gate", **settings)
    return run(options).run_id


def run_pilot(
    store: str | Path,
    datasets: str | Sequence[str],
    baseline: ArmSpec,
    margin: float,
    alpha: float = 0.025,
    *,
    candidate: ArmSpec | None = None,
    **settings: object,
) -> str:
    """Run a pilot; returns the run id. Without ``candidate``: the baseline twice (fresh seeds, nothing
    cached; refused at temperature 0 for batch-invariant engine arms, where it measures nothing). With
    ``candidate``: both arms once, to measure the candidate's flip rate. Later gate runs in the store leave
    its questions out. ``build_report`` turns it into a sample-size plan."""
    options = GateOptions(store, datasets, baseline, margin, candidate, alpha=alpha, kind="pilot", **settings)
    return run(options).run_id


def describe_interrupt(store_path: str | Path, run_id: str) -> str:
    """The line printed when a run is interrupted: how much is stored and how to resume."""
    with GateStore(store_path) as store:
        stored = len(store.answered_keys(run_id))
    return (
        f"interrupted: {stored} answers of run {run_id!r} are stored in {store_path}; "
        "rerun the same command to resume"
    )
