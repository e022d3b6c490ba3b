"""A sequential run's stopping rule along its registered order (docs/gate.md, "Sequential runs: the
in-order rule"): the plan it registers, the one ``Monitor`` that walks the run as answers or judged pairs
complete, and the report's replay of the stored pairs through the same walk (``sequential_stop``,
``judged_stop``), so both reach the same stop on the same data.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import takewhile
from typing import Protocol

from flyspec.gate.stats.decide import POPULATIONS, SequentialWalk, claim
from flyspec.gate.stats.judged import JudgedPair, JudgedWalk, usable_prefix
from flyspec.gate.stats.sequence import check_bet

CS_METHOD = (
    "betting confidence sequence (Waudby-Smith and Ramdas: hedged capital, a mixture of constant bets), "
    "without replacement over the question pool, at level 1 - 2 alpha"
)
"""The method text of registrations made before ``population`` and ``method_key`` were recorded."""
METHODS = {
    "wsr-mixture": "betting confidence sequence (Waudby-Smith and Ramdas: hedged capital, a mixture of "
    "constant bets)",
    "ppi-mixture": "prediction-powered betting confidence sequence on gold labels (Angelopoulos et al.; "
    "Waudby-Smith and Ramdas: a mixture of constant bets on the bounded values)",
}
"""Method keys a plan may record: how its confidence sequence is computed (docs/statistics.md)."""
DEFAULT_METHOD = "wsr-mixture"
JUDGED_METHOD = "ppi-mixture"
DATA_STOPS = ("boundary", "max_questions")
PAUSES = ("time_budget", "interrupted", "error")

QuestionKey = tuple[str, str]
Lane = tuple[str, int]
Item = int | JudgedPair
"""One question's entry in a walk: an exact-graded pair's difference, or a judged pair."""
Walk = SequentialWalk | JudgedWalk
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
    """What a sequential run registers before its first answer: the claim (``population``: the i.i.d.
    sequence, or the finite pool's without-replacement one, which registrations older than the field
    used), the ``method`` (a key of ``METHODS``), and for a judged run its ``label_rate`` and the version
    of its bets (``label_bet``, ``BET_VERSIONS``). Judged runs always use the i.i.d. sequence."""

    margin: float
    alpha: float
    max_questions: int
    population_size: int
    order_seed: int
    population: str = "superpopulation"
    method: str = DEFAULT_METHOD
    label_rate: float | None = None
    label_bet: int | None = None

    def __post_init__(self) -> None:
        if self.population not in POPULATIONS:
            raise ValueError(f"population={self.population!r}: one of {', '.join(POPULATIONS)}")
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r}: one of {', '.join(METHODS)}")
        if (self.method == JUDGED_METHOD) != (self.label_rate is not None):
            raise ValueError(f"a label rate goes with method {JUDGED_METHOD!r}, and only with it")
        if (self.label_rate is not None) != (self.label_bet is not None):
            raise ValueError("a judged plan registers both its label rate and the version of its bets")
        if self.label_bet is not None:
            check_bet(self.label_bet)

    @property
    def sequence_population(self) -> int | None:
        """The ``population_size`` argument of the confidence sequence: the pool for the finite claim,
        None (the i.i.d. sequence) for the default claim and for judged runs."""
        if self.population == "finite" and self.method != JUDGED_METHOD:
            return self.population_size
        return None

    @property
    def description(self) -> str:
        """The method in words, as registered."""
        pool = ", without replacement over the question pool" if self.sequence_population else ""
        return f"{METHODS[self.method]}{pool}, at level 1 - 2 alpha"

    @property
    def claim(self) -> str:
        """What a decision of this run speaks about, in one sentence."""
        return claim(self.population, self.population_size)


@dataclass(frozen=True)
class SequentialStop:
    """Where and why a sequential run stopped (``reason``: one of ``DATA_STOPS``, ``PAUSES`` or
    ``in_progress``), the bounds there and the pairs' counts (a judged run's: the judge's verdicts, its
    gold labels, and whether the prefix waits for one, ``awaiting_label``)."""

    decision: str
    reason: str
    stopped_at: int
    low: float
    high: float
    loss_detected: bool
    lost: int
    gained: int
    complete_prefix: int
    labelled: int = 0
    awaiting_label: bool = False

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
    found = (_difference(key, correct, lanes) for key in order)
    return list(takewhile(lambda d: d is not None, found))


def _difference(
    key: QuestionKey, correct: Mapping[tuple[str, int, str, str], bool], lanes: tuple[Lane, Lane]
) -> int | None:
    """A question's difference (second lane's correct minus the first's); None until both are in."""
    base = correct.get((*lanes[0], *key))
    cand = correct.get((*lanes[1], *key))
    if base is None or cand is None:
        return None
    return int(cand) - int(base)


def _walk(plan: SequentialPlan) -> Walk:
    """The walk the plan registered: the prediction-powered one for a judged run, else the exact one."""
    if plan.method != JUDGED_METHOD:
        return SequentialWalk(plan.margin, plan.alpha, plan.sequence_population)
    if plan.label_rate is None or plan.label_bet is None:
        raise ValueError(
            f"a judged walk needs a plan registered with method {JUDGED_METHOD!r} and a label rate"
        )
    return JudgedWalk(plan.label_rate, plan.margin, plan.alpha, bet=plan.label_bet)


