"""A sequential run along its registered order (docs/gate.md, "Sequential runs: the in-order rule"): the
plan it registers (``SequentialPlan.rule`` is what ``Rule.decide`` reads), its pairs in that order, and the
one ``Monitor`` that walks a running run as answers or judged pairs complete and stops it where
``Rule.decide`` on the same pairs stops.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import takewhile

from flyspec.gate.stats.decide import (
    INCONCLUSIVE,
    POPULATIONS,
    Evidence,
    Outcome,
    Rule,
    SessionEvent,
    claim,
)
from flyspec.gate.stats.judged import JudgedPair, usable_prefix
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

QuestionKey = tuple[str, str]
Lane = tuple[str, int]
Item = int | JudgedPair
"""One question's entry in a walk: an exact-graded pair's difference, or a judged pair."""
BASELINE: Lane = ("baseline", 0)
CANDIDATE: Lane = ("candidate", 0)


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

    @property
    def rule(self) -> Rule:
        """What ``verdict`` needs of this plan."""
        judged = self.method == JUDGED_METHOD
        return Rule(
            self.margin,
            self.alpha,
            self.max_questions,
            sequential=True,
            population_size=self.sequence_population,
            label_rate=self.label_rate if judged else None,
            label_bet=self.label_bet if judged else None,
        )


def in_order_diffs(
    order: Sequence[QuestionKey],
    correct: Mapping[tuple[str, int, str, str], bool],
    lanes: tuple[Lane, Lane] = (BASELINE, CANDIDATE),
) -> list[int]:
    """Paired differences (second lane minus first) along the registered order, up to the first question
    missing an answer."""
    found = (_difference(key, correct, lanes) for key in order)
    return list(takewhile(lambda d: d is not None, found))


def paired_diffs(
    order: Sequence[QuestionKey], correct: Mapping[tuple[str, int, str, str], bool], lanes: tuple[Lane, Lane]
) -> list[int]:
    """The differences of every question with both answers, in the registered order (a fixed run's)."""
    return [d for d in (_difference(key, correct, lanes) for key in order) if d is not None]


def _difference(
    key: QuestionKey, correct: Mapping[tuple[str, int, str, str], bool], lanes: tuple[Lane, Lane]
) -> int | None:
    """A question's difference (second lane's correct minus the first's); None until both are in."""
    base = correct.get((*lanes[0], *key))
    cand = correct.get((*lanes[1], *key))
    if base is None or cand is None:
        return None
    return int(cand) - int(base)


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
) -> Outcome:
    """``sequential_stop`` for a judged run, whose prefix also ends at the first pair waiting for its gold
    label (``usable_prefix``)."""
    if plan.method != JUDGED_METHOD:
        raise ValueError(f"a judged stop needs a plan registered with method {JUDGED_METHOD!r}")
    seen = in_order_judged(order, pairs)
    usable = usable_prefix(seen)
    return plan.rule.decide(Evidence(seen[:usable], events, awaiting=usable < len(seen)))


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
        self.order: list[QuestionKey] = []
        self.position: dict[QuestionKey, int] = {}
        self.extend(order)
        self.plan = plan
        self.lanes = lanes
        self.correct: dict[tuple[str, int, str, str], bool] = {}
        self.items: dict[QuestionKey, Item] = {}
        self.prefix = 0
        self.stop: Outcome | None = None
        self.walk = plan.rule.walk()

    low = property(lambda self: self.walk.low)
    high = property(lambda self: self.walk.high)
    lost = property(lambda self: self.walk.lost)
    gained = property(lambda self: self.walk.gained)
    labelled = property(lambda self: self.walk.labelled)

    def extend(self, keys: Sequence[QuestionKey]) -> None:
        """Append questions to the order (a shadow run registers each request as it arrives)."""
        for key in keys:
            self.position[key] = len(self.order)
            self.order.append(key)

    @property
    def awaiting_label(self) -> bool:
        """True when the next pair in order is in but waits for its gold label."""
        nxt = self.items.get(self.order[self.prefix]) if self.prefix < len(self.order) else None
        return nxt is not None and _waiting(nxt)

    def add(self, arm: str, repeat: int, dataset: str, question_id: str, correct: bool) -> Outcome | None:
        """Record one exact-graded answer; returns the stop if this answer completed the pair that crossed
        (or the last registered pair), else None. After the stop, answers are recorded but change nothing."""
        self.correct[(arm, repeat, dataset, question_id)] = correct
        key = (dataset, question_id)
        d = _difference(key, self.correct, self.lanes)
        if d is not None:
            self.items[key] = d
        return self._advance()

    def add_pair(self, key: QuestionKey, pair: JudgedPair) -> Outcome | None:
        """Record a judged pair (or its gold label); returns the stop if this completed it, else None."""
        known = self.items.get(key)
        if known is not None and self.position[key] < self.prefix and known != pair:
            raise ValueError(f"question {key}: already counted with {known}; a counted pair cannot change")
        self.items[key] = pair
        return self._advance()

    def _advance(self) -> Outcome | None:
        if self.stop is not None:
            return None
        while self.prefix < len(self.order):
            item = self.items.get(self.order[self.prefix])
            if item is None or _waiting(item):
                return None
            self.prefix += 1
            self.walk.add(item)  # type: ignore[arg-type]
            if self.walk.decision().decision != INCONCLUSIVE or self.prefix >= self.plan.max_questions:
                # The stop is the report's: the rule's decision on the same in-order pairs.
                done = [self.items[key] for key in self.order[: self.prefix]]
                self.stop = self.plan.rule.decide(Evidence(done), self.walk)  # type: ignore[arg-type]
                return self.stop
        return None


def _waiting(item: Item) -> bool:
    return isinstance(item, JudgedPair) and item.waiting
