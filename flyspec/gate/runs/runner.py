"""Run the paired gate: validate, lock the store, register, then answer until done or stopped.

The order of work is what makes the numbers trustworthy (docs/gate.md, "Running the gate"):

1. every setting, arm, dataset row and reference answer is validated before the store is touched;
2. the store is locked (one writer process at a time) and the questions are chosen: the seeded order of
   flyspec/gate/data/order.py, without the questions that pilots (and ``--exclude-run`` runs) used;
3. the run is registered before the first answer: margin, alpha, arms (an endpoint with the model its
   server reports), sampling, seeds, dataset and prompt hashes, and for a sequential run the method, the
   maximum number of questions and the order seed; a resume with other settings is refused;
4. every arm answers at once, in the registered order (flyspec/gate/runs/dispatch.py); each answer is
   graded in the main thread and committed the moment it arrives;
5. a sequential run stops at the first crossing along the registered order (flyspec/gate/stats/monitor.py), at
   ``max_questions`` or at the time budget (answers already in flight are still stored), or at Ctrl-C
   (at once: answers in flight are dropped and asked again when the run continues).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from flyspec.gate.arms.base import Executor
from flyspec.gate.arms.judge import JUDGE_ARM, Judge, parse_judge
from flyspec.gate.arms.registry import make_executors
from flyspec.gate.data.datasets import Question
from flyspec.gate.data.gold import DEFAULT_GOLD_RATE, Gold
from flyspec.gate.data.order import QuestionKey
from flyspec.gate.data.registration import BASELINE, ComparisonPlan, Extension, Family, Registration
from flyspec.gate.data.store import GateStore, RegisteredQuestion
from flyspec.gate.grading.graders import model_graded_names, sandbox_notes
from flyspec.gate.runs import loop
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
from flyspec.gate.runs.loop import Served, announce_sandbox
from flyspec.gate.runs.options import ArmSpec, GateOptions
from flyspec.gate.runs.plan import ORDER_RULE, Plan, plan
from flyspec.gate.runs.session import Session, SessionSettings, log
from flyspec.gate.stats.monitor import JUDGED_METHOD, SequentialMonitor, SequentialPlan

Lane = tuple[str, int]
GatePlan = Plan[GateOptions]
Excluded = tuple[set[QuestionKey], list[str]]
"""The questions left out of a run and the runs that used them."""
FAMILY_PROCEDURE = (
    "Bonferroni: each comparison is tested at its own share of alpha, and the shares add up to the run's "
    "alpha, so the chance of any wrong PASS or FAIL among them is at most alpha"
)

__all__ = ["RunResult", "describe_interrupt", "run", "run_gate", "run_pilot"]


@dataclass(frozen=True)
class RunResult:
    """How a call of ``run`` ended: ``reason`` is ``complete``, ``boundary``, ``max_questions``,
    ``time_budget`` or ``interrupted`` (the last two pause the run: the same call resumes it)."""

    run_id: str
    reason: str

    @property
    def interrupted(self) -> bool:
        return self.reason == "interrupted"


# ------------------------------------------------------------------------------------ planning


def _plan(options: GateOptions) -> GatePlan:
    """The run's plan: its arms (the baseline, the candidate, the controls), its datasets, and for a run
    with model-graded questions (or ``judge_all``) the judge and the gold-label rule."""
    arms: dict[str, ArmSpec] = {"baseline": options.baseline}
    if options.candidate is not None:
        arms["candidate"] = options.candidate
    arms.update(options.controls)
    planned = plan(options, arms)
    if (
        "candidate" not in planned.arms
        and options.temperature == 0
        and planned.arms["baseline"].greedy_repeats
    ):
        raise ValueError(
            "gate pilot at temperature 0 would run the baseline twice and measure nothing: in "
            "batch-invariant mode this engine's greedy decoding gives the same answers both times. "
            "To plan a run, pilot the candidate instead: `flyspec gate pilot --candidate ARM ...` "
            "runs both arms once on questions that later `gate run`s leave out, and measures the "
            "candidate's flip rate. "
            "(To measure sampling noise, give --temperature > 0.)"
        )
    judge = _judge(options, planned)
    return replace(planned, judge=judge, gold=_gold(options, judge))


def _lanes(plan: GatePlan) -> list[Lane]:
    """Every arm once, or without a candidate (a noise pilot) the baseline twice."""
    if "candidate" in plan.arms:
        return [(name, 0) for name in plan.arms]
    return [("baseline", 0), ("baseline", 1)]


def _mode(plan: GatePlan) -> str | None:
    """For a pilot: ``noise`` (the baseline twice) or ``candidate`` (both arms once)."""
    if plan.options.kind != "pilot":
        return None
    return "candidate" if "candidate" in plan.arms else "noise"


def _judge(options: GateOptions, plan: GatePlan) -> Judge | None:
    """The run's judge: given exactly when some question is graded by a model (or with judge_all)."""
    judged = plan.model_graded()
    judge = parse_judge(options.judge) if options.judge is not None else None
    if judged and judge is None:
        name, grader = judged[0]
        raise ValueError(
            f"dataset {name!r} has questions with grader {grader!r}: give the judge endpoint with --judge "
            '\'{"base_url": "http://HOST:PORT/v1", "model": "NAME"}\''
        )
    if judge is not None and not judged and not options.judge_all:
        graders = " or ".join(repr(name) for name in model_graded_names())
        raise ValueError(
            f"--judge: no question of the run has grader {graders}, so there is nothing to judge "
            "(--judge-all has the judge grade every question, each question's own grader labelling the drawn "
            "pairs)"
        )
    if options.judge_all and judged:
        name, grader = judged[0]
        raise ValueError(
            f"--judge-all: dataset {name!r} has questions with grader {grader!r}, which have no exact "
            "grader to label the drawn pairs; run them in a judged run of their own (labelled with `flyspec "
            "gate label`)"
        )
    return judge


