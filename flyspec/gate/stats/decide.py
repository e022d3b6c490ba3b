"""The gate's decision (docs/statistics.md, "The decision rule"): the verdicts' names, the one rule that
turns an interval of delta into PASS, FAIL or INCONCLUSIVE (``classify``), and every route to it: a fixed
run's Tango interval (``decide``); a sequential or judged run's first crossing (``Walk``, taken by
``sequential_decision``, ``judged_decision``, the run's ``Monitor`` and the report's replay); the
simulations' many runs at once (``crossing_verdicts``, which tests/test_gate_stats_decide.py pins to the
rule on the same draws, and which also fails if a verdict is assigned anywhere else in the gate); and the
family rule of ``gate tune`` (``fixed_sequence``). Standard library only at import, so that the command
line reads the names and checks without numpy or scipy.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, NamedTuple, TypeVar

from flyspec.checks import is_number

if TYPE_CHECKING:
    import numpy as np

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
    """``classify`` on Tango's ``1 - 2 alpha`` interval of delta. A significant McNemar test alone never
    makes a FAIL: a loss smaller than the margin is what the margin allows; report ``mcnemar`` beside it."""
    from flyspec.gate.stats.paired import check_counts, net_difference_ci

    check_counts(n, lost, gained)
    check_margin_alpha(margin, alpha)
    low, high = net_difference_ci(n, lost, gained, level=1 - 2 * alpha)
    return classify(low, high, margin)


@dataclass(frozen=True)
class SequentialDecision:
    """Outcome of walking the confidence sequence: the decision, where it stopped and the bounds there."""

    decision: str
    stopped_at: int
    low: float
    high: float
    loss_detected: bool


class Walk(Generic[ItemT]):
    """A run's walk along the registered order: the running ``1 - 2 alpha`` bounds after each of ``n``
    pairs and the rule on them; ``stop``: the ``Decision`` at the first crossing of ``-margin``. Every
    route walks with it (``SequentialWalk``, or ``JudgedWalk`` of judged.py), so all reach the same stop
    on the same data."""

    def __init__(self, margin: float) -> None:
        self.margin = margin
        self.n = self.lost = self.gained = self.labelled = 0
        self.low, self.high = -1.0, 1.0
        self.stop: Decision | None = None

    @property
    def can_decide(self) -> bool:
        """Whether the bounds may decide yet (a judged walk waits for its first gold label)."""
        return True

    def _moved(self, bounds: tuple[float, float], d: int, labelled: bool) -> Decision | None:
        """Count the pair just observed and apply the rule to the new bounds: the decision if they cross."""
        self.low, self.high = bounds
        self.n += 1
        self.lost += d == -1
        self.gained += d == 1
        self.labelled += labelled
        now = self.decision()
        if now.decision == INCONCLUSIVE:
            return None
        self.stop = now
        return now

    def decision(self) -> Decision:
        """The rule on the bounds reached so far."""
        return classify(self.low, self.high, self.margin, self.can_decide)

    def add(self, item: ItemT) -> Decision | None:
        """Observe the next pair; the decision if the bounds now cross, else None."""
        raise NotImplementedError

    def run(self, items: Iterable[ItemT]) -> Walk[ItemT]:
        """Observe ``items`` in order up to the first crossing."""
        for item in items:
            if self.add(item) is not None:
                break
        return self


class SequentialWalk(Walk[int]):
    """The exact-graded walk: the confidence sequence of the paired differences."""

    def __init__(self, margin: float, alpha: float, population_size: int | None = None) -> None:
        from flyspec.gate.stats.sequence import ConfidenceSequence

        super().__init__(margin)
        self._sequence = ConfidenceSequence(2.0 * alpha, population_size)

    def add(self, d: int) -> Decision | None:
        """Observe the next pair's difference; returns the decision if the bounds now cross, else None."""
        return self._moved(self._sequence.update(d), d, False)


def sequential_decision(
    diffs: Sequence[int], margin: float, alpha: float = 0.025, population_size: int | None = None
) -> SequentialDecision:
    """Walk the ``1 - 2 alpha`` confidence sequence of ``diffs`` and stop at its first crossing of
    ``-margin`` (INCONCLUSIVE at ``len(diffs)`` without one): valid however long one keeps looking."""
    from flyspec.gate.stats.sequence import as_diffs, check_population

    values = as_diffs(diffs, ndim=1)
    check_margin_alpha(margin, alpha)
    check_population(population_size, len(values))
    walk = SequentialWalk(margin, alpha, population_size)
    end = walk.run(values.tolist()).decision()
    return SequentialDecision(end.decision, walk.n, end.low, end.high, end.loss_detected)


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
