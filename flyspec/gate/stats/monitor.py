"""The sequential run's stopping rule, applied while answers arrive out of order.

A sequential run registers its questions in a seeded random order (flyspec/gate/data/order.py) and the
confidence sequence is defined on the paired differences ``D_i = candidate correct - baseline correct``
*in that order*. Answers complete out of order (many are in flight at once, and long answers take longer),
so the run monitors the longest prefix of the registered order in which every question has both answers:
when question ``i`` completes before question ``i - 1``, it waits until ``i - 1`` completes too.

Why not the order in which pairs complete: that order depends on how long the answers are, and answer
length is related to correctness (a model that rambles is often wrong), so the sequence would no longer
be a random-order sample of the questions, which the confidence sequence assumes. With the registered
order, the stopping point is a function of ``D_1, D_2, ...`` only: the same data always stop at the same
question, whichever answers happened to finish first, and a report or a resumed run recomputes the
same stop from the stored answers. Answers that complete after the stop (they were already in flight)
lie beyond it in the order and are stored without changing the decision.

Stops that do not come from the data (the time budget, Ctrl-C, an endpoint failing) are recorded as
events in the store with the prefix length at that moment, and the report decides there (INCONCLUSIVE,
with the interval at that point) even if answers in flight completed later. Such a run is paused, not
finished: rerunning the same command continues along the same order, which the confidence sequence
allows (it holds at every stopping time at once, however the time was chosen).
"""

from __future__ import annotations

import copy
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from flyspec.gate.stats.decision import FAIL, INCONCLUSIVE, PASS
from flyspec.gate.stats.sequential import ConfidenceSequence, sequential_decision_with_undecided

CS_METHOD = (
    "betting confidence sequence (Waudby-Smith and Ramdas: hedged capital, a mixture of constant bets), "
    "without replacement over the question pool, at level 1 - 2 alpha"
)
CS_METHOD_IID = (
    "betting confidence sequence (Waudby-Smith and Ramdas: hedged capital, a mixture of constant bets), "
    "questions as independent draws, at level 1 - 2 alpha"
)
SUPERPOPULATION = "superpopulation"
FINITE = "finite"
CLAIMS = {
    SUPERPOPULATION: (
        "about the method on questions like these: the questions are treated as a random sample from a "
        "larger population, and each answer's run-to-run randomness (batching, sampling) is part of what "
        "is measured, so another run on other such questions is covered"
    ),
    FINITE: (
        "about exactly these registered questions, in this run's outputs: the interval closes on their "
        "mean as the pool is used up, but it says nothing about other questions, or about another run "
        "whose outputs differ by chance (declared with --population finite)"
    ),
}
DATA_STOPS = ("boundary", "max_questions")
PAUSES = ("time_budget", "interrupted", "error")

QuestionKey = tuple[str, str]
Lane = tuple[str, int]
BASELINE: Lane = ("baseline", 0)
CANDIDATE: Lane = ("candidate", 0)


class SessionEvent(Protocol):
    """A session's start or stop as the store records it (``flyspec.gate.data.store.RunEvent``): a stop
    names why (``reason``) and the in-order prefix reached then (``stopped_at``)."""

    @property
    def event(self) -> str: ...

    @property
    def reason(self) -> str | None: ...

    @property
    def stopped_at(self) -> int | None: ...


@dataclass(frozen=True)
class SequentialPlan:
    """What a sequential run registers before its first answer."""

    margin: float
    alpha: float
    max_questions: int
    population_size: int
    order_seed: int
    population: str = FINITE
    """The claim (``CLAIMS``): ``superpopulation`` (the default of new runs) or ``finite`` (runs registered
    before the claim was a choice, and runs that declare ``--population finite``)."""

    @property
    def cs_population_size(self) -> int | None:
        """The population size the confidence sequence samples without replacement from (None: i.i.d.)."""
        return self.population_size if self.population == FINITE else None

    @property
    def method(self) -> str:
        return CS_METHOD if self.population == FINITE else CS_METHOD_IID

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "method": self.method,
            "margin": self.margin,
            "alpha": self.alpha,
            "level": 1 - 2 * self.alpha,
            "max_questions": self.max_questions,
            "population_size": self.population_size,
            "order_seed": self.order_seed,
        }
        # Absent means finite: the registrations made before the claim was a choice stay as they were.
        if self.population != FINITE:
            out["population"] = self.population
        return out

    @classmethod
    def from_registration(cls, data: Mapping[str, object]) -> SequentialPlan:
        return cls(
            margin=float(data["margin"]),  # type: ignore[arg-type]
            alpha=float(data["alpha"]),  # type: ignore[arg-type]
            max_questions=int(data["max_questions"]),  # type: ignore[call-overload]
            population_size=int(data["population_size"]),  # type: ignore[call-overload]
            order_seed=int(data["order_seed"]),  # type: ignore[call-overload]
            population=str(data.get("population", FINITE)),
        )


