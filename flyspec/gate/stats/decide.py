"""The gate's decision (docs/statistics.md, "The decision rule"): the verdicts' names, the one rule that
turns an interval of delta into PASS, FAIL or INCONCLUSIVE (``classify``), and ``Rule.decide``, the one
decision of a comparison on its ``Evidence``, which every run, report, tune setting and compared log
calls: a fixed run's interval (Tango's for exact grades; the spec's ``decide`` is this on counts), or a
sequential or judged run's walk to its first crossing (``Walk``). Also the simulations' many runs at once
(``crossing_verdicts``, which tests/test_gate_stats_decide.py pins to the rule on the same draws, and which
also fails if a verdict is assigned anywhere else in the gate), and the family rule of ``gate tune``
(``fixed_sequence``). Standard library only at import, so that the command line reads the names and
checks without numpy or scipy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, NamedTuple, Protocol, TypeVar

from flyspec.checks import is_int, is_number

if TYPE_CHECKING:
    import numpy as np

    from flyspec.gate.stats.judged import JudgeCounts, JudgedPair

PASS, FAIL, INCONCLUSIVE = "PASS", "FAIL", "INCONCLUSIVE"
NOT_TESTED = "NOT TESTED"
DECISIONS = (PASS, FAIL, INCONCLUSIVE)
ItemT = TypeVar("ItemT")

SUPERPOPULATION = "superpopulation"
FINITE = "finite"
POPULATIONS = (SUPERPOPULATION, FINITE)
CLAIMS = {
    "superpopulation": (
        "The claim is about the method on questions like these: the per-question differences are treated "
        "as a random sample, so the verdict covers other questions drawn the same way and another run of "
        "these (run-to-run variation in the outputs included)."
    ),
    "finite": (
        "The claim is about these {n} questions as answered in this run: it holds for the mean over exactly "
        "this set with these outputs, and says nothing about other questions or another run of the same "
        "questions (the set was declared the whole population with --population finite)."
    ),
}
"""One plain sentence per population: what a sequential run's decision speaks about (docs/statistics.md,
"Which target to use: what a PASS claims")."""


def claim(population: str, population_size: int | None = None) -> str:
    """The plain-words claim of a sequential run over this population (``CLAIMS``)."""
    if population not in POPULATIONS:
        raise ValueError(f"population={population!r}: one of {', '.join(POPULATIONS)}")
    return CLAIMS[population].format(n=population_size if population_size is not None else "N")


def check_margin_alpha(margin: float, alpha: float) -> None:
    """Validate a run's non-inferiority margin and one-sided alpha (set before its first answer)."""
    if not is_number(margin, above=0, below=1):
        raise ValueError(
            f"margin={margin!r}: must lie in (0, 1); it is the tolerated accuracy loss as a fraction "
            "(0.02 = 2 points)"
        )
    if not is_number(alpha, above=0, below=0.5):
        raise ValueError(f"alpha={alpha!r}: must lie in (0, 0.5); it is the one-sided level (0.025 usual)")


@dataclass(frozen=True)
class Decision:
    """The gate's decision on the ``1 - 2 alpha`` interval ``[low, high]`` of delta (``classify``)."""

    decision: str
    loss_detected: bool
    low: float
    high: float


def classify(low: float, high: float, margin: float, can_decide: bool = True) -> Decision:
    """The rule: PASS when ``low > -margin`` (non-inferior), FAIL when ``high < -margin`` (worse than the
    margin), INCONCLUSIVE otherwise; ``loss_detected = high < 0`` (shown worse, with INCONCLUSIVE not by
    how much). ``can_decide=False`` (a judged run without a gold label yet): INCONCLUSIVE, no loss shown."""
    if not can_decide:
        return Decision(INCONCLUSIVE, False, low, high)
    if low > -margin:
        decision = PASS
    elif high < -margin:
        decision = FAIL
    else:
        decision = INCONCLUSIVE
    return Decision(decision=decision, loss_detected=high < 0, low=low, high=high)


def crossing_verdicts(passed: np.ndarray, failed: np.ndarray) -> np.ndarray:
    """``classify`` for many runs at once, from where each run's bounds stand against ``-margin``:
    ``passed`` (the lower bound above it), ``failed`` (the upper bound below it). PASS wins where both
    hold, as in ``classify``; an object array of "PASS", "FAIL" and "INCONCLUSIVE"."""
    import numpy as np

    return np.select([passed, failed], [PASS, FAIL], INCONCLUSIVE).astype(object)


