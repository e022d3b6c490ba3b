"""``gate tune``: the most aggressive lossy setting (any verification policy: FLy, typical acceptance, with
or without a lossless prefix) that is shown non-inferior, with the chance of choosing a harmful one kept at
most alpha (docs/gate.md, "Choosing a lossy setting: `gate tune`").

The order of work is what keeps the procedure valid:

1. every setting, arm and dataset is validated; the questions are put in the seeded random order of
   flyspec/gate/data/questions.py, and the first ``calibration_questions`` of it are set aside for
   calibration;
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

from dataclasses import replace
from pathlib import Path

from flyspec.gate.arms.registry import make_executors
from flyspec.gate.data.results import lane_speeds, setting_status
from flyspec.gate.data.spec import CalibrationRecord, Registration, TestOrder, TuneRecord
from flyspec.gate.data.store import GateStore
from flyspec.gate.runs.exclusion import used_questions
from flyspec.gate.runs.plan import Chosen, Plan, choose, plan
from flyspec.gate.runs.run import Clock, RunResult, announce_sandbox, answer, population, register
from flyspec.gate.runs.session import Session, SessionSettings, log
from flyspec.gate.runs.tune_settings import TuneOptions, TuneSetting
from flyspec.gate.stats.decide import PASS
from flyspec.gate.stats.monitor import PAUSES, Monitor, SequentialPlan

BASELINE = ("baseline", 0)
PROCEDURE = (
    "fixed-sequence testing (Maurer, Hothorn and Lehmacher 1995; Westfall and Krishen 2001): each setting "
    "against the margin at the full alpha, in the registered order; stop at the first that does not PASS"
)
TunePlan = Plan[TuneOptions]


def tune(options: TuneOptions) -> RunResult:
    """Calibrate, register the order, then test the settings in it until the first that does not PASS."""
    planned = plan(options)
    name = options.name
    clock = Clock(options.max_minutes)
    with GateStore(options.store) as store, store.lock(name):
        claim = population(store, name, options.population)
        names = [n for n in options.exclude_runs if n not in (name, options.calibration_run)]
        chosen = choose(planned, used_questions(store, names), names)
        announce_sandbox({q.grader for q in chosen.questions}, "gate tune")
        if chosen.calibration:
            reason = _calibrate(store, planned, chosen, clock)
            if reason != "complete":
                return RunResult(name, reason)
        order = _order(store, planned)
        executors = make_executors(list(planned.arms.values()))
        register(
            store, planned, name, _registration(planned, chosen, order, claim), chosen.questions, executors
        )
        labels = {s.id: s.title for s in planned.settings}
        log(
            f"gate tune: run {name!r} in {store.path}; test order: "
            + ", ".join(labels[i] for i in order.settings)
        )
        run = store.get_run(name)
        assert run is not None
        for setting_id in order.settings:
            status = setting_status(store, run, setting_id)
            if not status.final:
                reason = _test(store, planned, chosen, claim, planned.setting(setting_id), clock)
                if reason in PAUSES:
                    return RunResult(name, reason)
                status = setting_status(store, run, setting_id)
            log(f"gate tune: {labels[setting_id]}: {status.decision} after {status.n} questions")
            if status.decision != PASS:
                break
    return RunResult(name, "complete")


def _common(planned: TunePlan, chosen: Chosen, kind: str) -> Registration:
    """What the calibration run and the tune run both register: the run's keys, the settings, and the
    runs whose questions were left out."""
    o = planned.options
    excluded = planned.excluded(o.exclude_runs, len(chosen.left_out)) if o.exclude_runs else None
    settings = tuple(s.record for s in planned.settings)
    return replace(planned.registration(kind), settings=settings, excluded=excluded)


def _registration(planned: TunePlan, chosen: Chosen, order: TestOrder, claim: str) -> Registration:
    """What the tune run registers: its test ``order``, its design and its test questions' keys."""
    o = planned.options
    tune = TuneRecord(
        PROCEDURE,
        order,
        o.calibration_run if chosen.calibration else None,
        tuple((q.dataset, q.id) for q in chosen.calibration),
        len(chosen.questions),
    )
    return replace(
        _common(planned, chosen, "tune"),
        tune=tune,
        order=planned.order(chosen.pool + len(chosen.calibration)),
        max_questions=o.max_questions,
        design="sequential" if o.sequential else "fixed",
        sequential=_sequential_plan(o, chosen, claim) if o.sequential else None,
    )