@dataclass(frozen=True)
class SequentialStop:
    """Where and why a sequential run stopped, the bounds there and the counts of the pairs it used.

    ``reason``: ``boundary`` (a bound crossed -margin), ``max_questions`` (every registered question has
    both answers), ``time_budget``, ``interrupted`` or ``error`` (paused: a rerun continues), or
    ``in_progress`` (still running, or killed before it could record a stop: a rerun continues).
    ``lost``/``gained`` count the decided pairs; ``undecided`` the judged pairs whose judge could not decide,
    counted as lost for the lower bound and as gained for the upper one.
    """

    decision: str
    reason: str
    stopped_at: int
    low: float
    high: float
    loss_detected: bool
    lost: int
    gained: int
    complete_prefix: int
    undecided: int = 0

    @property
    def final(self) -> bool:
        """True when the data decided the stop (a rerun answers nothing more)."""
        return self.reason in DATA_STOPS


def in_order_diffs(
    order: Sequence[QuestionKey],
    correct: Mapping[tuple[str, int, str, str], bool],
    lanes: tuple[Lane, Lane] = (BASELINE, CANDIDATE),
) -> list[int]:
    """Paired differences (second lane minus first) along the registered order, up to the first question
    missing an answer."""
    return in_order_pairs(order, correct, lanes)[0]


def in_order_pairs(
    order: Sequence[QuestionKey],
    correct: Mapping[tuple[str, int, str, str], bool],
    lanes: tuple[Lane, Lane] = (BASELINE, CANDIDATE),
    judged: Collection[QuestionKey] = (),
) -> tuple[list[int], list[bool]]:
    """``in_order_diffs`` and, for each pair, whether it is undecided: a judged question whose two
    answers were both graded wrong (the judge's two orders disagreed or a verdict was unreadable)."""
    first, second = lanes
    diffs: list[int] = []
    undecided: list[bool] = []
    for dataset, qid in order:
        base = correct.get((*first, dataset, qid))
        cand = correct.get((*second, dataset, qid))
        if base is None or cand is None:
            break
        diffs.append(int(cand) - int(base))
        undecided.append(is_undecided((dataset, qid), base, cand, judged))
    return diffs, undecided


def is_undecided(key: QuestionKey, base: bool, cand: bool, judged: Collection[QuestionKey]) -> bool:
    """A judged pair graded wrong on both sides is undecided (flyspec/gate/runs/judging.py grades it so)."""
    return not base and not cand and key in judged


def _stop(
    diffs: list[int], undecided: list[bool], plan: SequentialPlan, reason: str, upto: int
) -> SequentialStop:
    used = diffs[:upto]
    if not used:
        return SequentialStop(INCONCLUSIVE, reason, 0, -1.0, 1.0, False, 0, 0, len(diffs))
    walk = sequential_decision_with_undecided(
        used, undecided[:upto], plan.margin, plan.alpha, population_size=plan.cs_population_size
    )
    if walk.decision in (PASS, FAIL):
        reason, upto = "boundary", walk.stopped_at
    counted = used[:upto]
    return SequentialStop(
        decision=walk.decision,
        reason=reason,
        stopped_at=upto,
        low=walk.low,
        high=walk.high,
        loss_detected=walk.loss_detected,
        lost=counted.count(-1),
        gained=counted.count(1),
        complete_prefix=len(diffs),
        undecided=sum(undecided[:upto]),
    )