def _gold(options: GateOptions, judge: Judge | None) -> Gold | None:
    """A judged run's gold-label rule: exact (each question's own grader) with judge_all, else a person."""
    if judge is None:
        return None
    rate = options.gold_rate if options.gold_rate is not None else DEFAULT_GOLD_RATE
    return Gold(rate, options.seed, "exact" if options.judge_all else "human", options.judge_all)


def _excluded(store: GateStore, plan: GatePlan) -> Excluded:
    """Questions left out of this run: every earlier pilot's (for a gate run) and --exclude-run's."""
    options = plan.options
    existing = store.get_run(options.name)
    names = list(options.exclude_runs)
    used_questions(store, names)  # refuses a run the store does not hold
    if options.kind == "gate":
        born = existing.created_at if existing is not None else float("inf")
        names += [r.run_id for r in store.runs() if r.kind == "pilot" and r.created_at < born]
    names = [n for n in dict.fromkeys(names) if n != options.name]
    return used_questions(store, names), names


def _choose(plan: GatePlan, store: GateStore) -> tuple[list[Question], int, Excluded, str | None]:
    """The questions in their registered order, the pool size, what was left out, and the fixed run a
    sequential continuation carries (its questions lead the order; docs/gate.md, "Error spent once")."""
    o = plan.options
    excluded = _excluded(store, plan)
    pool = plan.pool(excluded[0], o.limit)
    carry = _carry(store, plan, pool)
    if carry is not None:
        first = {key: i for i, key in enumerate(carried_order(store, carry))}
        led = sorted((q for q in pool if (q.dataset, q.id) in first), key=lambda q: first[(q.dataset, q.id)])
        pool = led + [q for q in pool if (q.dataset, q.id) not in first]
    if o.max_questions is not None and o.max_questions > len(pool):
        raise ValueError(
            f"max_questions={o.max_questions}: the datasets hold {len(pool)} questions"
            + (
                f" once the {len(excluded[0])} used by {', '.join(excluded[1])} are left out"
                if excluded[1]
                else ""
            )
        )
    questions = pool[: o.max_questions] if o.max_questions is not None else pool
    return questions, len(pool), excluded, carry


def _carry(store: GateStore, plan: GatePlan, pool: list[Question]) -> str | None:
    """The fixed run whose answers a new sequential run (one candidate, no controls) carries: the ledger
    names one when that run is the only earlier look at the comparison on these questions."""
    o = plan.options
    existing = store.get_run(o.name)
    if existing is not None:
        return existing.registered.carries
    if o.kind != "gate" or not o.sequential or o.controls:
        return None
    claim = loop.population(store, o.name, o.population)
    sequential = SequentialPlan(o.margin, o.alpha, len(pool), len(pool), o.question_order_seed, claim)
    identities = loop.identities(plan.arms, loop.stored_served(store, o.name))
    budget = float(o.alpha_budget) if o.alpha_budget is not None else None
    guess = Registration(
        "gate",
        o.margin,
        o.alpha,
        arms=identities,
        alpha_budget=budget,
        design="sequential",
        sequential=sequential,
    )
    carry = ledger(store, o.name, guess, pool[: o.max_questions]).carry
    return carry if carry is not None and fixed_run(store, carry) is not None else None


