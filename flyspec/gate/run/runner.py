"""Run the paired gate: validate, lock the store, register, then answer until done or stopped.

The order of work is what makes the numbers trustworthy (docs/gate.md, "Running the gate"):

1. every setting, arm, dataset row and reference answer is validated before the store is touched;
2. the store is locked (one writer process at a time) and the questions are chosen: the seeded order of
   flyspec/gate/data/order.py, without the questions that pilots (and ``--exclude-run`` runs) used;
3. the run is registered before the first answer: margin, alpha, arms (an endpoint with the model its
   server reports), sampling, seeds, dataset and prompt hashes, and for a sequential run the method, the
   maximum number of questions and the order seed; a resume with other settings is refused;
4. every arm answers at once, in the registered order (flyspec/gate/run/dispatch.py); each answer is graded in
   the main thread and committed the moment it arrives;
5. a sequential run stops at the first crossing along the registered order (flyspec/gate/stats/monitor.py), at
   ``max_questions`` or at the time budget (answers already in flight are still stored), or at Ctrl-C
   (at once: answers in flight are dropped and asked again when the run continues).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flyspec.gate.arms.base import Arm, EngineArm, OpenAIArm, make_executors, parse_arm
from flyspec.gate.arms.endpoint import OpenAIExecutor
from flyspec.gate.arms.engine import EngineExecutor
from flyspec.gate.data.datasets import Question, dataset_info, load_dataset
from flyspec.gate.data.order import QuestionKey, select_questions
from flyspec.gate.data.store import GateStore, RegisteredQuestion
from flyspec.gate.grading.graders import JUDGE, check_reference, sandbox_notes
from flyspec.gate.grading.judge import Judge, parse_judge
from flyspec.gate.run.dispatch import Executor
from flyspec.gate.run.exclusion import check_not_extended, used_questions
from flyspec.gate.run.options import ArmSpec, GateOptions
from flyspec.gate.run.session import Session, SessionSettings, log
from flyspec.gate.stats.monitor import SequentialMonitor, SequentialPlan

Lane = tuple[str, int]


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


@dataclass(frozen=True)
class _Plan:
    """A validated run, before anything touches the store."""

    options: GateOptions
    arms: dict[str, Arm]
    lanes: list[Lane]
    datasets: dict[str, tuple[str, list[Question]]]  # name -> (spec as given, every question)
    judge: Judge | None = None

    @property
    def mode(self) -> str | None:
        """For a pilot: ``noise`` (the baseline twice) or ``candidate`` (both arms once)."""
        if self.options.kind != "pilot":
            return None
        return "candidate" if "candidate" in self.arms else "noise"


def load_datasets(specs: Sequence[str], shuffle_seed: int) -> dict[str, tuple[str, list[Question]]]:
    """Every question of each dataset, by its report name, with its spec as given; every reference answer
    checked against its grader (ValueError naming the dataset and question)."""
    loaded: dict[str, tuple[str, list[Question]]] = {}
    for spec in specs:
        questions = load_dataset(spec, None, shuffle_seed=shuffle_seed)
        name = questions[0].dataset
        if name in loaded:
            raise ValueError(
                f"two datasets are both named {name!r}; rename one file so reports can tell them apart"
            )
        for q in questions:
            try:
                check_reference(q.grader, q.answer)
            except ValueError as exc:
                raise ValueError(
                    f"dataset {name!r}, question {q.id!r}: bad reference answer: {exc}"
                ) from None
        loaded[name] = (spec, questions)
    return loaded


def _plan(options: GateOptions) -> _Plan:
    arms: dict[str, Arm] = {"baseline": parse_arm("baseline", options.baseline)}
    if options.candidate is not None:
        arms["candidate"] = parse_arm("candidate", options.candidate)
    if "candidate" in arms:
        lanes = [("baseline", 0), ("candidate", 0)]
    else:
        lanes = [("baseline", 0), ("baseline", 1)]
        if options.temperature == 0 and isinstance(arms["baseline"], EngineArm):
            raise ValueError(
                "gate pilot at temperature 0 would run the baseline twice and measure nothing: this "
                "engine's greedy decoding gives the same answers both times. To plan a run, pilot the "
                "candidate instead: `flyspec gate pilot --candidate ARM ...` runs both arms once on "
                "questions that later `gate run`s leave out, and measures the candidate's flip rate. "
                "(To measure sampling noise, give --temperature > 0.)"
            )
    datasets = load_datasets(options.datasets, options.shuffle_seed)
    judged = [name for name, (_, qs) in datasets.items() if any(q.grader == JUDGE for q in qs)]
    judge = parse_judge(options.judge) if options.judge is not None else None
    if judged and judge is None:
        raise ValueError(
            f"dataset {judged[0]!r} has questions with grader 'judge': give the judge endpoint with --judge "
            '\'{"base_url": "http://HOST:PORT/v1", "model": "NAME"}\''
        )
    if judge is not None and not judged:
        raise ValueError("--judge: no question of the run has grader 'judge', so there is nothing to judge")
    return _Plan(options, arms, lanes, datasets, judge)


def _excluded(store: GateStore, plan: _Plan) -> tuple[set[QuestionKey], list[str]]:
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


# -------------------------------------------------------------------------------- registration


def _identities(plan: _Plan, served: dict[str, dict[str, Any] | None]) -> dict[str, dict[str, Any]]:
    """Each arm's registered identity; an endpoint's includes the model its server reports (``served``)."""
    out: dict[str, dict[str, Any]] = {}
    for name, arm in plan.arms.items():
        out[name] = arm.identity(served.get(name)) if isinstance(arm, OpenAIArm) else arm.identity()
    return out


def _judge_identity(plan: _Plan, served: dict[str, Any] | None) -> dict[str, Any] | None:
    return plan.judge.identity(served) if plan.judge is not None else None


def _registered_served(store: GateStore, run_id: str) -> dict[str, dict[str, Any] | None]:
    """The served models a registered run recorded (to check a resume before asking the servers); the
    judge's under the key ``judge``."""
    run = store.get_run(run_id)
    arms = run.registration.get("arms", {}) if run is not None else {}
    served = {name: identity.get("served_model") for name, identity in arms.items()}
    judge = run.registration.get("judge") if run is not None else None
    served[JUDGE] = judge.get("served_model") if isinstance(judge, dict) else None
    return served