def sequential_stop(
    order: Sequence[QuestionKey],
    correct: Mapping[tuple[str, int, str, str], bool],
    plan: SequentialPlan,
    events: Sequence[SessionEvent] = (),
    lanes: tuple[Lane, Lane] = (BASELINE, CANDIDATE),
    judged: Collection[QuestionKey] = (),
) -> SequentialStop:
    """The stop a sequential run reached, recomputed from its stored answers and session events.

    When the last session ended with a pause (time budget, Ctrl-C, error), the stop is where that pause
    was recorded: answers that completed after it are stored but wait for a resume. Otherwise the first
    crossing along the complete prefix decides; without one, a prefix covering every registered question
    stops at ``max_questions``; else the run is ``in_progress`` (running, or killed). ``lanes`` are the
    baseline and candidate lanes (``gate tune`` pairs the baseline with each setting in turn) and
    ``events`` that pair's session events; ``judged`` the questions graded by a judge, whose undecided
    pairs count against the claim being tested.
    """
    diffs, undecided = in_order_pairs(order, correct, lanes, judged)
    last = events[-1] if events else None
    if last is not None and last.event == "stop" and last.reason in PAUSES and last.stopped_at is not None:
        return _stop(diffs, undecided, plan, last.reason, min(last.stopped_at, len(diffs)))
    walk = _stop(diffs, undecided, plan, "in_progress", len(diffs))
    if walk.reason == "in_progress" and len(diffs) >= plan.max_questions:
        return _stop(diffs, undecided, plan, "max_questions", plan.max_questions)
    return walk


class SequentialMonitor:
    """Updates the confidence sequence as pairs complete along the registered order; stops once.

    ``add`` takes every graded answer (in any order) and returns the stop when this answer causes it.
    The same data give the same stop as ``sequential_stop`` (both follow the registered order).
    """

    def __init__(
        self,
        order: Sequence[QuestionKey],
        plan: SequentialPlan,
        lanes: tuple[Lane, Lane] = (BASELINE, CANDIDATE),
        judged: Collection[QuestionKey] = (),
    ) -> None:
        self.order = list(order)
        self.plan = plan
        self.lanes = lanes
        self.judged = frozenset(judged)
        self.correct: dict[tuple[str, int, str, str], bool] = {}
        self.prefix = 0
        self.lost = self.gained = self.undecided = 0
        self.low, self.high = -1.0, 1.0
        self.stop: SequentialStop | None = None
        # The lower bounds count an undecided pair as lost, the upper bounds as gained; the two sequences
        # are one until the first undecided pair, when the upper one starts as a copy of the lower.
        self._lower = ConfidenceSequence(alpha=2 * plan.alpha, population_size=plan.cs_population_size)
        self._upper: ConfidenceSequence | None = None

    def add(
        self, arm: str, repeat: int, dataset: str, question_id: str, correct: bool
    ) -> SequentialStop | None:
        """Record one answer; returns the stop if this answer completed the pair that crossed (or the
        last registered pair), else None. After the stop, answers are recorded but change nothing."""
        self.correct[(arm, repeat, dataset, question_id)] = correct
        if self.stop is not None:
            return None
        while self.prefix < len(self.order):
            dataset_i, qid = self.order[self.prefix]
            base = self.correct.get((*self.lanes[0], dataset_i, qid))
            cand = self.correct.get((*self.lanes[1], dataset_i, qid))
            if base is None or cand is None:
                return None
            d = int(cand) - int(base)
            undecided = is_undecided((dataset_i, qid), base, cand, self.judged)
            self.prefix += 1
            self.lost += d == -1
            self.gained += d == 1
            self.undecided += undecided
            if undecided and self._upper is None:
                self._upper = copy.deepcopy(self._lower)
            self.low, self.high = self._lower.update(-1 if undecided else d)
            if self._upper is not None:
                self.high = self._upper.update(1 if undecided else d)[1]
            crossed = self.low > -self.plan.margin or self.high < -self.plan.margin
            if crossed or self.prefix >= self.plan.max_questions:
                decision = PASS if self.low > -self.plan.margin else FAIL if crossed else INCONCLUSIVE
                self.stop = SequentialStop(
                    decision=decision,
                    reason="boundary" if crossed else "max_questions",
                    stopped_at=self.prefix,
                    low=self.low,
                    high=self.high,
                    loss_detected=self.high < 0,
                    lost=self.lost,
                    gained=self.gained,
                    complete_prefix=self.prefix,
                    undecided=self.undecided,
                )
                return self.stop
        return None
