"""The plan of every kind of run, before anything touches the store: ``plan`` turns a run's settings into a
``Plan`` (its arms parsed, its datasets read and every reference answer checked; a gate run's judge and
gold-label rule, a tune's settings), and ``choose`` picks its questions (a tune's calibration questions
first). The runner (flyspec/gate/runs/run.py) registers what ``Plan.registration`` describes, with the
served models ``Plan.identified`` adds, then answers.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Generic, TypeVar

from flyspec.gate.arms.base import Arm, Executor, Served
from flyspec.gate.arms.endpoint import OpenAIExecutor
from flyspec.gate.arms.judge import JUDGE_ARM, Judge, parse_judge
from flyspec.gate.arms.registry import parse_arm
from flyspec.gate.data.datasets import dataset_info, load_dataset
from flyspec.gate.data.questions import Question, QuestionKey, select_questions
from flyspec.gate.data.spec import (
    DEFAULT_GOLD_RATE,
    DatasetEntry,
    Excluded,
    Gold,
    QuestionOrder,
    Registration,
    SamplingRecord,
)
from flyspec.gate.data.store import GateStore, RegisteredQuestion
from flyspec.gate.grading.graders import check_reference, model_graded, model_graded_names
from flyspec.gate.runs.settings import ArmSpec, GateOptions, RunSettings
from flyspec.gate.runs.tune_settings import TuneOptions, TuneSetting, tune_settings

ORDER_RULE = "sha256(seed:dataset:id) ascending"
Options = TypeVar("Options", bound=RunSettings)
Datasets = dict[str, tuple[str, list[Question]]]
"""Per dataset name in reports: its spec as given and every question."""


@dataclass(frozen=True)
class Plan(Generic[Options]):
    """A validated run: its settings, its arms by name, every question of its datasets; for a judged run
    the judge and the gold-label rule, for a tune its settings (each one's arm among ``arms``)."""

    options: Options
    arms: dict[str, Arm]
    datasets: Datasets
    judge: Judge | None = None
    gold: Gold | None = None
    settings: tuple[TuneSetting, ...] = ()

    @property
    def baseline(self) -> Arm:
        return self.arms["baseline"]

    def setting(self, setting_id: str) -> TuneSetting:
        return next(s for s in self.settings if s.id == setting_id)

    def model_graded(self) -> list[tuple[str, str]]:
        """``(dataset, grader)`` of each dataset with questions a model grades (the first such grader)."""
        found = []
        for name, (_, questions) in self.datasets.items():
            grader = next((q.grader for q in questions if model_graded(q.grader)), None)
            if grader is not None:
                found.append((name, grader))
        return found

    def pool(self, excluded: Collection[QuestionKey], limit: int | None = None) -> list[Question]:
        """Every question of the datasets in the registered order (docs/gate.md, "Which questions, in which
        order"), without ``excluded``; ``limit``: the first N of each dataset's order."""
        by_dataset = {name: qs for name, (_, qs) in self.datasets.items()}
        seed = self.options.question_order_seed
        return select_questions(by_dataset, seed=seed, limit=limit, excluded=excluded)

    def registration(self, kind: str, questions: Sequence[Question] | None = None) -> Registration:
        """What every kind registers: margin, alpha, seeds, sampling, the alpha budget when one is set, and
        each dataset's sha256 and size (with ``questions``, how many of them the run registered). What
        the servers report is added by ``identified``."""
        o = self.options
        return Registration(
            kind=kind,
            margin=float(o.margin),
            alpha=float(o.alpha),
            seed=o.seed,
            sampling=SamplingRecord(o.temperature, o.top_p, o.max_tokens),
            shuffle_seed=o.shuffle_seed,
            alpha_budget=float(o.alpha_budget) if o.alpha_budget is not None else None,
            datasets=self.dataset_entries(questions),
        )

    def identified(self, registration: Registration, served: Served) -> Registration:
        """``registration`` with each arm's identity, and the judge's, as registered: an endpoint's with the
        model ``served`` says its server serves."""
        arms = {name: arm.identity(served.get(name)) for name, arm in self.arms.items()}
        judge = self.judge.identity(served.get(JUDGE_ARM)) if self.judge is not None else None
        return replace(registration, arms=arms, judge=judge)

    def dataset_entries(self, questions: Sequence[Question] | None = None) -> dict[str, DatasetEntry]:
        """Each dataset's sha256 and size; with ``questions``, how many of them the run registered."""
        counts: dict[str, int] = {name: 0 for name in self.datasets}
        for q in questions or ():
            counts[q.dataset] += 1
        return {
            name: DatasetEntry(
                dataset_info(spec).sha256, counts[name] if questions is not None else None, len(qs)
            )
            for name, (spec, qs) in self.datasets.items()
        }

    def order(self, pool: int, rule: str = ORDER_RULE) -> QuestionOrder:
        """How the questions were ordered, and the number they were drawn from."""
        return QuestionOrder(self.options.question_order_seed, rule, pool)

    @staticmethod
    def excluded(runs: Sequence[str], questions: int) -> Excluded:
        """Which runs' questions were left out, and how many."""
        return Excluded(tuple(runs), questions)


@dataclass(frozen=True)
class Chosen:
    """A run's questions in their registered order (a tune's test questions), the number they were drawn
    from, the questions left out and the runs that used them, a tune's calibration questions (set aside
    first), and the fixed run whose questions lead a sequential continuation (its answers carried)."""

    questions: tuple[Question, ...]
    pool: int
    left_out: frozenset[QuestionKey] = frozenset()
    left_out_by: tuple[str, ...] = ()
    calibration: tuple[Question, ...] = ()
    carry: str | None = None


def plan(options: Options) -> Plan[Options]:
    """The plan of a gate run, pilot or tune: its arms parsed (ValueError naming the first bad one), its
    datasets read, every reference answer checked against its grader; a gate run's judge, a tune's
    settings; and too few questions refused. Nothing touches the store."""
    specs: dict[str, ArmSpec] = {"baseline": options.baseline}
    if isinstance(options, GateOptions):
        if options.candidate is not None:
            specs["candidate"] = options.candidate
        specs.update(options.controls)
    arms = {name: parse_arm(name, spec) for name, spec in specs.items()}
    planned = Plan(options, arms, load_datasets(options.datasets, options.shuffle_seed))
    planned = _with_settings(planned) if isinstance(options, TuneOptions) else _with_judge(planned)
    choose(planned)
    return planned


def _with_settings(planned: Plan[Options]) -> Plan[Options]:
    """A tune's plan: its settings, each one's arm beside the baseline; judged questions refused."""
    settings = tuple(tune_settings(planned.options, planned.baseline))
    judged = planned.model_graded()
    if judged:
        raise ValueError(
            f"dataset {judged[0][0]!r}: gate tune cannot use judge questions: a judged baseline answer is "
            "right or wrong only against one candidate, so it cannot be shared by several settings"
        )
    return replace(planned, arms={**planned.arms, **{s.id: s.arm for s in settings}}, settings=settings)


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
) -> Chosen:
    """The run's questions: the seeded order without ``left_out`` (the questions of the runs ``by``), the
    questions of ``first`` (a carried run's order) leading; a tune's calibration questions set aside
    first. ValueError when the datasets hold too few."""
    o = planned.options
    pool = planned.pool(left_out, o.limit if isinstance(o, GateOptions) else None)
    if first:
        lead = {key: i for i, key in enumerate(first)}
        led = sorted((q for q in pool if (q.dataset, q.id) in lead), key=lambda q: lead[(q.dataset, q.id)])
        pool = led + [q for q in pool if (q.dataset, q.id) not in lead]
    c = o.calibration_questions if isinstance(o, TuneOptions) else None
    if c is not None and len(pool) <= c:
        raise ValueError(
            f"calibration_questions={c}: the datasets hold {len(pool)} questions, which leaves none to test"
        )
    calibration, rest = pool[: c or 0], pool[c or 0 :]
    if o.max_questions is not None and o.max_questions > len(rest):
        if c is not None:
            raise ValueError(
                f"max_questions={o.max_questions}: {len(rest)} questions remain once the {c} calibration "
                "questions are set aside"
            )
        used = f" once the {len(left_out)} used by {', '.join(by)} are left out" if by else ""
        raise ValueError(f"max_questions={o.max_questions}: the datasets hold {len(pool)} questions{used}")
    questions = rest[: o.max_questions] if o.max_questions is not None else rest
    return Chosen(tuple(questions), len(rest), frozenset(left_out), tuple(by), tuple(calibration))


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


def registered(questions: Sequence[Question]) -> list[RegisteredQuestion]:
    """The questions as the store registers them, in order."""
    return [
        RegisteredQuestion(q.dataset, q.id, i, q.prompt_hash, q.answer, q.grader)
        for i, q in enumerate(questions)
    ]


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