def _registration(
    plan: _Plan,
    questions: list[Question],
    pool: int,
    excluded: tuple[set[QuestionKey], list[str]],
    identities: dict[str, dict[str, Any]],
    sequential: SequentialPlan | None,
    judge: dict[str, Any] | None = None,
) -> dict[str, Any]:
    o = plan.options
    counts: dict[str, int] = {name: 0 for name in plan.datasets}
    for q in questions:
        counts[q.dataset] += 1
    registration: dict[str, Any] = {
        "margin": float(o.margin),
        "alpha": float(o.alpha),
        "seed": o.seed,
        "sampling": {"temperature": o.temperature, "top_p": o.top_p, "max_tokens": o.max_tokens},
        "arms": identities,
        "repeats": sorted({r for _, r in plan.lanes}),
        "datasets": {
            name: {"sha256": dataset_info(spec).sha256, "questions": counts[name], "available": len(qs)}
            for name, (spec, qs) in plan.datasets.items()
        },
        "limit": o.limit,
        "max_questions": o.max_questions,
        "shuffle_seed": o.shuffle_seed,
        "order": {"seed": o.question_order_seed, "rule": "sha256(seed:dataset:id) ascending", "pool": pool},
        "excluded": {"runs": excluded[1], "questions": len(excluded[0])},
        "design": "sequential" if sequential is not None else "fixed",
    }
    if sequential is not None:
        registration["sequential"] = sequential.to_dict()
    if plan.mode is not None:
        registration["pilot"] = {"mode": plan.mode}
    if judge is not None:
        registration["judge"] = judge
    return registration


def _choose(plan: _Plan, store: GateStore) -> tuple[list[Question], int, tuple[set[QuestionKey], list[str]]]:
    o = plan.options
    excluded = _excluded(store, plan)
    by_dataset = {name: qs for name, (_, qs) in plan.datasets.items()}
    pool = select_questions(by_dataset, seed=o.question_order_seed, limit=o.limit, excluded=excluded[0])
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
    return questions, len(pool), excluded


# ----------------------------------------------------------------------------------------- run


def _judge_served(plan: _Plan) -> dict[str, Any] | None:
    """The judge's served model from its /v1/models (ValueError when it does not serve the model)."""
    if plan.judge is None:
        return None
    reader = OpenAIExecutor(plan.judge.endpoint)
    reader.prepare()
    return reader.served_model()


def _notes(plan: _Plan, executors: list[Executor]) -> dict[str, Any]:
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
        notes["shared_engine_note"] = (
            "arms differing only in the verifier ran in one engine started with the lossy policy, their "
            "requests side by side in the same batches; the standard arm's requests used "
            "verification='standard' (lossless)"
        )
    return notes


def _extensions(store: GateStore, run_id: str) -> dict[str, Any]:
    """The record of a sequential run's extensions past its first maximum (empty if none)."""
    run = store.get_run(run_id)
    history = run.registration.get("extensions") if run is not None else None
    return {"extensions": history} if history else {}


def _sequential_plan(options: GateOptions, questions: list[Question], pool: int) -> SequentialPlan | None:
    if not options.sequential:
        return None
    return SequentialPlan(options.margin, options.alpha, len(questions), pool, options.question_order_seed)


