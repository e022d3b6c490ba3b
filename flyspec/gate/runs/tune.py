"""``gate tune``: the most aggressive lossy setting (any verification policy: FLy, typical acceptance, with
or without a lossless prefix) that is shown non-inferior, with the chance of choosing a harmful one kept at
most alpha (docs/gate.md, "gate tune").

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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flyspec.gate.arms.base import Arm
from flyspec.gate.arms.registry import make_executors, parse_arm
from flyspec.gate.data.datasets import Question
from flyspec.gate.data.store import GateStore
from flyspec.gate.report.tune_report import lane_speeds, setting_status
from flyspec.gate.runs import loop
from flyspec.gate.runs.exclusion import check_alpha_left, record_looks, used_questions
from flyspec.gate.runs.loop import Datasets, load_datasets
from flyspec.gate.runs.options import TuneOptions
from flyspec.gate.runs.registration import Registration, question_pool
from flyspec.gate.runs.session import Session, SessionSettings, log
from flyspec.gate.runs.tune_settings import (
    TuneSetting,
    default_grid,
    expand_grid,
    load_candidates,
    parse_settings,
)
from flyspec.gate.stats.decision import PASS
from flyspec.gate.stats.monitor import PAUSES, SUPERPOPULATION, SequentialMonitor, SequentialPlan

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


@dataclass
class _Plan:
    options: TuneOptions
    baseline: Arm
    settings: list[TuneSetting]
    datasets: Datasets
    calibration: list[Question] = field(default_factory=list)
    tests: list[Question] = field(default_factory=list)
    pool: int = 0
    population: str = SUPERPOPULATION
    excluded: set[tuple[str, str]] = field(default_factory=set)

    @property
    def arms(self) -> dict[str, Arm]:
        return {"baseline": self.baseline, **{s.id: s.arm for s in self.settings}}

    def setting(self, setting_id: str) -> TuneSetting:
        return next(s for s in self.settings if s.id == setting_id)


def _plan(options: TuneOptions) -> _Plan:
    baseline = parse_arm("baseline", options.baseline)
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
    settings = parse_settings(baseline, candidates)
    datasets = load_datasets(options.datasets, options.shuffle_seed)
    judged = [name for name, (_, qs) in datasets.items() if any(q.grader == "judge" for q in qs)]
    if judged:
        raise ValueError(
            f"dataset {judged[0]!r}: gate tune cannot use judge questions: a judged baseline answer is "
            "right or wrong only against one candidate, so it cannot be shared by several settings"
        )
    plan = _Plan(options, baseline, settings, datasets)
    _choose(plan, set())
    return plan


def _choose(plan: _Plan, excluded: set[tuple[str, str]]) -> None:
    """The calibration and test questions: the seeded order without the ``excluded`` questions (those of
    --exclude-run)."""
    options = plan.options
    plan.excluded = excluded
    ordered = question_pool(plan.datasets, options, excluded)
    c = options.calibration_questions
    if len(ordered) <= c:
        raise ValueError(
            f"calibration_questions={c}: the datasets hold {len(ordered)} questions, which leaves none "
            "to test"
        )
    plan.calibration, rest = ordered[:c], ordered[c:]
    if options.max_questions is not None and options.max_questions > len(rest):
        raise ValueError(
            f"max_questions={options.max_questions}: {len(rest)} questions remain once the {c} calibration "
            "questions are set aside"
        )
    plan.tests = rest[: options.max_questions] if options.max_questions is not None else rest
    plan.pool = len(rest)


# ---------------------------------------------------------------------------------- registration


def _common(plan: _Plan, identities: dict[str, dict[str, Any]]) -> dict[str, Any]:
    o = plan.options
    shared = Registration(o, identities, plan.datasets)
    out = {
        **shared.common(),
        "settings": [s.to_dict() for s in plan.settings],
        "datasets": shared.dataset_hashes(),
    }
    if o.exclude_runs:
        out["excluded"] = shared.excluded(o.exclude_runs, len(plan.excluded))
    return out


def _register(
    store: GateStore, plan: _Plan, run_id: str, kind: str, extra: dict[str, Any], qs: list[Question]
) -> None:
    """Check a resume (and, for the tune run, that no setting's comparison spends alpha an earlier look
    at it on these questions spent) before any server is asked, then register with the served models."""

    def amend(guessed: dict[str, Any]) -> dict[str, Any]:
        confirm(guessed)
        return {}

    def confirm(registration: dict[str, Any]) -> None:
        if kind == "tune":
            check_alpha_left(store, run_id, kind, registration, qs)

    loop.register(
        store,
        run_id,
        kind,
        loop.registered(qs),
        lambda served: {**_common(plan, loop.identities(plan.arms, served)), **extra},
        lambda: loop.ask_served(make_executors(list(plan.arms.values()))),
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
        loop.start(executors, f"gate tune: {what}")
        store.add_event(session.run_id, "start", detail=detail)
        started = time.monotonic()
        try:
            return loop.answer(store, session, executors, detail)
        finally:
            clock.spend(time.monotonic() - started)
    finally:
        executors.clear()
        gc.collect()


def _settings(plan: _Plan, run_id: str, budget: float | None, graded: bool = True) -> SessionSettings:
    o = plan.options
    return SessionSettings(run_id, o.seed, o.sampling, o.progress, budget, graded)


def _calibrate(store: GateStore, plan: _Plan, clock: _Clock) -> str:
    """Each arm answers the calibration questions alone, one arm after another; answers not graded."""
    run_id = plan.options.calibration_run
    extra = {"calibration": {"questions": len(plan.calibration), "graded": False, "tune": plan.options.name}}
    _register(store, plan, run_id, "calibration", extra, plan.calibration)
    for name, arm in plan.arms.items():
        settings = _settings(plan, run_id, clock.left, graded=False)
        session = Session(store, settings, [(name, 0)], plan.calibration, None)
        reason = _answer(store, session, [arm], clock, {"lane": name})
        if reason != "complete":
            return reason
    return "complete"


def calibration_speeds(store: GateStore, run_id: str) -> dict[str, dict[str, float | None]]:
    """Per arm of a calibration run: tokens/s over its engine's busy time, mean acceptance length and
    forgiven share, from the stored answers and batches."""
    return lane_speeds(store, run_id, first_repeat_only=False)


def _order(store: GateStore, plan: _Plan) -> dict[str, Any]:
    """The registered test order: by calibration speed, slowest first (ties keep the given order), or as
    given."""
    o = plan.options
    given = [s.id for s in plan.settings]
    if o.order == "given":
        return {"method": "given", "settings": given}
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
    out: dict[str, Any] = {
        "method": "speed",
        "by": by,
        "direction": "ascending: slowest (least aggressive) first",
        "calibration_run": o.calibration_run,
        "values": values,
        "settings": ordered,
    }
    if fallback is not None:
        out["fallback"] = fallback
    return out


def _tune_extra(plan: _Plan, order: dict[str, Any]) -> dict[str, Any]:
    o = plan.options
    extra: dict[str, Any] = {
        "procedure": PROCEDURE,
        "order": order,
        "question_order": Registration(o, {}, plan.datasets).order(plan.pool + len(plan.calibration)),
        "calibration": {
            "run": o.calibration_run if plan.calibration else None,
            "questions": [[q.dataset, q.id] for q in plan.calibration],
        },
        "max_questions": o.max_questions,
        "test_questions": len(plan.tests),
        "design": "sequential" if o.sequential else "fixed",
    }
    if o.sequential:
        extra["sequential"] = _sequential_plan(plan).to_dict()
    return extra


def _sequential_plan(plan: _Plan) -> SequentialPlan:
    o = plan.options
    return SequentialPlan(
        o.margin, o.alpha, len(plan.tests), plan.pool, o.question_order_seed, plan.population
    )


def _test(store: GateStore, plan: _Plan, setting: TuneSetting, clock: _Clock) -> str:
    """Test one setting against the stored (and, where missing, new) baseline answers."""
    o = plan.options
    lanes = [BASELINE, (setting.id, 0)]
    monitor = None
    if o.sequential:
        order = [(q.dataset, q.id) for q in plan.tests]
        monitor = SequentialMonitor(order, _sequential_plan(plan), (BASELINE, (setting.id, 0)))
    session = Session(store, _settings(plan, o.name, clock.left), lanes, plan.tests, monitor)
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
        plan.population = loop.population(store, name, options.population)
        if options.exclude_runs:
            names = [n for n in options.exclude_runs if n not in (name, options.calibration_run)]
            _choose(plan, used_questions(store, names))
        loop.announce_sandbox({q.grader for q in plan.tests}, "gate tune")
        if plan.calibration:
            reason = _calibrate(store, plan, clock)
            if reason != "complete":
                return TuneResult(name, reason)
        order = _order(store, plan)
        _register(store, plan, name, "tune", _tune_extra(plan, order), plan.tests)
        labels = {s.id: s.title for s in plan.settings}
        log(
            f"gate tune: run {name!r} in {store.path}; test order: "
            + ", ".join(labels[i] for i in order["settings"])
        )
        run = store.get_run(name)
        assert run is not None
        for setting_id in order["settings"]:
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
