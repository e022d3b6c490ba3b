"""A validated run before anything touches the store, and what every kind of run registers: ``plan``
turns a run's settings and arms into a ``Plan`` (arms parsed, datasets read and every reference checked);
``gate run``/``gate pilot`` (flyspec/gate/runs/runner.py) add the judge, ``gate tune``
(flyspec/gate/runs/tune.py) its settings and its calibration and test questions. ``Plan.registration``
holds the keys every kind registers (the settings, the arms' identities, the datasets' hashes); each kind
adds its own (a run its design and comparisons, a tune its settings and test order) and ``Plan.register``
registers it before the first answer (flyspec/gate/runs/loop.py has the order of that work).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from flyspec.gate.arms.base import Arm, Executor
from flyspec.gate.arms.judge import Judge
from flyspec.gate.arms.registry import parse_arm
from flyspec.gate.data.datasets import Question, dataset_info
from flyspec.gate.data.gold import Gold
from flyspec.gate.data.order import QuestionKey, select_questions
from flyspec.gate.data.registration import (
    DatasetEntry,
    Excluded,
    Extension,
    QuestionOrder,
    Registration,
    SamplingRecord,
)
from flyspec.gate.data.store import GateStore
from flyspec.gate.grading.graders import model_graded
from flyspec.gate.runs import loop
from flyspec.gate.runs.loop import Datasets, Served
from flyspec.gate.runs.options import ArmSpec, RunSettings

ORDER_RULE = "sha256(seed:dataset:id) ascending"
Options = TypeVar("Options", bound=RunSettings)


@dataclass(frozen=True)
class Plan(Generic[Options]):
    """A validated run: its settings, its arms by name, every question of its datasets, and for a judged
    run the judge and the gold-label rule."""

    options: Options
    arms: dict[str, Arm]
    datasets: Datasets
    judge: Judge | None = None
    gold: Gold | None = None

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

    def registration(
        self, kind: str, served: Served, questions: Sequence[Question] | None = None
    ) -> Registration:
        """What every kind registers: margin, alpha, seeds, sampling, the arms' identities (an endpoint's
        with the model ``served`` says it serves), the alpha budget when one is set, and each dataset's
        sha256 and size (with ``questions``, how many of them the run registered)."""
        o = self.options
        return Registration(
            kind=kind,
            margin=float(o.margin),
            alpha=float(o.alpha),
            seed=o.seed,
            sampling=SamplingRecord(o.temperature, o.top_p, o.max_tokens),
            arms=loop.identities(self.arms, served),
            shuffle_seed=o.shuffle_seed,
            alpha_budget=float(o.alpha_budget) if o.alpha_budget is not None else None,
            datasets=self.dataset_entries(questions),
        )

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

    def register(
        self,
        store: GateStore,
        run_id: str,
        questions: Sequence[Question],
        describe: Callable[[Served], Registration],
        executors: Sequence[Executor],
        amend: Callable[[Registration], tuple[Extension, ...]] | None = None,
        confirm: Callable[[Registration], None] | None = None,
    ) -> bool:
        """Register ``run_id`` before its first answer, or check that its resume has these settings: the
        resume is checked on the served models the store recorded, then ``executors`` (and the judge) are
        asked what they serve (``loop.register``). True when the run is new."""
        return loop.register(
            store,
            run_id,
            loop.registered(questions),
            describe,
            lambda: loop.ask_served(executors, self.judge),
            amend,
            confirm,
        )


def plan(options: Options, arms: Mapping[str, ArmSpec]) -> Plan[Options]:
    """A run's plan: its ``arms`` parsed (ValueError naming the first bad one) and its datasets read, every
    reference answer checked against its grader; nothing touches the store."""
    parsed = {name: parse_arm(name, spec) for name, spec in arms.items()}
    return Plan(options, parsed, loop.load_datasets(options.datasets, options.shuffle_seed))
