"""How many questions a run needs: the closed forms of a fixed-size run (McNemar: Connor 1987; the
non-inferiority score test: Nam 1997, Liu et al. 2002) and the plan a pilot's flips imply, the expected
growth of a judged run's betting capital (the label advice): formulas fast enough for a report line.
What a registered design does by simulated runs is flyspec/gate/stats/forecast.py. docs/statistics.md,
"Planning a fixed-size run".

**Pilots.** A plan is made at the flip rate's exact upper confidence bound, not at the observed rate,
which a small pilot (and above all one with no flips) underestimates too often.

**Judged runs without simulation.** A judged run decides when the log capital of one side at the margin
reaches ``log(1 / alpha)``; its increments ``log(1 + lambda (X - m))`` follow from the share of pairs that
differ, the true difference, the judge and the label rate. For a **fair noisy judge** (each of its two
orders names the better answer and is wrong with probability ``noise``; agreement ``a`` with gold means
``noise = 1 - sqrt(a)``), at the PPI++ weight such a judge converges to: a fixed run of n questions
decides about when ``n g`` plus its fluctuation ``sqrt(n v)`` reaches the threshold (g, v: mean and
variance of one increment at the plug-in bet tuned to n), a sequential one at its median stop of about
``(log(1/alpha) + log B) / g`` for the mixture's best bet. These approximations leave out the plug-in's
early bets, the running maximum and the mixture's fluctuations; tests/test_gate_stats_judged.py compares
them with simulated runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.stats import beta, norm

from flyspec.checks import is_int
from flyspec.gate.stats.paired import check_probability, restricted_lost_rate
from flyspec.gate.stats.sequence import MIXTURE_FRACTIONS, TRUNCATION

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


@dataclass(frozen=True)
class JudgeModel:
    """A fair judge whose every order is wrong with probability ``noise`` (0: always right)."""

    noise: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.noise <= 0.5:
            raise ValueError(f"noise={self.noise!r}: must lie in [0, 0.5]")

    @classmethod
    def from_agreement(cls, agreement: float) -> JudgeModel:
        """The judge whose two orders both name the gold winner with probability ``agreement``."""
        return cls(min(max(1.0 - math.sqrt(max(agreement, 0.0)), 0.0), 0.5))

    @property
    def agreement(self) -> float:
        """Probability that both orders name the better answer."""
        return (1.0 - self.noise) ** 2

    def predictions(self) -> list[tuple[float, float]]:
        """(probability, f / D): the prediction as a multiple of the true D."""
        e = self.noise
        return [((1 - e) ** 2, 1.0), (2 * e * (1 - e), 0.0), (e * e, -1.0)]

    @property
    def weight(self) -> float:
        """PPI++'s limiting weight ``E[D f] / E[f^2]`` over differing pairs, clipped to [0, 1]."""
        e = self.noise
        ff = (1 - e) ** 2 + e * e
        return min(max((1 - 2 * e) / ff, 0.0), 1.0) if ff > 0 else 0.0


def value_distribution(
    model: JudgeModel, differing: float, delta: float, rate: float
) -> tuple[np.ndarray, np.ndarray]:
    """``(probabilities, values)`` of one question's Y (judged.py) under this model."""
    if not 0.0 <= differing <= 1.0 or abs(delta) > differing + 1e-12:
        raise ValueError(f"differing={differing}, delta={delta}: need |delta| <= differing <= 1")
    probs, values = [1.0 - differing], [0.0]
    lam = model.weight
    for d, p_d in ((-1, (differing - delta) / 2), (1, (differing + delta) / 2)):
        for p_f, ratio in model.predictions():
            f = ratio * d
            probs += [p_d * p_f * (1 - rate), p_d * p_f * rate]
            values += [lam * f, lam * f + (d - lam * f) / rate]
    return np.array(probs), np.array(values)


def _increments(
    model: JudgeModel, differing: float, delta: float, margin: float, rate: float
) -> tuple[np.ndarray, np.ndarray, float, float, int]:
    """Probabilities, X values, the X of -margin, the variance of X, and the side that can decide."""
    probs, y = value_distribution(model, differing, delta, rate)
    lo, hi = (1 - 2 / rate, 2 / rate - 1) if rate < 1 else (-1.0, 1.0)
    x = (y - lo) / (hi - lo)
    m = (-margin - lo) / (hi - lo)
    mean = float(probs @ x)
    return probs, x, m, float(probs @ (x - mean) ** 2), 1 if delta > -margin else -1


def _moments(probs: np.ndarray, x: np.ndarray, m: float, bet: float, side: int) -> tuple[float, float]:
    step = np.log1p(np.maximum(bet * side * (x - m), -1 + 1e-300))
    g = float(probs @ step)
    return g, max(float(probs @ step**2) - g * g, 0.0)


def fixed_power(
    model: JudgeModel, differing: float, delta: float, margin: float, alpha: float, rate: float, n: int
) -> float:
    """About the chance that a fixed judged run of ``n`` questions decides (PASS when ``delta > -margin``,
    FAIL otherwise) with the plug-in bet tuned to n."""
    if delta == -margin:
        return 0.0
    probs, x, m, var_x, side = _increments(model, differing, delta, margin, rate)
    room = m if side > 0 else 1 - m
    threshold = math.log(1 / alpha)
    bet = TRUNCATION / room
    if var_x > 0:
        bet = min(bet, math.sqrt(2 * threshold / (n * var_x)))
    g, v = _moments(probs, x, m, bet, side)
    if v == 0:
        return 1.0 if n * g >= threshold else 0.0
    return float(norm.cdf((n * g - threshold) / math.sqrt(n * v)))


def sequential_median(
    model: JudgeModel, differing: float, delta: float, margin: float, alpha: float, rate: float
) -> float | None:
    """About the median number of questions a sequential judged run needs to decide (None: never)."""
    probs, x, m, _, side = _increments(model, differing, delta, margin, rate)
    room = m if side > 0 else 1 - m
    best = max(_moments(probs, x, m, f / room, side)[0] for f in MIXTURE_FRACTIONS)
    if best <= 0:
        return None
    return (math.log(1 / alpha) + math.log(MIXTURE_FRACTIONS.size)) / best


def smallest_rate(
    model: JudgeModel,
    differing: float,
    delta: float,
    margin: float,
    alpha: float,
    design: str,
    questions: int,
) -> float | None:
    """The smallest label rate at which the median judged run of ``questions`` questions decides."""
    delta = min(max(delta, -differing), differing)
    if differing == 0:
        return None

    def decides(rate: float) -> bool:
        if design == "fixed":
            return fixed_power(model, differing, delta, margin, alpha, rate, questions) >= 0.5
        median = sequential_median(model, differing, delta, margin, alpha, rate)
        return median is not None and median <= questions

    if not decides(1.0):
        return None
    low, high = 1e-4, 1.0
    for _ in range(40):
        mid = math.sqrt(low * high)
        if decides(mid):
            high = mid
        else:
            low = mid
    return high
