"""Planning judged runs from the expected growth of the betting capital (no simulation: fast enough for a
report line).

A judged run decides when the log capital of one side at the margin reaches ``log(1 / alpha)``
(flyspec/gate/stats/betting.py). Its increments are ``log(1 + lambda (X - m))`` for the prediction-powered
values X of flyspec/gate/stats/judged.py, whose distribution follows from four things: the share of
pairs whose answers differ, the true difference, the judge, and the label rate. This module enumerates
that distribution for a **fair noisy judge** (each of its two orders names the better answer, and is
wrong with probability ``noise``, independently; a judge agreeing with gold on a share ``a`` of pairs has
``noise = 1 - sqrt(a)``), at the PPI++ weight such a judge converges to, and turns the growth into plans:

- fixed runs of n questions: the plug-in bet tuned to n, and the chance that ``n g`` plus its normal
  fluctuation ``sqrt(n v)`` reaches the threshold (g, v: mean and variance of one increment);
- sequential runs: the median stop of the mixture, about ``(log(1/alpha) + log B) / g`` for its best bet.

These are approximations (the plug-in's early bets, the running maximum and the mixture's fluctuations
are left out); tests/test_gate_stats_judged.py compares them with simulated runs. Differing pairs are
modelled as one answer better (D = +1 or -1), none as different but equal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.stats import norm

from flyspec.gate.stats.betting import MIXTURE_FRACTIONS, TRUNCATION


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
