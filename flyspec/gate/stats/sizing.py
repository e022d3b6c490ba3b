"""How many questions a run needs: the closed forms of a fixed-size run (McNemar: Connor 1987; the
non-inferiority score test: Nam 1997, Liu et al. 2002) and the plan a pilot's flips imply; and how many
gold labels a judged run needs (the label advice). What a registered design does by simulated runs is
flyspec/gate/stats/forecast.py. docs/statistics.md, "Planning a fixed-size run".

**Pilots.** A plan is made at the flip rate's exact upper confidence bound, not at the observed rate,
which a small pilot (and above all one with no flips) underestimates too often.

**Label advice, by simulating the gate's own rule.** A judged run's interval is a betting confidence
sequence whose width depends on the range of its values (``[1 - 2/rate, 2/rate - 1]``) as much as on their
variance, so no normal approximation says when it decides. ``smallest_label_rate`` simulates the judged
rule itself (``walk_judged`` of flyspec/gate/stats/simulation.py, which a test pins to
``judged_decision``) on pairs drawn from a ``PairModel`` plugged in from the run's own pairs (the share of
identical answers, the judge's predictions, the gold labels seen with each), and returns the smallest
rate of a grid at which at least ``ADVICE_POWER`` of the simulated runs decide. The closed-form growth
model it replaces aimed at the median run (a coin flip) and erred further: an outside run at the rate it
advised stayed INCONCLUSIVE.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.stats import beta, norm

from flyspec.checks import is_int
from flyspec.gate.stats.decide import INCONCLUSIVE
from flyspec.gate.stats.judged import LOWEST_RATE, JudgedPair
from flyspec.gate.stats.paired import check_probability, restricted_lost_rate
from flyspec.gate.stats.simulation import JudgedBlock, walk_judged

KINDS = ("fixed", "sequential")


@dataclass(frozen=True)
class SampleSizePlan:
    """Questions a fixed-size non-inferiority run needs, planned from a pilot's flip count.

    ``flip_rate``: observed; ``flip_rate_upper``: its one-sided upper confidence bound, the rate the plan
    uses (more flips need more questions, so this errs towards enough); ``questions``: the plan;
    ``questions_at_observed``: the plan at the observed rate (None when no flip was seen: it would claim
    certainty the pilot does not have).
    """

    flips: int
    pilot_questions: int
    flip_rate: float
    flip_rate_upper: float
    questions: int
    questions_at_observed: int | None


def questions_needed(net_loss: float, flip_rate: float, alpha: float = 0.05, power: float = 0.80) -> int:
    """Questions needed to detect a net difference of ``net_loss`` with McNemar's test (Connor 1987).

    ``ceil((z(1-alpha/2) sqrt(psi) + z(power) sqrt(psi - d^2))^2 / d^2)`` for a two-sided test at ``alpha``.
    """
    check_probability("net_loss", net_loss)
    check_probability("flip_rate", flip_rate, allow_one=True)
    check_probability("alpha", alpha)
    check_probability("power", power)
    if net_loss > flip_rate:
        raise ValueError(
            f"net_loss={net_loss} exceeds flip_rate={flip_rate}: "
            "the net difference cannot exceed the flip rate"
        )
    d, psi = net_loss, flip_rate
    z_a = float(norm.ppf(1 - alpha / 2))
    z_b = float(norm.ppf(power))
    return math.ceil((z_a * math.sqrt(psi) + z_b * math.sqrt(psi - d * d)) ** 2 / (d * d))


def questions_needed_noninferiority(
    margin: float, flip_rate: float, true_diff: float = 0.0, alpha: float = 0.025, power: float = 0.80
) -> int:
    """Questions needed for the paired non-inferiority score test to pass with the given power.

    Nam (1997) / Liu et al. (2002): with ``delta0 = -margin`` and the true difference ``true_diff``,
    ``n = ceil((z(1-alpha) sigma0 + z(power) sigma1)^2 / (true_diff + margin)^2)``, where ``sigma1^2 =
    psi - true_diff^2`` and ``sigma0^2 = 2 p~ + delta0 (1 - delta0)`` uses the restricted lost-cell rate
    ``p~`` of Tango's statistic evaluated at the true cell probabilities.
    """
    check_probability("margin", margin)
    check_probability("flip_rate", flip_rate, allow_zero=True, allow_one=True)
    check_probability("alpha", alpha)
    check_probability("power", power)
    if not (math.isfinite(true_diff) and true_diff > -margin):
        raise ValueError(
            f"true_diff={true_diff!r}: must exceed -margin={-margin} (otherwise no n gives power)"
        )
    if abs(true_diff) > flip_rate:
        raise ValueError(f"|true_diff|={abs(true_diff)} exceeds flip_rate={flip_rate}: impossible table")
    psi = flip_rate
    p_lost, p_gained = (psi - true_diff) / 2, (psi + true_diff) / 2
    delta0 = -margin
    p_tilde = restricted_lost_rate(1.0, p_lost, p_gained, delta0)
    sigma0 = math.sqrt(max(2 * p_tilde + delta0 * (1 - delta0), 0.0))
    sigma1 = math.sqrt(max(psi - true_diff * true_diff, 0.0))
    z_a = float(norm.ppf(1 - alpha))
    z_b = float(norm.ppf(power))
    return max(1, math.ceil((z_a * sigma0 + z_b * sigma1) ** 2 / (true_diff - delta0) ** 2))


def flip_rate_upper_bound(flips: int, n: int, level: float = 0.95) -> float:
    """Exact one-sided (Clopper-Pearson) upper confidence bound for the flip rate from ``flips`` of ``n``.

    The ``level`` quantile of Beta(flips + 1, n - flips); 1 when every question flipped. With zero flips it
    is ``1 - (1 - level)^(1/n)``, about 3/n at 95%: a pilot with no flips still allows a rate that large.
    """
    for name, value in (("flips", flips), ("n", n)):
        if not is_int(value, 0):
            raise ValueError(f"{name}={value!r}: must be a non-negative integer")
    if n < 1:
        raise ValueError(f"n={n}: must be at least 1")
    if flips > n:
        raise ValueError(f"flips={flips} exceeds n={n}")
    check_probability("level", level)
    if flips == n:
        return 1.0
    return float(beta.ppf(level, flips + 1, n - flips))


def plan_noninferiority(
    flips: int,
    n: int,
    margin: float,
    alpha: float = 0.025,
    power: float = 0.80,
    level: float = 0.95,
    true_diff: float = 0.0,
) -> SampleSizePlan:
    """Plan a fixed-size run from a pilot that saw ``flips`` flipped questions out of ``n``.

    Plans at the one-sided ``level`` upper bound of the flip rate (``flip_rate_upper_bound``), not at the
    observed rate, which a small pilot (and above all one with no flips) underestimates too often.
    """
    upper = flip_rate_upper_bound(flips, n, level)
    observed = flips / n
    # A flip rate below |true_diff| is an impossible table; the plan then uses the smallest possible rate.
    planned = questions_needed_noninferiority(margin, max(upper, abs(true_diff)), true_diff, alpha, power)
    at_observed = None
    if flips > 0:
        at_observed = questions_needed_noninferiority(
            margin, max(observed, abs(true_diff)), true_diff, alpha, power
        )
    return SampleSizePlan(
        flips=flips,
        pilot_questions=n,
        flip_rate=observed,
        flip_rate_upper=upper,
        questions=planned,
        questions_at_observed=at_observed,
    )


PREDICTIONS = np.array([-1.0, -0.5, 0.0, 0.5, 1.0])
"""The judge's predictions f a judged pair can have (the mean of two orders, each -1, 0 or 1)."""
GOLDS = np.array([-1, 0, 1])
ADVICE_POWER = 0.8
"""The share of simulated runs that must decide at the advised label rate."""
LABEL_RATES = (LOWEST_RATE, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
"""The label rates the advice chooses from."""
ADVICE_RUNS = 400
"""Simulated runs per label rate (standard error of a share near 0.8: 0.02)."""


@dataclass(frozen=True)
class PairModel:
    """What a run's pairs say about the next ones (``from_pairs``), for the label advice.

    ``identical``: pairs whose answers were the same text; ``shown`` (5): the pairs that differ, by the
    judge's prediction ``PREDICTIONS[i]``; ``seen`` (5 x 3): their gold labels ``GOLDS[j]``; ``prior``
    (5 x 3): one pseudo-label per prediction, spread as a judge agreeing with gold ``agreement`` of the
    time would (the prediction's sign with that probability, the two other values equally otherwise).

    ``sample`` gives each simulated run its shares: identical pairs and each prediction as seen (plugged
    in: every pair shows them, so they are known far better than the judge), and the gold given each
    prediction drawn from its posterior given the labels (Dirichlet, ``seen`` plus ``prior``; ``prior``
    itself before any label, the assumed agreement held fixed), so that a judge seen on few labels is not
    taken at its point estimate: what it says about the difference is only as certain as the labels make
    it (a coin's estimate rests on the labels alone).
    """

    identical: int
    shown: np.ndarray
    seen: np.ndarray
    agreement: float

    @classmethod
    def from_pairs(cls, pairs: Sequence[JudgedPair], assumed_agreement: float) -> PairModel:
        """Count the pairs; the prior's agreement is the one seen, shrunk by half a pair towards a coin
        (``(agreeing + 1/2) / (labelled + 1)``), or ``assumed_agreement`` before any label."""
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
        """One pseudo-label per prediction (see the class docstring)."""
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
        """PPI++'s limiting weight ``E[D f] / E[f^2]`` at the mean shares, clipped to [0, 1]: near 0 the
        judge's verdicts carry nothing and the labels alone carry the run."""
        cells = self._mean_cells()
        ff = float(cells.sum(axis=1) @ PREDICTIONS**2)
        return min(max(float(PREDICTIONS @ cells @ GOLDS) / ff, 0.0), 1.0) if ff > 0 else 0.0

    def sample(self, rng: np.random.Generator, runs: int) -> np.ndarray:
        """One posterior draw of the shares per simulated run: (runs, 16), identical first, then the
        5 x 3 cells by prediction and gold, row-major."""
        share = np.broadcast_to(self._shares(), (runs, PREDICTIONS.size + 1))
        if self.labels:
            given = np.stack([rng.dirichlet(row, runs) for row in self.seen + self.prior], axis=1)
        else:
            # Before any label the agreement is an assumption, not an estimate: held fixed.
            given = np.broadcast_to(self.prior, (runs, *self.prior.shape))
        return np.concatenate([share[:, :1], (share[:, 1:, None] * given).reshape(runs, -1)], axis=1)


def draw_pairs(rng: np.random.Generator, shares: np.ndarray, cols: int, rate: float) -> JudgedBlock:
    """``cols`` i.i.d. pairs for each row of ``shares`` (``PairModel.sample``), each differing pair drawn
    for a gold label with probability ``rate``. The two orders are one pair with the drawn mean (two ties
    for f = 0): the prediction-powered values depend on f only."""
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
) -> float:
    """The share of ``runs`` simulated judged runs of ``questions`` pairs at label rate ``rate`` that decide
    (PASS or FAIL) under the gate's own rule (``walk_judged``: the fixed run's plug-in bet tuned to
    ``questions``, or the sequential run's mixture stopping at its first crossing), each run's pairs drawn
    from its own posterior draw of the model's shares."""
    if design not in KINDS:
        raise ValueError(f"design={design!r}: must be one of {', '.join(KINDS)}")
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
) -> float | None:
    """The smallest rate of ``LABEL_RATES`` at which at least a share ``power`` of simulated runs decide
    (``decide_share``, the same seed at every rate), found by bisection on the grid (more labels never
    make a run less likely to decide, up to simulation noise); None when not even labelling every
    differing pair reaches it."""
    if model.differing == 0 or decide_share(model, 1.0, margin, alpha, design, questions, runs, seed) < power:
        return None
    low, high = -1, len(LABEL_RATES) - 1  # LABEL_RATES[high] reaches the power; low is below the grid
    while high - low > 1:
        mid = (low + high) // 2
        if decide_share(model, LABEL_RATES[mid], margin, alpha, design, questions, runs, seed) >= power:
            high = mid
        else:
            low = mid
    return LABEL_RATES[high]