def _stopped(walk: Walk, reason: str, complete_prefix: int, awaiting: bool = False) -> SequentialStop:
    """The stop of a walk: at its crossing (``boundary``) or where it ended for ``reason``."""
    end = walk.decision()
    reason = "boundary" if walk.stop is not None else reason
    return SequentialStop(
        decision=end.decision,
        reason=reason,
        stopped_at=walk.n,
        low=end.low,
        high=end.high,
        loss_detected=end.loss_detected,
        lost=walk.lost,
        gained=walk.gained,
        complete_prefix=complete_prefix,
        labelled=walk.labelled,
        awaiting_label=awaiting and reason != "boundary",
    )


def _replayed(
    items: Sequence[Item], plan: SequentialPlan, events: Sequence[SessionEvent], awaiting: bool = False
) -> SequentialStop:
    """Where a run stopped, replaying its walk over its complete in-order ``items``: at a pause recorded
    last (answers completed after it wait for a resume), else at the first crossing, else at
    ``max_questions`` once every registered pair is in, else ``in_progress``."""

    def walked(reason: str, upto: int) -> SequentialStop:
        return _stopped(_walk(plan).run(items[:upto]), reason, len(items), awaiting)

    last = events[-1] if events else None
    if last is not None and last.event == "stop" and last.reason in PAUSES and last.stopped_at is not None:
        return walked(last.reason, min(last.stopped_at, len(items)))
    stop = walked("in_progress", len(items))
    if stop.reason == "in_progress" and len(items) >= plan.max_questions:
        return walked("max_questions", plan.max_questions)
    return stop


def sequential_stop(
    order: Sequence[QuestionKey],
    correct: Mapping[tuple[str, int, str, str], bool],
    plan: SequentialPlan,
    events: Sequence[SessionEvent] = (),
    lanes: tuple[Lane, Lane] = (BASELINE, CANDIDATE),
) -> SequentialStop:
    """The stop a sequential run reached, replayed from its stored answers and session ``events``;
    ``lanes``: the baseline's and candidate's (``gate tune`` pairs the baseline with each setting)."""
    return _replayed(in_order_diffs(order, correct, lanes), plan, events)


def in_order_judged(
    order: Sequence[QuestionKey], pairs: Mapping[QuestionKey, JudgedPair]
) -> list[JudgedPair]:
    """The judged pairs along the registered order, up to the first question without a pair."""
    return list(takewhile(lambda pair: pair is not None, (pairs.get(key) for key in order)))


def judged_stop(
    order: Sequence[QuestionKey],
    pairs: Mapping[QuestionKey, JudgedPair],
    plan: SequentialPlan,
    events: Sequence[SessionEvent] = (),
) -> SequentialStop:
    """``sequential_stop`` for a judged run, whose prefix also ends at the first pair waiting for its gold
    label (``usable_prefix``)."""
    if plan.method != JUDGED_METHOD:
        raise ValueError(f"a judged stop needs a plan registered with method {JUDGED_METHOD!r}")
    seen = in_order_judged(order, pairs)
    usable = usable_prefix(seen)
    return _replayed(seen[:usable], plan, events, awaiting=usable < len(seen))


class Monitor:
    """A sequential run's stopping rule while answers arrive in any order: the walk its plan names advances
    along the registered order as pairs complete (``add`` an exact-graded answer, ``add_pair`` a judged
    pair, again once its gold label arrives), and stops once."""

    def __init__(
        self,
        order: Sequence[QuestionKey],
        plan: SequentialPlan,
        lanes: tuple[Lane, Lane] = (BASELINE, CANDIDATE),
    ) -> None:
        self.order = list(order)
        self.plan = plan
        self.lanes = lanes
        self.correct: dict[tuple[str, int, str, str], bool] = {}
        self.items: dict[QuestionKey, Item] = {}
        self.prefix = 0
        self.stop: SequentialStop | None = None
        self.walk = _walk(plan)

    low = property(lambda self: self.walk.low)
    high = property(lambda self: self.walk.high)
    lost = property(lambda self: self.walk.lost)
    gained = property(lambda self: self.walk.gained)
    labelled = property(lambda self: self.walk.labelled)

    @property
    def awaiting_label(self) -> bool:
        """True when the next pair in order is in but waits for its gold label."""
        nxt = self.items.get(self.order[self.prefix]) if self.prefix < len(self.order) else None
        return nxt is not None and _waiting(nxt)

    def add(
        self, arm: str, repeat: int, dataset: str, question_id: str, correct: bool
    ) -> SequentialStop | None:
        """Record one exact-graded answer; returns the stop if this answer completed the pair that crossed
        (or the last registered pair), else None. After the stop, answers are recorded but change nothing."""
        self.correct[(arm, repeat, dataset, question_id)] = correct
        key = (dataset, question_id)
        d = _difference(key, self.correct, self.lanes)
        if d is not None:
            self.items[key] = d
        return self._advance()

    def add_pair(self, key: QuestionKey, pair: JudgedPair) -> SequentialStop | None:
        """Record a judged pair (or its gold label); returns the stop if this completed it, else None."""
        known = self.items.get(key)
        if known is not None and self.order.index(key) < self.prefix and known != pair:
            raise ValueError(f"question {key}: already counted with {known}; a counted pair cannot change")
        self.items[key] = pair
        return self._advance()

    def _advance(self) -> SequentialStop | None:
        if self.stop is not None:
            return None
        while self.prefix < len(self.order):
            item = self.items.get(self.order[self.prefix])
            if item is None or _waiting(item):
                return None
            self.prefix += 1
            crossed = self.walk.add(item) is not None
            if crossed or self.prefix >= self.plan.max_questions:
                self.stop = _stopped(self.walk, "max_questions", self.prefix)
                return self.stop
        return None


def _waiting(item: Item) -> bool:
    return isinstance(item, JudgedPair) and item.waiting