def decide(n: int, lost: int, gained: int, margin: float, alpha: float = 0.025) -> Decision:
    """``classify`` on Tango's ``1 - 2 alpha`` interval of delta (``Rule.decide`` of a fixed run of ``n``
    pairs). A significant McNemar test alone never makes a FAIL: a loss smaller than the margin is what
    the margin allows; report ``mcnemar`` beside it."""
    from flyspec.gate.stats.paired import check_counts

    check_counts(n, lost, gained)
    end = Rule(margin, alpha, n).decide(Evidence([-1] * lost + [1] * gained + [0] * (n - lost - gained)))
    return Decision(end.decision, end.loss_detected, end.low, end.high)


@dataclass(frozen=True)
class SequentialDecision:
    """Outcome of walking the confidence sequence: the decision, where it stopped and the bounds there."""

    decision: str
    stopped_at: int
    low: float
    high: float
    loss_detected: bool


class Walk(Generic[ItemT]):
    """The running ``1 - 2 alpha`` bounds of delta along the registered order (``SequentialWalk``, or
    ``JudgedWalk``) and the counts of the pairs seen; ``Rule.decide`` applies the rule."""

    def __init__(self, margin: float) -> None:
        self.margin = margin
        self.n = self.lost = self.gained = self.labelled = 0
        self.low, self.high = -1.0, 1.0

    @property
    def can_decide(self) -> bool:
        """Whether the bounds may decide yet (a judged walk waits for its first gold label)."""
        return True

    def _moved(self, bounds: tuple[float, float], d: int, labelled: bool) -> None:
        self.low, self.high = bounds
        self.n += 1
        self.lost += d == -1
        self.gained += d == 1
        self.labelled += labelled

    def decision(self) -> Decision:
        """The rule on the bounds reached so far."""
        return classify(self.low, self.high, self.margin, self.can_decide)

    def add(self, item: ItemT) -> None:
        """Observe the next pair."""
        raise NotImplementedError


class SequentialWalk(Walk[int]):
    """The exact-graded walk: the confidence sequence of the paired differences."""

    def __init__(self, margin: float, alpha: float, population_size: int | None = None) -> None:
        from flyspec.gate.stats.sequence import ConfidenceSequence

        super().__init__(margin)
        self._sequence = ConfidenceSequence(2.0 * alpha, population_size)

    def add(self, d: int) -> None:
        """Observe the next pair's difference."""
        self._moved(self._sequence.update(d), d, False)


class JudgedWalk(Walk["JudgedPair"]):
    """A judged run's walk: the prediction-powered sequence (judged.py), which decides nothing before the
    first gold label. ``bet``: the registered version of the bets (None: the current one)."""

    def __init__(
        self, rate: float, margin: float, alpha: float, horizon: int | None = None, bet: int | None = None
    ) -> None:
        from flyspec.gate.stats.judged import JudgedSequence
        from flyspec.gate.stats.sequence import BET

        super().__init__(margin)
        self.sequence = JudgedSequence(rate, 2.0 * alpha, horizon, BET if bet is None else bet)

    @property
    def can_decide(self) -> bool:
        return self.labelled > 0

    def add(self, pair: JudgedPair) -> None:
        """Observe the next pair (not one waiting for its label)."""
        verdict = int(pair.prediction) if abs(pair.prediction) == 1 else 0
        self._moved(self.sequence.update(pair), verdict, pair.gold is not None)


@dataclass(frozen=True)
class JudgedDecision:
    """A judged run's decision: ``SequentialDecision``'s fields, the judge's ``counts``, the ``usable``
    pairs (before the first waiting for a label), and ``JudgedSequence``'s diagnostics at the stop."""

    decision: str
    stopped_at: int
    low: float
    high: float
    loss_detected: bool
    design: str
    rate: float
    usable: int
    counts: JudgeCounts
    normal_width: float | None
    emptied_at: int | None
    estimate: float | None
    bet: int

    @property
    def narrow(self) -> bool:
        """True when the interval is narrower than half the normal-theory width, or the set emptied: the
        values' mean likely changed along the order (as a draw correlated with the order makes it)."""
        if self.emptied_at is not None:
            return True
        return self.normal_width is not None and self.high - self.low < 0.5 * self.normal_width


