"""The label advice of a judged run (docs/statistics.md, "The label advice"): the smallest label rate at
which enough simulated runs decide under the judged rule itself (``walk_judged``), on pairs drawn from a
``PairModel`` of the run's own pairs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from flyspec.gate.stats.decide import INCONCLUSIVE
from flyspec.gate.stats.judged import DESIGNS, JudgeCounts, JudgedPair
from flyspec.gate.stats.sequence import BET
from flyspec.gate.stats.simulation import JudgedBlock, walk_judged
from flyspec.gate.stats.sizing import first_reaching

ASSUMED_AGREEMENT = 0.95
"""The judge's agreement with gold that ``labels_needed`` assumes when no label exists yet."""
WEAK_JUDGE_WEIGHT = 0.25
"""Below this PPI++ weight the label advice says the labels alone carry the run."""
PREDICTIONS = np.array([-1.0, -0.5, 0.0, 0.5, 1.0])
"""The judge's predictions f a judged pair can have (the mean of two orders, each -1, 0 or 1)."""
GOLDS = np.array([-1, 0, 1])
ADVICE_POWER = 0.8
"""The share of simulated runs that must decide at the advised label rate."""
LABEL_RATES = (0.02, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
"""The label rates the advice chooses from."""
ADVICE_RUNS = 400
"""Simulated runs per label rate (standard error of a share near 0.8: 0.02)."""


@dataclass(frozen=True)
class PairModel:
    """What a run's pairs say about the next ones: the ``identical`` pairs, the differing ones by the
    judge's prediction (``shown``, 5) and their gold labels (``seen``, 5 x 3), and the judge's
    ``agreement`` behind the ``prior`` pseudo-labels."""

    identical: int
    shown: np.ndarray
    seen: np.ndarray
    agreement: float

    @classmethod
    def from_pairs(cls, pairs: Sequence[JudgedPair], assumed_agreement: float) -> PairModel:
        """Count the pairs; the agreement is the one seen, shrunk by half a pair towards a coin, or
        ``assumed_agreement`` before any label."""
        if not pairs:
            raise ValueError("a pair model needs at least one pair")
        level = {float(f): i for i, f in enumerate(PREDICTIONS)}
        shown = np.zeros(PREDICTIONS.size)
        seen = np.zeros((PREDICTIONS.size, GOLDS.size))
        for pair in pairs:
            if pair.identical:
                continue
            # The gate's predictions are halves; a finer one counts at the nearest half.
            i = level[round(2.0 * pair.prediction) / 2.0]
            shown[i] += 1
            if pair.gold is not None:
                seen[i, pair.gold + 1] += 1
        labelled = seen.sum()
        agreeing = sum(seen[i, int(np.sign(f)) + 1] for i, f in enumerate(PREDICTIONS))
        agreement = (agreeing + 0.5) / (labelled + 1.0) if labelled else assumed_agreement
        return cls(len(pairs) - int(shown.sum()), shown, seen, agreement)

    @property
    def labels(self) -> int:
        """The gold labels the model was estimated from."""
        return int(self.seen.sum())

    @property
    def prior(self) -> np.ndarray:
        """One pseudo-label per prediction, split by the judge's agreement."""
        a = min(max(self.agreement, 1e-3), 1.0 - 1e-3)
        prior = np.full((PREDICTIONS.size, GOLDS.size), (1.0 - a) / 2.0)
        prior[np.arange(PREDICTIONS.size), np.sign(PREDICTIONS).astype(int) + 1] = a
        return prior

    def _mean_cells(self) -> np.ndarray:
        """The posterior mean of the 5 x 3 shares of differing pairs by prediction and gold."""
        given = self.seen + self.prior
        return self._shares()[1:, None] * given / given.sum(axis=1, keepdims=True)

    def _shares(self) -> np.ndarray:
        """The shares seen of identical pairs and of each prediction (6)."""
        counts = np.concatenate([[self.identical], self.shown])
        return counts / counts.sum()

    @property
    def differing(self) -> float:
        """The expected share of pairs whose answers differ."""
        return float(self._mean_cells().sum())

    @property
    def effect(self) -> float:
        """The expected true net difference ``E[D]`` under the model."""
        return float(self._mean_cells().sum(axis=0) @ GOLDS)

    @property
    def weight(self) -> float:
        """PPI++'s limiting weight ``E[D f] / E[f^2]`` at the mean shares, clipped to [0, 1]."""
        cells = self._mean_cells()
        ff = float(cells.sum(axis=1) @ PREDICTIONS**2)
        return min(max(float(PREDICTIONS @ cells @ GOLDS) / ff, 0.0), 1.0) if ff > 0 else 0.0

    def sample(self, rng: np.random.Generator, runs: int) -> np.ndarray:
        """One draw of the shares per simulated run: (runs, 16), identical first, then the 5 x 3 cells by
        prediction and gold, row-major; the gold given each prediction from its Dirichlet posterior, so a
        judge seen on few labels is only as certain as they make it."""
        share = np.broadcast_to(self._shares(), (runs, PREDICTIONS.size + 1))
        if self.labels:
            given = np.stack([rng.dirichlet(row, runs) for row in self.seen + self.prior], axis=1)
        else:
            # Before any label the agreement is an assumption, not an estimate: held fixed.
            given = np.broadcast_to(self.prior, (runs, *self.prior.shape))
        return np.concatenate([share[:, :1], (share[:, 1:, None] * given).reshape(runs, -1)], axis=1)


def draw_pairs(rng: np.random.Generator, shares: np.ndarray, cols: int, rate: float) -> JudgedBlock:
    """``cols`` i.i.d. pairs for each row of ``shares`` (``PairModel.sample``), each differing pair drawn
    for a gold label with probability ``rate``; the two orders are any with the drawn mean."""
    edges = np.cumsum(shares, axis=1)
    u = rng.random((shares.shape[0], cols)) * edges[:, -1:]
    k = np.minimum((u[:, :, None] >= edges[:, None, :]).sum(axis=2), shares.shape[1] - 1)
    identical = k == 0
    cell = np.maximum(k - 1, 0)
    prediction = np.where(identical, 0.0, PREDICTIONS[cell // GOLDS.size])
    gold = np.where(identical, 0, GOLDS[cell % GOLDS.size]).astype(np.int8)
    selected = (rng.random(k.shape) < rate) & ~identical
    first = np.sign(prediction).astype(np.int8)
    second = np.where(np.abs(prediction) == 1.0, first, 0).astype(np.int8)
    return JudgedBlock(identical, prediction, selected, gold, (first, second))


def decide_share(
    model: PairModel,
    rate: float,
    margin: float,
    alpha: float,
    design: str,
    questions: int,
    runs: int = ADVICE_RUNS,
    seed: int = 0,
    settle: float | None = None,
    bet: int = BET,
) -> float:
    """The share of ``runs`` simulated judged runs of ``questions`` pairs at label rate ``rate`` that decide,
    each from its own draw of the model's shares (``settle``: ``first_crossings``)."""
    if design not in DESIGNS:
        raise ValueError(f"design={design!r}: must be one of {', '.join(DESIGNS)}")
    rng = np.random.default_rng(seed)
    shares = model.sample(rng, runs)
    out = walk_judged(
        runs,
        questions,
        lambda active, _start, cols: draw_pairs(rng, shares[active], cols, rate),
        margin,
        alpha,
        rate,
        design,
        settle=settle,
        bet=bet,
    )
    return 1.0 - out.share(INCONCLUSIVE)


def smallest_label_rate(
    model: PairModel,
    margin: float,
    alpha: float,
    design: str,
    questions: int,
    power: float = ADVICE_POWER,
    runs: int = ADVICE_RUNS,
    seed: int = 0,
    bet: int = BET,
) -> float | None:
    """The smallest rate of ``LABEL_RATES`` at which a share ``power`` of simulated runs decide, the same seed
    at every rate (more labels never make a run less likely to decide); None when no rate does."""

    def reaches(rate: float) -> bool:
        return decide_share(model, rate, margin, alpha, design, questions, runs, seed, power, bet) >= power

    if model.differing == 0 or not reaches(1.0):
        return None
    # Index -1 lies below the grid; the grid's last rate (1.0) reaches the power.
    return LABEL_RATES[first_reaching(lambda i: reaches(LABEL_RATES[i]), -1, len(LABEL_RATES) - 1)]


@dataclass(frozen=True)
class LabelAdvice:
    """The label advice: at label ``rate`` (about ``labels`` gold labels; None when no rate reaches it) a
    share ``power`` of simulated runs like this one decide, assuming the ``effect`` and the judge's
    ``agreement`` (``assumed`` before any label)."""

    questions: int
    rate: float | None
    labels: int | None
    effect: float
    agreement: float
    assumed: bool
    design: str = "fixed"
    power: float = 0.8
    labelled: int = 0
    weight: float = 1.0

    def describe(self) -> str:
        """A few sentences for the report: the advice, the promise in words, and what it assumes."""
        runs = (
            f"sequential runs of at most {self.questions} questions"
            if self.design == "sequential"
            else f"runs of {self.questions} questions"
        )
        basis = (
            f"the judge agrees with gold on {100 * self.agreement:.0f}% of pairs (assumed: no label yet)"
            if self.assumed
            else f"the judge keeps agreeing with gold as on the {self.labelled} labelled pairs so far "
            f"({100 * self.agreement:.0f}%; each simulated run draws what its verdicts mean from those "
            "labels, as uncertain as they leave it)"
        )
        assumes = (
            f"This assumes {basis}, and that the true difference stays at its estimate of "
            f"{100 * self.effect:+.1f} points with the same mix of pairs. It is advice for a run registered "
            "with that rate, no part of the test."
        )
        power = f"{100 * self.power:.0f}%"
        if self.rate is None or self.labels is None:
            return (
                f"No label rate lets {power} or more of simulated {runs} like this one decide, not even "
                "labelling every pair whose answers differ: more questions (or a difference farther from the "
                f"margin) are needed, not more labels. {assumes}"
            )
        lower = " (at the next lower rate of the grid, fewer do)" if self.rate > LABEL_RATES[0] else ""
        alone = (
            " The judge's verdicts carry almost nothing here (their PPI++ weight is "
            f"{self.weight:.2f}), so the labels alone carry the run."
            if self.weight < WEAK_JUDGE_WEIGHT
            else ""
        )
        return (
            f"About {self.labels} gold labels (a label rate of {self.rate:g} of the pairs whose answers "
            f"differ) would let {power} or more of {runs} like this one decide (PASS or FAIL), by simulating "
            f"the gate's own rule on a grid of rates{lower}.{alone} {assumes}"
        )


def labels_needed(
    counts: JudgeCounts,
    margin: float,
    alpha: float,
    design: str,
    questions: int,
    pairs: Sequence[JudgedPair],
    bet: int = BET,
) -> LabelAdvice:
    """The smallest label rate (and about how many gold labels) at which ``ADVICE_POWER`` of simulated
    judged runs like ``pairs`` decide; ``counts``: ``judge_counts(pairs)``. ValueError without a pair."""
    model = PairModel.from_pairs(pairs, ASSUMED_AGREEMENT)  # ValueError without a pair
    rate = smallest_label_rate(model, margin, alpha, design, questions, bet=bet)
    # Rounded first: 0.4 x 0.3 x 400 is 48.000000000000007 in floating point.
    labels = None if rate is None else math.ceil(round(rate * model.differing * questions, 6))
    return LabelAdvice(
        questions=questions,
        rate=rate,
        labels=labels,
        effect=model.effect,
        agreement=counts.agreement if counts.agreement is not None else ASSUMED_AGREEMENT,
        assumed=counts.agreement is None,
        design=design,
        power=ADVICE_POWER,
        labelled=model.labels,
        weight=model.weight,
    )
