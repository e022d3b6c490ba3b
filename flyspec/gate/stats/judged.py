"""Judged comparisons anchored on gold labels (docs/statistics.md, "Judged runs"): a random subset of the
pairs, drawn before any answer, gets a gold label, and each pair's prediction-powered value (PPI++)

    Y_i = 0 (identical answers),   Y_i = lam_i f_i + (xi_i / rate) (D_i - lam_i f_i)   (xi_i: drawn for gold)

has the true difference D_i as its conditional mean for any judge, in ``[1 - 2/rate, 2/rate - 1]``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from flyspec.checks import is_int, is_number
from flyspec.gate.stats.paired import wilson_interval
from flyspec.gate.stats.sequence import BET, BoundedMeanSequence

DESIGNS = ("fixed", "sequential")
LAM_PRIOR, LAM_PRIOR_WEIGHT = 0.5, 1.0
"""The PPI++ weight starts at 1/2, worth one labelled pair with |f| = 1."""
GOLD_DRAW = 2
"""The version of the gold-label draw runs register (``gold_draw``)."""


@dataclass(frozen=True)
class JudgedPair:
    """One question of a judged run: ``identical`` answers (D = 0, never judged or labelled), the judge's
    ``prediction`` f in [-1, 1], ``selected`` for a gold label, and its ``gold`` D once labelled."""

    identical: bool
    prediction: float = 0.0
    selected: bool = False
    gold: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.identical, bool) or not isinstance(self.selected, bool):
            raise ValueError("identical and selected must be bools")
        if not is_number(self.prediction, at_least=-1, at_most=1):
            raise ValueError(f"prediction={self.prediction!r}: must be a number in [-1, 1]")
        if self.gold is not None and (not is_int(self.gold) or self.gold not in (-1, 0, 1)):
            raise ValueError(f"gold={self.gold!r}: a gold label is -1, 0 or 1 (or None before labelling)")
        if self.identical and (self.prediction != 0 or self.selected or self.gold is not None):
            raise ValueError("an identical pair has prediction 0, is never selected and never labelled")
        if self.gold is not None and not self.selected:
            raise ValueError("only a pair selected for a gold label may carry one")

    @property
    def waiting(self) -> bool:
        """Selected for a gold label that has not arrived."""
        return self.selected and self.gold is None


def judge_prediction(first: int, second: int) -> float:
    """The judge's prediction f from its two orders' votes: +1 (the candidate), -1 (the baseline), 0."""
    for name, vote in (("first", first), ("second", second)):
        if not is_int(vote) or vote not in (-1, 0, 1):
            raise ValueError(f"{name}={vote!r}: a vote is -1, 0 or 1")
    return (first + second) / 2.0


def check_rate(rate: float) -> None:
    """ValueError unless the gold-label ``rate`` lies in (0, 1]."""
    if not is_number(rate, above=0, at_most=1):
        raise ValueError(f"rate={rate!r}: the gold-label rate must lie in (0, 1]")


def gold_draw(seed: int | str, dataset: str, question_id: str) -> float:
    """The uniform number in [0, 1) behind a question's gold-label draw: a sha256 of its own, independent
    of the question order's key (flyspec/gate/data/questions.py)."""
    text = f"gold-draw-v2:{seed}:{dataset}:{question_id}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2.0**64


def gold_selected(seed: int | str, dataset: str, question_id: str, rate: float) -> bool:
    """Whether a (non-identical) pair is drawn for a gold label: ``gold_draw(...) < rate``, fixed by the
    registered seed before any answer and nested in the rate."""
    check_rate(rate)
    return gold_draw(seed, dataset, question_id) < rate


def usable_prefix(pairs: Sequence[JudgedPair]) -> int:
    """How many leading pairs the statistics may use: up to the first pair still waiting for its label."""
    for i, pair in enumerate(pairs):
        if pair.waiting:
            return i
    return len(pairs)


def value_range(rate: float) -> tuple[float, float]:
    """The range of Y at this label rate."""
    check_rate(rate)
    return 1.0 - 2.0 / rate, 2.0 / rate - 1.0


