"""The runner of every kind of run: plan -> register (flyspec/gate/runs/register.py) -> answer
(flyspec/gate/runs/session.py). ``gate run``, ``gate pilot``, ``flyspec demo`` and ``gate tune`` differ only
in what they plan, register and answer (docs/gate.md, "Running the gate").
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Generic, TypeVar

from flyspec.gate.arms import make_executors, parse_arm
from flyspec.gate.arms.base import Arm, Executor
from flyspec.gate.arms.engine import size_for_work
from flyspec.gate.arms.judge import Judge, parse_judge
from flyspec.gate.data.questions import Question, QuestionKey, dataset_info, load_dataset, select_questions
from flyspec.gate.data.spec import (
    BASELINE,
    DEFAULT_GOLD_RATE,
    ComparisonPlan,
    DatasetEntry,
    Excluded,
    Family,
    Gold,
    QuestionOrder,
    Registration,
    SamplingRecord,
)
from flyspec.gate.data.store import GateStore, RunNotes
from flyspec.gate.data.storefile import StoreLock
from flyspec.gate.grading.graders import check_reference, model_graded, model_graded_names, sandbox_notes
from flyspec.gate.runs.judging import JudgedRunMonitor
from flyspec.gate.runs.progress import announce_sandbox, log
from flyspec.gate.runs.register import (
    identified,
    ledger,
    population,
    register,
    store_carried,
    used_questions,
)
from flyspec.gate.runs.session import Clock, Session
from flyspec.gate.runs.settings import ArmSpec, GateOptions, RunSettings
from flyspec.gate.stats.monitor import JUDGED_METHOD, Lane, Monitor, SequentialPlan

ORDER_RULE = "sha256(seed:dataset:id) ascending"
FAMILY_PROCEDURE = (
    "Bonferroni: each comparison is tested at its own share of alpha, and the shares add up to the run's "
    "alpha, so the chance of any wrong PASS or FAIL among them is at most alpha"
)
Options = TypeVar("Options", bound=RunSettings)
Datasets = dict[str, tuple[str, list[Question]]]  # by report name: its spec as given, every question


@dataclass(frozen=True)
class RunResult:
    """How a call of ``run`` or ``tune`` ended: ``complete``, ``boundary``, ``max_questions``, or a pause
    the same call resumes: ``time_budget``, ``interrupted``, ``error``."""

    run_id: str
    reason: str

    @property
    def interrupted(self) -> bool:
        return self.reason == "interrupted"


@dataclass(frozen=True)
class Plan(Generic[Options]):
    """A validated run: its settings, its arms by name (a tune's settings among them), every question of its
    datasets; for a judged run the judge and the gold-label rule."""

    options: Options
    arms: dict[str, Arm]
    datasets: Datasets
    judge: Judge | None = None
    gold: Gold | None = None

    @property
    def baseline(self) -> Arm:
        return self.arms["baseline"]

    def model_graded(self) -> list[tuple[str, str]]:
        """``(dataset, grader)`` of each dataset with questions a model grades (the first such grader)."""
        found = []
        for name, (_, questions) in self.datasets.items():
            grader = next((q.grader for q in questions if model_graded(q.grader)), None)
            if grader is not None:
                found.append((name, grader))
        return found

    def registration(self, kind: str, questions: Sequence[Question] | None = None) -> Registration:
        """What every kind registers (the served models apart): margin, alpha, seeds, sampling, the alpha
        budget, and each dataset's sha256 and size (with ``questions``, how many the run registered)."""
        o = self.options
        counts: dict[str, int] = {name: 0 for name in self.datasets}
        for q in questions or ():
            counts[q.dataset] += 1
        datasets = {
            name: DatasetEntry(
                dataset_info(spec).sha256, counts[name] if questions is not None else None, len(qs)
            )
            for name, (spec, qs) in self.datasets.items()
        }
        return Registration(
            kind=kind,
            margin=float(o.margin),
            alpha=float(o.alpha),
            seed=o.seed,
            sampling=SamplingRecord(o.temperature, o.top_p, o.max_tokens),
            shuffle_seed=o.shuffle_seed,
            alpha_budget=float(o.alpha_budget) if o.alpha_budget is not None else None,
            datasets=datasets,
        )


GatePlan = Plan[GateOptions]


@dataclass(frozen=True)
class Chosen:
    """A run's questions in their registered order, the number they were drawn from, the questions left out
    and the runs that used them, a tune's calibration questions, and the fixed run a continuation carries."""

    questions: tuple[Question, ...]
    pool: int
    left_out: frozenset[QuestionKey] = frozenset()
    left_out_by: tuple[str, ...] = ()
    calibration: tuple[Question, ...] = ()
    carry: str | None = None


def plan(options: Options) -> Plan[Options]:
    """The plan of a gate run, pilot or tune: its arms parsed (ValueError naming the first bad one), its
    datasets read, every reference answer checked against its grader; a gate run's judge, and too few
    questions refused (a tune adds its settings and checks its own). Nothing touches the store."""
    specs: dict[str, ArmSpec] = {"baseline": options.baseline}
    if isinstance(options, GateOptions):
        if options.candidate is not None:
            specs["candidate"] = options.candidate
        specs.update(options.controls)
    arms = {name: parse_arm(name, spec) for name, spec in specs.items()}
    planned = Plan(options, arms, load_datasets(options.datasets, options.shuffle_seed))
    if not isinstance(options, GateOptions):
        return planned
    planned = _with_judge(planned)
    choose(planned)
    return planned


def _with_judge(planned: Plan[Options]) -> Plan[Options]:
    """A gate run's or pilot's plan: a pilot that would measure nothing refused; for a run with
    model-graded questions (or ``judge_all``) the judge and the gold-label rule."""
    options = planned.options
    if "candidate" not in planned.arms and options.temperature == 0 and planned.baseline.greedy_repeats:
        raise ValueError(
            "gate pilot at temperature 0 would run the baseline twice and measure nothing: in "
            "batch-invariant mode this engine's greedy decoding gives the same answers both times. "
            "To plan a run, pilot the candidate instead: `flyspec gate pilot --candidate ARM ...` "
            "runs both arms once on questions that later `gate run`s leave out, and measures the "
            "candidate's flip rate. "
            "(To measure sampling noise, give --temperature > 0.)"
        )
    judge = _judge(planned)
    if judge is None:
        return planned
    rate = options.gold_rate if options.gold_rate is not None else DEFAULT_GOLD_RATE
    gold = Gold(rate, options.seed, "exact" if options.judge_all else "human", options.judge_all)
    return replace(planned, judge=judge, gold=gold)


def _judge(planned: Plan[GateOptions]) -> Judge | None:
    """The run's judge: given exactly when some question is graded by a model (or with judge_all)."""
    options = planned.options
    judged = planned.model_graded()
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


def choose(
    planned: Plan[Options],
    left_out: Collection[QuestionKey] = frozenset(),
    by: Sequence[str] = (),
    first: Sequence[QuestionKey] = (),
    calibration: int | None = None,
) -> Chosen:
    """The run's questions: the seeded order without ``left_out`` (used by the runs ``by``), ``first`` (a
    carried run's order) leading, a tune's ``calibration`` set aside; ValueError when too few."""
    o = planned.options
    by_dataset = {name: qs for name, (_, qs) in planned.datasets.items()}
    limit = o.limit if isinstance(o, GateOptions) else None
    pool = select_questions(by_dataset, seed=o.question_order_seed, limit=limit, excluded=left_out)
    if first:
        lead = {key: i for i, key in enumerate(first)}
        led = sorted((q for q in pool if (q.dataset, q.id) in lead), key=lambda q: lead[(q.dataset, q.id)])
        pool = led + [q for q in pool if (q.dataset, q.id) not in lead]
    if calibration is not None and len(pool) <= calibration:
        raise ValueError(
            f"calibration_questions={calibration}: the datasets hold {len(pool)} questions, which leaves "
            "none to test"
        )
    aside, rest = pool[: calibration or 0], pool[calibration or 0 :]
    if o.max_questions is not None and o.max_questions > len(rest):
        if calibration is not None:
            raise ValueError(
                f"max_questions={o.max_questions}: {len(rest)} questions remain once the {calibration} "
                "calibration questions are set aside"
            )
        used = f" once the {len(left_out)} used by {', '.join(by)} are left out" if by else ""
        raise ValueError(f"max_questions={o.max_questions}: the datasets hold {len(pool)} questions{used}")
    questions = rest[: o.max_questions] if o.max_questions is not None else rest
    return Chosen(tuple(questions), len(rest), frozenset(left_out), tuple(by), tuple(aside))


def load_datasets(specs: Sequence[str], shuffle_seed: int) -> Datasets:
    """Every question of each dataset, by its report name, with its spec as given; every reference answer
    checked against its grader (ValueError naming the dataset and question)."""
    loaded: Datasets = {}
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


def run(options: GateOptions) -> RunResult:
    """Register (or resume) a gate run or pilot and answer what is not yet stored, until done or stopped."""
    planned = plan(options)
    run_id = options.name
    with GateStore(options.store) as store, StoreLock(store.path, run_id):
        claim = population(store, run_id, options.population)
        chosen = _choose(store, planned, claim)
        if chosen.left_out_by:
            by = ", ".join(chosen.left_out_by)
            log(f"gate: leaving out {len(chosen.left_out)} questions used by run(s) {by}")
        comparisons = _comparisons(options, chosen, claim, planned.gold)
        executors = make_executors(list(planned.arms.values()))
        # An engine's KV cache holds what this run can use, not max_num_seqs requests of max_model_len.
        size_for_work(executors, chosen.questions, options.max_tokens)
        registration = _registration(planned, chosen, comparisons)
        new = register(store, run_id, registration, chosen.questions, executors, planned.arms, planned.judge)
        if chosen.carry is not None:
            store_carried(store, run_id, chosen.carry, _lanes(planned), chosen.questions)
        clock = Clock(options.max_minutes)
        session = _session(store, planned, chosen, comparisons)
        log(
            f"gate: run {run_id!r} {'registered' if new else 'resumed'} in {store.path} "
            f"({len(session.done)} of {session.total} answers stored; margin {options.margin}, alpha "
            f"{options.alpha}{', sequential' if registration.sequential else ''})"
        )
        announce_sandbox({q.grader for q in chosen.questions}, "gate")
        notes = partial(_notes, planned, executors)  # read once the executors started
        reason = session.answer(executors, "gate", clock, notes=notes)
    return RunResult(run_id, reason)


def _lanes(planned: GatePlan) -> list[Lane]:
    """Every arm once, or without a candidate (a noise pilot) the baseline twice."""
    if "candidate" in planned.arms:
        return [(name, 0) for name in planned.arms]
    return [("baseline", 0), ("baseline", 1)]


def _choose(store: GateStore, planned: GatePlan, claim: str) -> Chosen:
    """The run's questions: the seeded order without every earlier pilot's (for a gate run) and
    --exclude-run's, led by the fixed run a sequential continuation carries."""
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
    carry = _carry(store, planned, chosen, claim)
    if carry is None:
        return chosen
    first = [(q.dataset, q.question_id) for q in store.questions(carry)]
    return replace(choose(planned, left_out, names, first), carry=carry)


def _carry(store: GateStore, planned: GatePlan, chosen: Chosen, claim: str) -> str | None:
    """The fixed run whose answers a new sequential run (one candidate, no controls) carries: the ledger
    names one when that run is the only earlier look at the comparison on these questions."""
    o = planned.options
    existing = store.get_run(o.name)
    if existing is not None:
        return existing.registered.carries
    if o.kind != "gate" or not o.sequential or o.controls:
        return None
    guess = _registration(planned, chosen, _comparisons(o, chosen, claim, planned.gold))
    guess = identified(guess, planned.arms, planned.judge, {})
    carry = ledger(store, o.name, guess, chosen.questions).carry
    fixed = store.get_run(carry) if carry is not None else None
    if fixed is None or fixed.kind != "gate" or fixed.registered.design != "fixed":
        return None
    return carry


def _comparisons(
    options: GateOptions, chosen: Chosen, population: str, gold: Gold | None
) -> list[ComparisonPlan]:
    """The run's comparisons, the candidate's first: one per control too, each with its share of alpha. A
    judged run's sequence is the prediction-powered one at its gold-label rate."""
    if options.candidate is None:
        return []
    n, order_seed = len(chosen.questions), options.question_order_seed

    def comparison(name: str, margin: float, alpha: float, role: str) -> ComparisonPlan:
        sequential = (
            sequential_plan(margin, alpha, n, chosen.pool, order_seed, population, gold)
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


def sequential_plan(
    margin: float, alpha: float, n: int, pool: int, order_seed: int, population: str, gold: Gold | None
) -> SequentialPlan:
    """A comparison's sequential plan; a judged run's (``gold``) is the prediction-powered one."""
    if gold is None:
        return SequentialPlan(margin, alpha, n, pool, order_seed, population)
    return SequentialPlan(margin, alpha, n, pool, order_seed, population, JUDGED_METHOD, gold.rate, gold.bet)


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
        order=QuestionOrder(o.question_order_seed, rule, chosen.pool),
        excluded=Excluded(chosen.left_out_by, len(chosen.left_out)),
        design="sequential" if sequential is not None else "fixed",
        carries=chosen.carry,
        sequential=sequential,
        listed=tuple(comparisons) if several else (),
        family=Family(float(o.alpha), FAMILY_PROCEDURE) if several else None,
        pilot_mode=pilot_mode,
        gold=planned.gold,
    )


def _session(
    store: GateStore, planned: GatePlan, chosen: Chosen, comparisons: list[ComparisonPlan]
) -> Session:
    questions = list(chosen.questions)
    order = [(q.dataset, q.id) for q in questions]
    monitors: dict[str, Monitor] = {}
    for c in comparisons:
        if c.sequential is None:
            continue
        if planned.gold is not None:
            graders = {(q.dataset, q.id): q.grader for q in questions}
            monitors[c.name] = JudgedRunMonitor(order, c.sequential, c.lanes, planned.gold, graders)
        else:
            monitors[c.name] = Monitor(order, c.sequential, c.lanes)
    o = planned.options
    return Session(
        store, o, o.name, _lanes(planned), questions, monitors, judge=planned.judge, gold=planned.gold
    )


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


def run_gate(
    store: str | Path,
    datasets: str | Sequence[str],
    baseline: ArmSpec,
    candidate: ArmSpec,
    margin: float,
    alpha: float = 0.025,
    **settings: object,
) -> str:
    """Run (or resume) the paired gate of ``candidate`` against ``baseline``; returns the run id. Arms are
    dicts, JSON strings or JSON files; ``settings`` are the other fields of ``GateOptions``."""
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
    """The line printed when a run is interrupted."""
    with GateStore(store_path) as store:
        stored = len(store.answered_keys(run_id))
    return (
        f"interrupted: {stored} answers of run {run_id!r} are stored in {store_path}; "
        "rerun the same command to resume"
    )
