"""``gate tune``: the most aggressive lossy setting (any verification policy: FLy, typical acceptance, with
or without a lossless prefix) that is shown non-inferior, with the chance of choosing a harmful one kept at
most alpha (docs/gate.md, "Choosing a lossy setting: `gate tune`").

The order of work is what keeps the procedure valid:

1. every setting, arm and dataset is validated; the questions are put in the seeded random order of
   flyspec/gate/data/order.py, and the first ``calibration_questions`` of it are set aside for calibration;
2. calibration (run ``NAME/calibration``): the baseline and every setting answer the calibration
   questions, each alone in its own engine, one after another. The answers are stored but never graded:
   they measure speed only, so no quality data exists when the order is fixed;
3. the test order is fixed: by speed on the calibration questions, slowest (least aggressive) first, or
   as given. The tune run (``NAME``) is registered with that order, the settings, margin, alpha, the
   design and the test questions (disjoint from the calibration ones) before its first answer;
4. fixed-sequence testing: the settings are tested in that order, each against the margin at the full
   alpha; the first one that does not PASS ends the tune, and the settings after it are never run
   (NOT TESTED). The baseline answers each test question once, with the per-question seed every arm
   shares, and every setting is paired with those stored answers. Each test is sequential (the
   anytime-valid confidence sequence, stopped at its first crossing) or fixed-size (Tango at every test
   question);
5. a time budget, Ctrl-C or an endpoint failure pauses the tune; the same command resumes it where it
   stopped (the calibration and every stored answer are kept).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from flyspec.gate.arms.base import Arm
from flyspec.gate.arms.registry import make_executors
from flyspec.gate.data.datasets import Question
from flyspec.gate.data.order import QuestionKey
from flyspec.gate.data.registration import (
    CalibrationRecord,
    Extension,
    Registration,
    TestOrder,
    TuneRecord,
)
from flyspec.gate.data.speeds import lane_speeds
from flyspec.gate.data.store import GateStore
from flyspec.gate.data.tune_tests import setting_status
from flyspec.gate.runs import loop
from flyspec.gate.runs.exclusion import check_alpha_left, record_looks, used_questions
from flyspec.gate.runs.loop import Served
from flyspec.gate.runs.options import TuneOptions
from flyspec.gate.runs.plan import Plan, plan
from flyspec.gate.runs.session import Session, SessionSettings, log
from flyspec.gate.runs.tune_settings import (
    TuneSetting,
    default_grid,
    expand_grid,
    load_candidates,
    parse_settings,
)
from flyspec.gate.stats.claims import SUPERPOPULATION
from flyspec.gate.stats.decision import PASS
from flyspec.gate.stats.monitor import PAUSES, SequentialMonitor, SequentialPlan

BASELINE = ("baseline", 0)
PROCEDURE = (
    "fixed-sequence testing (Maurer, Hothorn and Lehmacher 1995; Westfall and Krishen 2001): each setting "
    "against the margin at the full alpha, in the registered order; stop at the first that does not PASS"
)


@dataclass(frozen=True)
class TuneResult:
    """How a call of ``tune`` ended: ``complete`` (the sequence reached its end or its first non-PASS),
    or paused (``time_budget``, ``interrupted``, ``error``: the same call resumes it)."""

    run_id: str
    reason: str

    @property
    def interrupted(self) -> bool:
        return self.reason == "interrupted"


@dataclass(frozen=True)
class TunePlan(Plan[TuneOptions]):
    """A tune's plan: the run's (the baseline and every setting's arm, the datasets), its settings in the
    order given, the calibration and test questions, the size of the pool the tests are drawn from, the
    questions left out (``--exclude-run``) and the claim of its sequential tests."""

    settings: tuple[TuneSetting, ...] = ()
    calibration: tuple[Question, ...] = ()
    tests: tuple[Question, ...] = ()
    test_pool: int = 0
    left_out: frozenset[QuestionKey] = frozenset()
    population: str = SUPERPOPULATION

    @property
    def baseline(self) -> Arm:
        return self.arms["baseline"]

    def setting(self, setting_id: str) -> TuneSetting:
        return next(s for s in self.settings if s.id == setting_id)


def _plan(options: TuneOptions) -> TunePlan:
    planned = plan(options, {"baseline": options.baseline})
    baseline = planned.arms["baseline"]
    candidates = load_candidates(options.candidates)
    if options.policies is not None:
        candidates = expand_grid(options.policies)
    if candidates is None:
        if baseline.speculative_config is None:
            raise ValueError(
                "candidates: the default grid needs an engine baseline with a speculative_config (it varies "
                "fly_window_size and fly_entropy_threshold for its K); with endpoint arms give --candidates"
            )
        k = baseline.speculative_config["num_speculative_tokens"]
        candidates = default_grid(k, options.windows, options.thresholds)
    settings = tuple(parse_settings(baseline, candidates))
    judged = planned.model_graded()
    if judged:
        raise ValueError(
            f"dataset {judged[0][0]!r}: gate tune cannot use judge questions: a judged baseline answer is "
            "right or wrong only against one candidate, so it cannot be shared by several settings"
        )
    arms = {**planned.arms, **{s.id: s.arm for s in settings}}
    return _choose(TunePlan(options, arms, planned.datasets, settings=settings), frozenset())


def _choose(plan: TunePlan, excluded: frozenset[QuestionKey]) -> TunePlan:
    """The calibration and test questions: the seeded order without the ``excluded`` questions (those of
    --exclude-run)."""
    options = plan.options
    ordered = plan.pool(excluded)
    c = options.calibration_questions
    if len(ordered) <= c:
        raise ValueError(
            f"calibration_questions={c}: the datasets hold {len(ordered)} questions, which leaves none "
            "to test"
        )
    calibration, rest = ordered[:c], ordered[c:]
    if options.max_questions is not None and options.max_questions > len(rest):
        raise ValueError(
            f"max_questions={options.max_questions}: {len(rest)} questions remain once the {c} calibration "
            "questions are set aside"
        )
    tests = rest[: options.max_questions] if options.max_questions is not None else rest
    return replace(
        plan, calibration=tuple(calibration), tests=tuple(tests), test_pool=len(rest), left_out=excluded
    )


# ---------------------------------------------------------------------------------- registration


def _common(plan: TunePlan, kind: str, served: Served) -> Registration:
    """What the calibration run and the tune run both register: the run's keys and the settings."""
    o = plan.options
    excluded = plan.excluded(o.exclude_runs, len(plan.left_out)) if o.exclude_runs else None
    registration = plan.registration(kind, served)
    return replace(registration, settings=tuple(s.record for s in plan.settings), excluded=excluded)


def _register(
    store: GateStore,
    plan: TunePlan,
    kind: str,
    describe: Callable[[Registration], Registration],
    questions: Sequence[Question],
) -> None:
    """Check a resume (and, for the tune run, that no setting's comparison spends alpha an earlier look
    at it on these questions spent) before any server is asked, then register with the served models."""
    o = plan.options
    run_id = o.name if kind == "tune" else o.calibration_run

    def confirm(registration: Registration) -> None:
        if kind == "tune":
            check_alpha_left(store, run_id, registration, questions)

    def amend(guessed: Registration) -> tuple[Extension, ...]:
        confirm(guessed)
        return ()

    executors = make_executors(list(plan.arms.values()))
    plan.register(
        store,
        run_id,
        questions,
        lambda served: describe(_common(plan, kind, served)),
        executors,
        amend,
        confirm,
    )
    if kind == "tune":
        record_looks(store, run_id)


# ------------------------------------------------------------------------------------ sessions


class _Clock:
    """The answering time budget of one call, shared by every session of it."""

    def __init__(self, minutes: float | None) -> None:
        self.left = 60 * minutes if minutes is not None else None

    def spend(self, seconds: float) -> None:
        if self.left is not None:
            self.left -= seconds

    @property
    def out(self) -> bool:
        return self.left is not None and self.left <= 0


def _answer(
    store: GateStore,
    session: Session,
    arms: list[Arm],
    clock: _Clock,
    detail: dict[str, Any],
) -> str:
    """Answer what ``session`` lacks with fresh executors for ``arms``; they are freed afterwards (so one
    setting's engine is gone before the next one loads). Returns why the session ended."""
    executors = make_executors(arms)
    if not any(session.jobs(ex) for ex in executors):
        return "complete"
    if clock.out:
        return "time_budget"
    what = f"calibrating {detail['lane']} (speed only, not graded)" if "lane" in detail else "testing"
    try:
        reason = loop.answer(store, session, executors, f"gate tune: {what}", detail)
        clock.spend(session.answering_s)
        return reason
    finally:
        executors.clear()
        gc.collect()


def _settings(plan: TunePlan, run_id: str, budget: float | None, graded: bool = True) -> SessionSettings:
    o = plan.options
    return SessionSettings(run_id, o.seed, o.sampling, o.progress, budget, graded)


def _calibrate(store: GateStore, plan: TunePlan, clock: _Clock) -> str:
    """Each arm answers the calibration questions alone, one arm after another; answers not graded."""
    run_id = plan.options.calibration_run
    calibration = CalibrationRecord(len(plan.calibration), plan.options.name)
    _register(store, plan, "calibration", lambda r: replace(r, calibration=calibration), plan.calibration)
    for name, arm in plan.arms.items():
        settings = _settings(plan, run_id, clock.left, graded=False)
        session = Session(store, settings, [(name, 0)], list(plan.calibration), None)
        reason = _answer(store, session, [arm], clock, {"lane": name})
        if reason != "complete":
            return reason
    return "complete"


def calibration_speeds(store: GateStore, run_id: str) -> dict[str, dict[str, float | None]]:
    """Per arm of a calibration run: tokens/s over its engine's busy time, mean acceptance length and
    forgiven share, from the stored answers and batches."""
    return lane_speeds(store, run_id, first_repeat_only=False)


def _order(store: GateStore, plan: TunePlan) -> TestOrder:
    """The registered test order: by calibration speed, slowest first (ties keep the given order), or as
    given."""
    o = plan.options
    given = [s.id for s in plan.settings]
    if o.order == "given":
        return TestOrder("given", tuple(given))
    speeds = calibration_speeds(store, o.calibration_run)
    by, fallback = o.order_by, None

    def missing(key: str) -> list[TuneSetting]:
        return [s for s in plan.settings if speeds.get(s.id, {}).get(key) is None]

    if by == "mean_acceptance_length" and missing(by) and not missing("tokens_per_s"):
        # A calibration answer too short to draft (or an endpoint without acceptance counters) has no
        # acceptance length; its speed still orders the settings, measured the same way for each.
        first = missing(by)[0]
        fallback = (
            f"{first.title}'s calibration answers report no acceptance length (they drafted nothing: too few "
            "calibration tokens, or an endpoint that reports no acceptance counters), so the settings are "
            "ordered by tokens_per_s"
        )
        log(f"gate tune: {fallback}")
        by = "tokens_per_s"
    if missing(by):
        first = missing(by)[0]
        k = (plan.baseline.speculative_config or {}).get("num_speculative_tokens", 4)
        raise ValueError(
            f"setting {first.title} ({first.id}): its calibration answers report no {by}, so the settings "
            f"cannot be ordered by speed: give more calibration tokens (--calibration-questions, or "
            f"--max-tokens of at least {4 * (k + 1)} so that each answer drafts a few times), or give the "
            "order with --order given"
        )
    values = {s.id: float(speeds[s.id][by]) for s in plan.settings}  # type: ignore[arg-type]
    ordered = sorted(given, key=lambda sid: (values[sid], given.index(sid)))
    direction = "ascending: slowest (least aggressive) first"
    return TestOrder("speed", tuple(ordered), by, direction, o.calibration_run, values, fallback)


def _tune_keys(plan: TunePlan, order: TestOrder) -> Callable[[Registration], Registration]:
    """What the tune run registers besides the keys it shares with its calibration run."""
    o = plan.options
    tune = TuneRecord(
        PROCEDURE,
        order,
        o.calibration_run if plan.calibration else None,
        tuple((q.dataset, q.id) for q in plan.calibration),
        len(plan.tests),
    )
    return lambda registration: replace(
        registration,
        tune=tune,
        order=plan.order(plan.test_pool + len(plan.calibration)),
        max_questions=o.max_questions,
        design="sequential" if o.sequential else "fixed",
        sequential=_sequential_plan(plan) if o.sequential else None,
    )


def _sequential_plan(plan: TunePlan) -> SequentialPlan:
    o = plan.options
    return SequentialPlan(
        o.margin, o.alpha, len(plan.tests), plan.test_pool, o.question_order_seed, plan.population
    )


def _test(store: GateStore, plan: TunePlan, setting: TuneSetting, clock: _Clock) -> str:
    """Test one setting against the stored (and, where missing, new) baseline answers."""
    o = plan.options
    lanes = [BASELINE, (setting.id, 0)]
    monitor = None
    if o.sequential:
        order = [(q.dataset, q.id) for q in plan.tests]
        monitor = SequentialMonitor(order, _sequential_plan(plan), (BASELINE, (setting.id, 0)))
    session = Session(store, _settings(plan, o.name, clock.left), lanes, list(plan.tests), monitor)
    if monitor is not None and monitor.stop is not None:
        return monitor.stop.reason
    log(f"gate tune: testing {setting.title} ({setting.id}) against the baseline")
    return _answer(store, session, [plan.baseline, setting.arm], clock, {"setting": setting.id})


def tune(options: TuneOptions) -> TuneResult:
    """Calibrate, register the order, then test the settings in it until the first that does not PASS."""
    plan = _plan(options)
    name = options.name
    clock = _Clock(options.max_minutes)
    with GateStore(options.store) as store, store.lock(name):
        plan = replace(plan, population=loop.population(store, name, options.population))
        if options.exclude_runs:
            names = [n for n in options.exclude_runs if n not in (name, options.calibration_run)]
            plan = _choose(plan, frozenset(used_questions(store, names)))
        loop.announce_sandbox({q.grader for q in plan.tests}, "gate tune")
        if plan.calibration:
            reason = _calibrate(store, plan, clock)
            if reason != "complete":
                return TuneResult(name, reason)
        order = _order(store, plan)
        _register(store, plan, "tune", _tune_keys(plan, order), plan.tests)
        labels = {s.id: s.title for s in plan.settings}
        log(
            f"gate tune: run {name!r} in {store.path}; test order: "
            + ", ".join(labels[i] for i in order.settings)
        )
        run = store.get_run(name)
        assert run is not None
        for setting_id in order.settings:
            status = setting_status(store, run, setting_id)
            if not status.final:
                reason = _test(store, plan, plan.setting(setting_id), clock)
                if reason in PAUSES:
                    return TuneResult(name, reason)
                status = setting_status(store, run, setting_id)
            log(f"gate tune: {labels[setting_id]}: {status.decision} after {status.n} questions")
            if status.decision != PASS:
                break
    return TuneResult(name, "complete")


def describe_pause(result: TuneResult, store: str | Path) -> str:
    """The line printed when a tune pauses: what is kept and how to continue."""
    return (
        f"gate tune: paused ({result.reason}); every answer of run {result.run_id!r} is stored in {store}; "
        "rerun the same command to continue"
    )


__all__ = ["TuneOptions", "TuneResult", "calibration_speeds", "describe_pause", "tune"]