class _Weight:
    """The PPI++ weight lam, updated from the labelled pairs only after each value is computed."""

    def __init__(self) -> None:
        self.sum_df = LAM_PRIOR * LAM_PRIOR_WEIGHT
        self.sum_ff = LAM_PRIOR_WEIGHT

    @property
    def lam(self) -> float:
        return min(max(self.sum_df / self.sum_ff, 0.0), 1.0)

    def value(self, pair: JudgedPair, rate: float) -> float:
        if pair.identical:
            return 0.0
        if pair.waiting:
            raise ValueError("a pair selected for a gold label has none yet: use usable_prefix()")
        lam, f = self.lam, pair.prediction
        if not pair.selected:
            return lam * f
        assert pair.gold is not None
        self.sum_df += pair.gold * f
        self.sum_ff += f * f
        return lam * f + (pair.gold - lam * f) / rate


def judged_values(pairs: Sequence[JudgedPair], rate: float) -> np.ndarray:
    """The prediction-powered value Y of each pair, in order; ValueError for a pair still waiting for its
    gold label (cut the list at ``usable_prefix`` first)."""
    check_rate(rate)
    weight = _Weight()
    return np.array([weight.value(pair, rate) for pair in pairs], dtype=float)


@dataclass(frozen=True)
class JudgeCounts:
    """What the judge said: ``lost``/``gained``, both orders preferred the baseline / the candidate;
    ``agreement``, the share of labelled pairs whose verdict had the gold label's sign, with its 95% Wilson
    interval (None without labels)."""

    n: int
    identical: int
    lost: int
    gained: int
    undecided: int
    selected: int
    labelled: int
    agreeing: int
    agreement: float | None
    agreement_low: float | None
    agreement_high: float | None


def judge_counts(pairs: Sequence[JudgedPair]) -> JudgeCounts:
    """Count the pairs as the report shows them."""
    identical = sum(p.identical for p in pairs)
    lost = sum(not p.identical and p.prediction == -1 for p in pairs)
    gained = sum(not p.identical and p.prediction == 1 for p in pairs)
    labelled = [p for p in pairs if p.gold is not None]
    agreeing = sum(int(np.sign(p.prediction)) == p.gold for p in labelled)
    low = high = share = None
    if labelled:
        share = agreeing / len(labelled)
        low, high = wilson_interval(agreeing, len(labelled))
    return JudgeCounts(
        n=len(pairs),
        identical=identical,
        lost=lost,
        gained=gained,
        undecided=len(pairs) - identical - lost - gained,
        selected=sum(p.selected for p in pairs),
        labelled=len(labelled),
        agreeing=agreeing,
        agreement=share,
        agreement_low=low,
        agreement_high=high,
    )


class JudgedSequence:
    """Online confidence sequence for the true net difference of a judged run, valid whatever the judge
    does: ``BoundedMeanSequence`` on the values Y (``horizon``, ``bet``: as there)."""

    def __init__(self, rate: float, alpha: float = 0.05, horizon: int | None = None, bet: int = BET) -> None:
        lo, hi = value_range(rate)
        self.rate = rate
        self._sequence = BoundedMeanSequence(lo, hi, alpha, horizon, bet)
        self._weight = _Weight()
        self.n = 0
        self.low, self.high = -1.0, 1.0
        self._sum = self._sum_sq = 0.0

    @property
    def lam(self) -> float:
        """The PPI++ weight the next pair will get."""
        return self._weight.lam

    def update(self, pair: JudgedPair) -> tuple[float, float]:
        """Add the next pair (not one waiting for its label) and return the running bounds."""
        y = self._weight.value(pair, self.rate)
        self.low, self.high = self._sequence.update(y)
        self.n += 1
        self._sum += y
        self._sum_sq += y * y
        return self.low, self.high

    @property
    def estimate(self) -> float | None:
        """The mean of the values so far (None before the first pair)."""
        return self._sum / self.n if self.n else None

    @property
    def emptied_at(self) -> int | None:
        """The pair after which the confidence set was empty, else None."""
        return self._sequence.emptied_at

    def normal_width(self, alpha: float) -> float | None:
        """The width of a normal-theory interval at level ``1 - alpha`` from the values seen (None before
        two pairs): a betting interval much narrower than it means the running bounds met from two sides."""
        if self.n < 2:
            return None
        mean = self._sum / self.n
        variance = max(self._sum_sq / self.n - mean * mean, 0.0) * self.n / (self.n - 1)
        return 2.0 * NormalDist().inv_cdf(1.0 - alpha / 2.0) * math.sqrt(variance / self.n)