def judged_decision(
    pairs: Sequence[JudgedPair],
    margin: float,
    alpha: float = 0.025,
    rate: float = 1.0,
    design: str = "fixed",
    horizon: int | None = None,
    bet: int | None = None,
) -> JudgedDecision:
    """Decide a judged run on the ``1 - 2 alpha`` ``JudgedSequence`` of its usable prefix: ``"fixed"``
    bets the plug-in tuned to ``horizon`` (default: the pairs) and decides at the end; ``"sequential"``
    bets the anytime mixture and stops at the first crossing; ``bet``: as ``JudgedWalk``'s."""
    from flyspec.gate.stats.judged import DESIGNS, check_rate, judge_counts, usable_prefix
    from flyspec.gate.stats.sequence import BET

    bet = BET if bet is None else bet
    check_margin_alpha(margin, alpha)
    check_rate(rate)
    if design not in DESIGNS:
        raise ValueError(f"design={design!r}: must be one of {', '.join(DESIGNS)}")
    usable = usable_prefix(pairs)
    if design == "fixed":
        horizon = len(pairs) if horizon is None else horizon
        if not is_int(horizon, 1):
            raise ValueError(f"horizon={horizon!r}: a fixed run's registered size, a positive integer")
    elif horizon is not None:
        raise ValueError("a sequential judged run has no horizon: its bets hold at every n")
    walk = JudgedWalk(rate, margin, alpha, horizon, bet)
    for pair in pairs[:usable]:
        walk.add(pair)
        if design == "sequential" and walk.decision().decision != INCONCLUSIVE:
            break
    sequence, stopped, end = walk.sequence, walk.n, walk.decision()
    counts = judge_counts(pairs[:stopped])
    return JudgedDecision(
        decision=end.decision,
        stopped_at=stopped,
        low=end.low,
        high=end.high,
        loss_detected=end.loss_detected,
        design=design,
        rate=rate,
        usable=usable,
        counts=counts,
        normal_width=sequence.normal_width(2.0 * alpha),
        emptied_at=sequence.emptied_at,
        estimate=sequence.estimate,
        bet=bet,
    )


DATA_STOPS = ("boundary", "max_questions", "complete")
"""Reasons a comparison stopped that the data decided: a rerun answers nothing more for it."""
PAUSES = ("time_budget", "interrupted", "error")


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
class Evidence(Generic[ItemT]):
    """One comparison's data: its complete pairs along the registered order (an exact-graded pair's
    difference, or a judged pair; a sequential run's up to the first one missing), the run's session
    ``events`` (a pause recorded last holds the decision where it was), and whether the next pair waits
    for its gold label (``awaiting``)."""

    items: Sequence[ItemT]
    events: Sequence[SessionEvent] = ()
    awaiting: bool = False


@dataclass(frozen=True)
class Outcome:
    """A comparison's decision and why it stands there (``reason``: one of ``DATA_STOPS``, ``PAUSES`` or
    ``in_progress``), the pairs it used (``stopped_at``) and the bounds there, the judge's verdicts or the
    lost/gained counts, the complete pairs (``complete_prefix``), the gold labels a judged run used and
    whether its prefix waits for one (``awaiting_label``)."""

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
        """True when the data decided (a rerun answers nothing more)."""
        return self.reason in DATA_STOPS