def _comparisons(
    options: GateOptions, questions: list[Question], pool: int, population: str, gold: Gold | None
) -> list[ComparisonPlan]:
    """The run's comparisons, the candidate's first: one per control too, each with its share of alpha. A
    judged run's sequence is the prediction-powered one at its gold-label rate."""
    if options.candidate is None:
        return []
    judged = {"method": JUDGED_METHOD, "label_rate": gold.rate} if gold is not None else {}

    def comparison(name: str, margin: float, alpha: float, role: str) -> ComparisonPlan:
        order_seed = options.question_order_seed
        sequential = (
            SequentialPlan(margin, alpha, len(questions), pool, order_seed, population, **judged)
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


# -------------------------------------------------------------------------------- registration


@dataclass(frozen=True)
class _Chosen:
    """The questions a run registers, from how large a pool, without which, and its comparisons (none
    for a pilot)."""

    questions: list[Question]
    pool: int
    excluded: Excluded
    comparisons: list[ComparisonPlan]
    carry: str | None = None

    @property
    def sequential(self) -> SequentialPlan | None:
        """The candidate's sequential plan (None for a fixed run or a pilot)."""
        return self.comparisons[0].sequential if self.comparisons else None


def _registration(plan: GatePlan, chosen: _Chosen, served: Served) -> Registration:
    """What the run registers before its first answer, with the served models ``served``."""
    o = plan.options
    registration = plan.registration(o.kind, served, chosen.questions)
    rule = ORDER_RULE
    if chosen.carry is not None:
        rule = (
            f"the questions of fixed run {chosen.carry!r} first, in its order (their answers carried), then "
            f"{ORDER_RULE}"
        )
    several = len(chosen.comparisons) > 1
    primary = chosen.comparisons[0] if several else None
    return replace(
        registration,
        # The candidate's margin and alpha stay the run's top-level ones for readers that know one
        # comparison; the family says how the run's alpha was split.
        margin=primary.margin if primary is not None else registration.margin,
        alpha=primary.alpha if primary is not None else registration.alpha,
        repeats=tuple(sorted({r for _, r in _lanes(plan)})),
        limit=o.limit,
        max_questions=o.max_questions,
        order=plan.order(chosen.pool, rule),
        excluded=plan.excluded(chosen.excluded[1], len(chosen.excluded[0])),
        design="sequential" if chosen.sequential is not None else "fixed",
        carries=chosen.carry,
        sequential=chosen.sequential,
        listed=tuple(chosen.comparisons) if several else (),
        family=Family(float(o.alpha), FAMILY_PROCEDURE) if several else None,
        pilot_mode=_mode(plan),
        judge=plan.judge.identity(served.get(JUDGE_ARM)) if plan.judge is not None else None,
        gold=plan.gold,
    )


def _extend(
    store: GateStore, plan: GatePlan, chosen: _Chosen, questions: list[RegisteredQuestion]
) -> Callable[[Registration], tuple[Extension, ...]]:
    """The check a resume makes first: a fixed gate run may not grow, a sequential run may (it records
    the extension); returns ``amend`` for ``loop.register``."""
    options = plan.options
    run_id = options.name

    def amend(guessed: Registration) -> tuple[Extension, ...]:
        _refuse_defective_draw(store, run_id)
        if options.kind == "gate":
            check_alpha_left(store, run_id, guessed, chosen.questions)
        if chosen.sequential is not None and store.extend_sequential(run_id, guessed, questions):
            log(f"gate: run {run_id!r} continues to at most {len(chosen.questions)} questions")
        run = store.get_run(run_id)
        return run.registered.extensions if run is not None else ()

    return amend


def _refuse_defective_draw(store: GateStore, run_id: str) -> None:
    """A judged run registered with gold-label draw 1 is not continued: its drawn pairs are a prefix of
    the order, so more answers would only add pairs that the judge decides uncorrected."""
    existing = store.get_run(run_id)
    gold = existing.registered.gold if existing is not None else None
    if gold is not None and gold.defective:
        raise ValueError(
            f"run {run_id!r} in {store.path} was registered with gold-label draw 1, which drew exactly the "
            "pairs at the start of the question order (it hashed the same string as the order), so its "
            "decision is not a valid test and it cannot be continued. `flyspec gate report` still shows its "
            "stored decision, under a warning; start a new judged run (another --run name), which draws its "
            "gold labels independently of the order."
        )


def _register(store: GateStore, plan: GatePlan, chosen: _Chosen, executors: list[Executor]) -> bool:
    """Register the run (or check its resume) before its first answer; True when it is new."""
    questions = loop.registered(chosen.questions)
    o = plan.options

    def confirm(registration: Registration) -> None:
        if o.kind == "gate":
            check_alpha_left(store, o.name, registration, chosen.questions)

    return plan.register(
        store,
        o.name,
        chosen.questions,
        lambda served: _registration(plan, chosen, served),
        executors,
        _extend(store, plan, chosen, questions),
        confirm,
    )


# ----------------------------------------------------------------------------------------- run


def _notes(plan: GatePlan, executors: list[Executor]) -> dict[str, Any]:
    notes: dict[str, Any] = {
        "arm_settings": {name: arm.public_dict() for name, arm in plan.arms.items()},
        "dataset_sources": {name: spec for name, (spec, _) in plan.datasets.items()},
        "executors": [ex.facts() for ex in executors],
    }
    sandbox = sandbox_notes({q.grader for _, qs in plan.datasets.values() for q in qs})
    if sandbox is not None:
        notes["code_sandbox"] = sandbox
    if plan.judge is not None:
        notes["judge_settings"] = plan.judge.public_dict()
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


def run(options: GateOptions) -> RunResult:
    """Register (or resume) a run and answer what is not yet stored, until done or stopped."""
    plan = _plan(options)
    run_id = options.name
    with GateStore(options.store) as store, store.lock(run_id):
        questions, pool, excluded, carry = _choose(plan, store)
        if excluded[1]:
            log(f"gate: leaving out {len(excluded[0])} questions used by run(s) {', '.join(excluded[1])}")
        claim = loop.population(store, run_id, options.population)
        comparisons = _comparisons(options, questions, pool, claim, plan.gold)
        chosen = _Chosen(questions, pool, excluded, comparisons, carry)
        executors = make_executors(list(plan.arms.values()))
        new = _register(store, plan, chosen, executors)
        record_looks(store, run_id)
        if carry is not None:
            _store_carried(store, run_id, carry, _lanes(plan), chosen.questions)
        session = _session(store, plan, chosen)
        log(
            f"gate: run {run_id!r} {'registered' if new else 'resumed'} in {store.path} "
            f"({len(session.done)} of {session.total} answers stored; margin {options.margin}, alpha "
            f"{options.alpha}{', sequential' if chosen.sequential else ''})"
        )
        announce_sandbox({q.grader for q in questions}, "gate")
        reason = _answer(store, plan, session, executors)
    return RunResult(run_id, reason)


def _store_carried(
    store: GateStore, run_id: str, carry: str, lanes: list[Lane], questions: list[Question]
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


def _session(store: GateStore, plan: GatePlan, chosen: _Chosen) -> Session:
    questions = chosen.questions
    order = [(q.dataset, q.id) for q in questions]
    monitors: dict[str, Any] = {}
    for c in chosen.comparisons:
        if c.sequential is None:
            continue
        if plan.gold is not None:
            graders = {(q.dataset, q.id): q.grader for q in questions}
            monitors[c.name] = JudgedRunMonitor(order, c.sequential, c.lanes, plan.gold, graders)
        else:
            monitors[c.name] = SequentialMonitor(order, c.sequential, c.lanes)
    settings = SessionSettings.of(plan.options, plan.judge, plan.gold)
    return Session(store, settings, _lanes(plan), questions, monitors)


def _answer(store: GateStore, plan: GatePlan, session: Session, executors: list[Executor]) -> str:
    run_id = plan.options.name
    monitor = session.monitor
    if session.stopped and monitor is not None and monitor.stop is not None:
        log(f"gate: run {run_id!r} already stopped after {monitor.stop.stopped_at} questions; nothing to do")
        store.add_event(run_id, "stop", monitor.stop.reason, monitor.stop.stopped_at, session.stop_detail)
        return monitor.stop.reason
    if not any(session.jobs(ex) for ex in executors):
        store.add_event(run_id, "stop", "complete")
        return "complete"
    return loop.answer(store, session, executors, "gate", notes=lambda: _notes(plan, executors))


# ----------------------------------------------------------------------------------- public API


def run_gate(
    store: str | Path,
    datasets: str | Sequence[str],
    baseline: ArmSpec,
    candidate: ArmSpec,
    margin: float,
    alpha: float = 0.025,
    **settings: Any,
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
    **settings: Any,
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