def run(options: GateOptions) -> RunResult:
    """Register (or resume) a run and answer what is not yet stored, until done or stopped."""
    plan = _plan(options)
    run_id = options.name
    with GateStore(options.store) as store, store.lock(run_id):
        questions, pool, excluded = _choose(plan, store)
        if excluded[1]:
            log(f"gate: leaving out {len(excluded[0])} questions used by run(s) {', '.join(excluded[1])}")
        sequential = _sequential_plan(options, questions, pool)
        registered = [
            RegisteredQuestion(q.dataset, q.id, i, q.prompt_hash, q.answer, q.grader)
            for i, q in enumerate(questions)
        ]
        # A resume with other settings is refused before any server is asked which model it serves.
        known = _registered_served(store, run_id)
        guess = _identities(plan, known)
        guessed = _registration(
            plan, questions, pool, excluded, guess, sequential, _judge_identity(plan, known[JUDGE])
        )
        if options.kind == "gate" and sequential is None:
            check_not_extended(store, run_id, guessed, [(q.dataset, q.id) for q in questions])
        if sequential is not None and store.extend_sequential(run_id, guessed, registered):
            log(f"gate: run {run_id!r} continues to at most {len(questions)} questions")
        extensions = _extensions(store, run_id)
        guessed.update(extensions)
        store.check_resumable(run_id, options.kind, guessed, registered)
        executors = make_executors(list(plan.arms.values()))
        served: dict[str, dict[str, Any] | None] = {}
        for ex in executors:
            if isinstance(ex, OpenAIExecutor):
                ex.prepare()
                served[ex.arm.name] = ex.served_model()
        judge = _judge_identity(plan, _judge_served(plan))
        registration = _registration(
            plan, questions, pool, excluded, _identities(plan, served), sequential, judge
        )
        registration.update(extensions)
        new = store.register(run_id, options.kind, registration, registered)
        store.add_event(run_id, "start")
        judged = [(q.dataset, q.id) for q in questions if q.grader == JUDGE]
        monitor = (
            SequentialMonitor([(q.dataset, q.id) for q in questions], sequential, judged=judged)
            if sequential
            else None
        )
        session = Session(store, SessionSettings.of(options, plan.judge), plan.lanes, questions, monitor)
        log(
            f"gate: run {run_id!r} {'registered' if new else 'resumed'} in {store.path} "
            f"({len(session.done)} of {session.total} answers stored; margin {options.margin}, alpha "
            f"{options.alpha}{', sequential' if sequential else ''})"
        )
        announce_sandbox({q.grader for q in questions}, "gate")
        reason = _answer(store, plan, session, executors)
    return RunResult(run_id, reason)


def announce_sandbox(graders: set[str], who: str) -> None:
    """Once at the start of a run with code questions: say which protections the code sandbox lacks here."""
    sandbox = sandbox_notes(graders)
    for missing in sandbox["missing"] if sandbox is not None else []:
        log(f"{who}: WARNING: the code sandbox runs without {missing}")


def _answer(store: GateStore, plan: _Plan, session: Session, executors: list[Executor]) -> str:
    run_id = plan.options.name
    monitor = session.monitor
    if monitor is not None and monitor.stop is not None:
        log(f"gate: run {run_id!r} already stopped after {monitor.stop.stopped_at} questions; nothing to do")
        store.add_event(run_id, "stop", monitor.stop.reason, monitor.stop.stopped_at)
        return monitor.stop.reason
    if not any(session.jobs(ex) for ex in executors):
        store.add_event(run_id, "stop", "complete")
        return "complete"
    for ex in executors:
        if isinstance(ex, EngineExecutor):
            log(f"gate: starting {ex.describe()}")
            ex.prepare()
    store.update_notes(run_id, _notes(plan, executors))
    try:
        reason = session.answer(executors)
    except BaseException:
        store.add_event(run_id, "stop", session.reason or "error", session.stopped_at)
        raise
    store.add_event(run_id, "stop", reason, session.stopped_at)
    return reason


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

    Arms are dicts, JSON strings or JSON file paths (see flyspec.gate.arms.base). ``margin`` is the tolerated
    accuracy loss (0.02 = 2 points) and ``alpha`` the one-sided level; both are registered in the store
    before the first answer. ``settings`` are the other fields of ``GateOptions`` (``sequential``,
    ``max_questions``, ``max_minutes``, ``limit``, ``temperature``, ``max_tokens``, ``seed``, ``run_id``,
    ...).
    """
    options = GateOptions(store, datasets, baseline, margin, candidate, alpha, kind="gate", **settings)  # type: ignore[arg-type]
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
    cached; refused at temperature 0 for engine arms, where it measures nothing). With ``candidate``: both
    arms once, to measure the candidate's flip rate. Later gate runs in the store leave its questions out.
    ``build_report`` turns it into a sample-size plan."""
    options = GateOptions(store, datasets, baseline, margin, candidate, alpha, kind="pilot", **settings)  # type: ignore[arg-type]
    return run(options).run_id


def describe_interrupt(store_path: str | Path, run_id: str) -> str:
    """The line printed when a run is interrupted: how much is stored and how to resume."""
    with GateStore(store_path) as store:
        stored = len(store.answered_keys(run_id))
    return (
        f"interrupted: {stored} answers of run {run_id!r} are stored in {store_path}; "
        "rerun the same command to resume"
    )