@dataclass(frozen=True)
class Rule:
    """What one comparison registered before its first answer, which is all ``decide`` needs besides the
    data: the margin and one-sided alpha, the registered ``size`` (a sequential run's most questions), the
    design, and for a judged run its label rate and bets (``label_bet``, sequence.py's ``BET_VERSIONS``)."""

    margin: float
    alpha: float
    size: int
    sequential: bool = False
    population_size: int | None = None
    label_rate: float | None = None
    label_bet: int | None = None

    def __post_init__(self) -> None:
        check_margin_alpha(self.margin, self.alpha)

    def walk(self) -> Walk[int] | Walk[JudgedPair]:
        """A fresh walk of this rule's sequence: the prediction-powered one for a judged run (the plug-in
        bet tuned to ``size`` for a fixed one), else the exact one."""
        if self.label_rate is None or self.label_bet is None:
            return SequentialWalk(self.margin, self.alpha, self.population_size)
        horizon = None if self.sequential else self.size
        return JudgedWalk(self.label_rate, self.margin, self.alpha, horizon, self.label_bet)

    def decide(
        self, evidence: Evidence[int] | Evidence[JudgedPair], walk: Walk[int] | Walk[JudgedPair] | None = None
    ) -> Outcome:
        """THE decision of one comparison: every run, report, tune setting and compared log reaches PASS,
        FAIL or INCONCLUSIVE here. A fixed run applies the rule once, on the interval of all its pairs
        (Tango's for exact grades), and decides only at its registered size; a sequential run walks its
        confidence sequence along the order and stops at the first crossing of ``-margin``, at a pause
        recorded last, or at its most questions. ``walk``: one already along the first ``walk.n`` items
        (a running run's), which goes on from there."""
        items = evidence.items
        upto, reason = min(len(items), self.size), "in_progress"
        last = evidence.events[-1] if evidence.events else None
        paused = last is not None and last.event == "stop" and last.reason in PAUSES
        if self.sequential and paused and last.stopped_at is not None:
            upto, reason = min(last.stopped_at, upto), str(last.reason)
        elif len(items) >= self.size:
            reason = "max_questions" if self.sequential else "complete"
        if not self.sequential and self.label_rate is None:
            from flyspec.gate.stats.paired import net_difference_ci

            n, lost, gained = len(items), items.count(-1), items.count(1)  # type: ignore[arg-type]
            if not n:
                return Outcome(INCONCLUSIVE, reason, 0, -1.0, 1.0, False, 0, 0, 0)
            low, high = net_difference_ci(n, lost, gained, level=1 - 2 * self.alpha)
            end = classify(low, high, self.margin, reason == "complete")
            return Outcome(end.decision, reason, n, low, high, high < 0, lost, gained, n)
        walk = walk or self.walk()
        end = classify(walk.low, walk.high, self.margin, walk.can_decide)
        for item in items[walk.n : upto]:
            if self.sequential and end.decision != INCONCLUSIVE:
                break
            walk.add(item)  # type: ignore[arg-type]
            end = classify(walk.low, walk.high, self.margin, walk.can_decide)
        if self.sequential and end.decision != INCONCLUSIVE:
            reason = "boundary"
        elif reason == "in_progress" and not self.sequential:
            end = Decision(INCONCLUSIVE, end.loss_detected, end.low, end.high)
        return Outcome(
            end.decision,
            reason,
            walk.n,
            end.low,
            end.high,
            end.loss_detected,
            walk.lost,
            walk.gained,
            len(items),
            walk.labelled,
            evidence.awaiting and reason != "boundary",
        )


def sequential_decision(
    diffs: Sequence[int], margin: float, alpha: float = 0.025, population_size: int | None = None
) -> SequentialDecision:
    """Walk the ``1 - 2 alpha`` confidence sequence of ``diffs`` and stop at its first crossing of
    ``-margin`` (INCONCLUSIVE at ``len(diffs)`` without one): valid however long one keeps looking."""
    from flyspec.gate.stats.sequence import as_diffs, check_population

    values = as_diffs(diffs, ndim=1)
    check_margin_alpha(margin, alpha)
    check_population(population_size, len(values))
    rule = Rule(margin, alpha, len(values), sequential=True, population_size=population_size)
    end = rule.decide(Evidence(values.tolist()))
    return SequentialDecision(end.decision, end.stopped_at, end.low, end.high, end.loss_detected)


class FixedSequenceResult(NamedTuple):
    """``chosen``: index of the last PASS before the first non-PASS (None if the first did not pass);
    ``labels``: each setting's decision, "NOT TESTED" after the first non-PASS."""

    chosen: int | None
    labels: list[str]


def fixed_sequence(decisions: Sequence[str | None]) -> FixedSequenceResult:
    """The family rule of ``gate tune`` (docs/statistics.md, "Choosing among settings"): settings tested
    in their registered order, each at the full alpha, up to the first that does not PASS; the entries
    after it are never looked at (None for settings not run) and are labelled "NOT TESTED"."""
    labels: list[str] = []
    chosen: int | None = None
    stopped = False
    for index, decision in enumerate(decisions):
        if stopped:
            labels.append(NOT_TESTED)
            continue
        if decision not in DECISIONS:
            raise ValueError(
                f"decisions[{index}]={decision!r}: a setting reached in the sequence needs a decision, "
                f"one of {', '.join(DECISIONS)}"
            )
        labels.append(decision)
        if decision == PASS:
            chosen = index
        else:
            stopped = True
    return FixedSequenceResult(chosen=chosen, labels=labels)