def _sequential_plan(o: TuneOptions, chosen: Chosen, claim: str) -> SequentialPlan:
    return SequentialPlan(o.margin, o.alpha, len(chosen.questions), chosen.pool, o.question_order_seed, claim)


def _calibrate(store: GateStore, planned: TunePlan, chosen: Chosen, clock: Clock) -> str:
    """Each arm answers the calibration questions alone, one arm after another; answers not graded."""
    o = planned.options
    executors = make_executors(list(planned.arms.values()))
    calibration = replace(
        _common(planned, chosen, "calibration"),
        calibration=CalibrationRecord(len(chosen.calibration), o.name),
    )
    register(store, planned, o.calibration_run, calibration, chosen.calibration, executors)
    for name, arm in planned.arms.items():
        settings = SessionSettings.of(o, o.calibration_run, clock.left, graded=False)
        session = Session(store, settings, [(name, 0)], list(chosen.calibration), {})
        who = f"gate tune: calibrating {name} (speed only, not graded)"
        reason = answer(store, session, make_executors([arm]), who, clock, {"lane": name})
        if reason != "complete":
            return reason
    return "complete"


def calibration_speeds(store: GateStore, run_id: str) -> dict[str, dict[str, float | None]]:
    """Per arm of a calibration run: tokens/s over its engine's busy time, mean acceptance length and
    forgiven share, from the stored answers and batches."""
    return lane_speeds(store, run_id, first_repeat_only=False)


def _order(store: GateStore, planned: TunePlan) -> TestOrder:
    """The registered test order: by calibration speed, slowest first (ties keep the given order), or as
    given."""
    o = planned.options
    given = [s.id for s in planned.settings]
    if o.order == "given":
        return TestOrder("given", tuple(given))
    speeds = calibration_speeds(store, o.calibration_run)
    by, fallback = o.order_by, None

    def missing(key: str) -> list[TuneSetting]:
        return [s for s in planned.settings if speeds.get(s.id, {}).get(key) is None]

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
        k = (planned.baseline.speculative_config or {}).get("num_speculative_tokens", 4)
        raise ValueError(
            f"setting {first.title} ({first.id}): its calibration answers report no {by}, so the settings "
            f"cannot be ordered by speed: give more calibration tokens (--calibration-questions, or "
            f"--max-tokens of at least {4 * (k + 1)} so that each answer drafts a few times), or give the "
            "order with --order given"
        )
    values = {s.id: float(speeds[s.id][by]) for s in planned.settings}  # type: ignore[arg-type]
    ordered = sorted(given, key=lambda sid: (values[sid], given.index(sid)))
    direction = "ascending: slowest (least aggressive) first"
    return TestOrder("speed", tuple(ordered), by, direction, o.calibration_run, values, fallback)


def _test(
    store: GateStore, planned: TunePlan, chosen: Chosen, claim: str, setting: TuneSetting, clock: Clock
) -> str:
    """Test one setting against the stored (and, where missing, new) baseline answers."""
    o = planned.options
    lanes = (BASELINE, (setting.id, 0))
    monitors: dict[str, Monitor] = {}
    if o.sequential:
        order = [(q.dataset, q.id) for q in chosen.questions]
        monitors["candidate"] = Monitor(order, _sequential_plan(o, chosen, claim), lanes)
    settings = SessionSettings.of(o, o.name, clock.left)
    session = Session(store, settings, list(lanes), list(chosen.questions), monitors)
    log(f"gate tune: testing {setting.title} ({setting.id}) against the baseline")
    executors = make_executors([planned.baseline, setting.arm])
    return answer(store, session, executors, "gate tune: testing", clock, {"setting": setting.id})


def describe_pause(result: RunResult, store: str | Path) -> str:
    """The line printed when a tune pauses: what is kept and how to continue."""
    return (
        f"gate tune: paused ({result.reason}); every answer of run {result.run_id!r} is stored in {store}; "
        "rerun the same command to continue"
    )


__all__ = ["TuneOptions", "calibration_speeds", "describe_pause", "tune"]
