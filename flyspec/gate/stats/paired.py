"""The fixed-size statistics of the paired gate (docs/statistics.md, "Fixed-size tests"): ``n`` pairs,
``lost`` (baseline right, candidate wrong), ``gained`` (the reverse), ``delta = (gained - lost) / n``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import numpy as np
from scipy import optimize
from scipy.stats import binom, norm

from flyspec.checks import is_int, is_number

CI_METHODS = ("tango", "newcombe", "wald")
Numbers = TypeVar("Numbers", float, np.ndarray)
"""One table's counts, or arrays of many tables' (the simulations')."""


@dataclass(frozen=True)
class McNemarResult:
    """Exact conditional McNemar test of ``lost`` against ``gained`` (two-sided)."""

    lost: int
    gained: int
    net: int
    exact_p: float
    mid_p: float


@dataclass(frozen=True)
class NonInferiorityResult:
    """One-sided score test of H0: delta <= -margin against H1: delta > -margin."""

    statistic: float
    p_value: float
    non_inferior: bool
    margin: float
    alpha: float


class PairedCounts(NamedTuple):
    """Counts of a paired comparison: questions, lost and gained."""

    n: int
    lost: int
    gained: int


def check_counts(n: int, lost: int, gained: int) -> None:
    """ValueError unless ``n``, ``lost`` and ``gained`` are counts of one paired table."""
    for name, value in (("n", n), ("lost", lost), ("gained", gained)):
        if not is_int(value, 0):
            raise ValueError(f"{name}={value!r}: must be a non-negative integer")
    if n < 1:
        raise ValueError(f"n={n}: must be at least 1")
    if lost + gained > n:
        raise ValueError(f"lost + gained = {lost + gained} exceeds n={n}: a question flips at most once")


def check_probability(name: str, value: float, *, allow_zero: bool = False, allow_one: bool = False) -> None:
    """ValueError unless ``value`` is a number in (0, 1), the ends allowed as asked."""
    if not is_number(value):
        raise ValueError(f"{name}={value!r}: must be a number")
    low_ok = value >= 0 if allow_zero else value > 0
    high_ok = value <= 1 if allow_one else value < 1
    if not (low_ok and high_ok):
        interval = f"{'[' if allow_zero else '('}0, 1{']' if allow_one else ')'}"
        raise ValueError(f"{name}={value!r}: must lie in {interval}")


def mcnemar(lost: int, gained: int) -> McNemarResult:
    """Exact (and mid-p) McNemar test: are lost and gained questions equally likely? Conditional on the
    ``m`` flips, ``lost ~ Bin(m, 1/2)`` under the null hypothesis."""
    for name, value in (("lost", lost), ("gained", gained)):
        if not is_int(value, 0):
            raise ValueError(f"{name}={value!r}: must be a non-negative integer")
    m = lost + gained
    k = min(lost, gained)
    point = float(binom.pmf(k, m, 0.5))
    if lost == gained:
        exact_p = 1.0
        mid_p = 1.0 - point / 2.0
    else:
        exact_p = min(1.0, 2.0 * float(binom.cdf(k, m, 0.5)))
        mid_p = exact_p - point
    return McNemarResult(lost=lost, gained=gained, net=gained - lost, exact_p=exact_p, mid_p=mid_p)


def paired_counts(base: Sequence[int | bool], cand: Sequence[int | bool]) -> PairedCounts:
    """Count ``(n, lost, gained)`` from per-question 0/1 correctness of baseline and candidate."""
    if len(base) != len(cand):
        raise ValueError(f"base has {len(base)} questions but cand has {len(cand)}: pairs need equal lengths")
    lost = gained = 0
    for i, (b, c) in enumerate(zip(base, cand, strict=True)):
        if b not in (0, 1) or c not in (0, 1):
            raise ValueError(f"question {i}: correctness must be 0/1 or bool, got base={b!r} cand={c!r}")
        lost += int(b and not c)
        gained += int(c and not b)
    return PairedCounts(n=len(base), lost=lost, gained=gained)


def restricted_lost_rate(n: float, lost: Numbers, gained: Numbers, delta0: float) -> Numbers:
    """Maximum-likelihood lost-cell probability under the constraint delta = delta0 (Tango 1998); counts
    may be arrays (many tables at once)."""
    a = 2.0 * n
    b = -gained - lost + (2.0 * n - gained + lost) * delta0
    c = -lost * delta0 * (1.0 - delta0)
    return (np.sqrt(np.maximum(b * b - 4.0 * a * c, 0.0)) - b) / (2.0 * a)


def tango_statistic(n: int, lost: Numbers, gained: Numbers, delta0: float) -> Numbers:
    """Tango's score statistic ``T(delta0)``, positive when the observed net is above ``delta0``; counts
    may be arrays. Where the restricted variance vanishes (at the ends of [-1, 1]) it is 0 for a zero
    numerator and an infinity of its sign otherwise."""
    p_lost = restricted_lost_rate(n, lost, gained, delta0)
    numerator = gained - lost - n * delta0
    variance = n * (2.0 * p_lost + delta0 * (1.0 - delta0))
    if np.ndim(variance) == 0 and variance <= 1e-300:
        return 0.0 if abs(numerator) < 1e-12 else math.copysign(math.inf, numerator)
    return numerator / np.sqrt(variance)


def _tango_interval(n: int, lost: int, gained: int, z: float) -> tuple[float, float]:
    # T is decreasing in delta0 and zero at the point estimate, so each bound is one bracketed root.
    estimate = (gained - lost) / n

    def lower_fn(d: float) -> float:
        return tango_statistic(n, lost, gained, d) - z

    def upper_fn(d: float) -> float:
        return tango_statistic(n, lost, gained, d) + z

    low = -1.0 if lower_fn(-1.0) <= 0 else optimize.brentq(lower_fn, -1.0, estimate, xtol=1e-12)
    high = 1.0 if upper_fn(1.0) >= 0 else optimize.brentq(upper_fn, estimate, 1.0, xtol=1e-12)
    return float(low), float(high)


def _wilson(successes: int, trials: int, z: float) -> tuple[float, float]:
    p = successes / trials
    denom = 1.0 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denom
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def wilson_interval(successes: int, trials: int, level: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (used for the pilot's flip rate)."""
    if trials < 1 or not 0 <= successes <= trials:
        raise ValueError(
            f"successes={successes}, trials={trials}: need 0 <= successes <= trials, trials >= 1"
        )
    check_probability("level", level)
    return _wilson(successes, trials, float(norm.ppf(0.5 + level / 2)))


def net_difference_ci(
    n: int, lost: int, gained: int, level: float = 0.95, method: str = "tango"
) -> tuple[float, float]:
    """Confidence interval ``(low, high)`` for ``delta``: ``"tango"``, Tango's (1998) score interval;
    ``"newcombe"``, a Wilson interval for the share of flips that are gains scaled by the flip rate ((0, 0)
    without a flip); ``"wald"``, for comparison only."""
    check_counts(n, lost, gained)
    check_probability("level", level)
    z = float(norm.ppf(0.5 + level / 2))
    if method == "tango":
        return _tango_interval(n, lost, gained, z)
    m = lost + gained
    if method == "newcombe":
        if m == 0:
            return 0.0, 0.0
        theta_low, theta_high = _wilson(gained, m, z)
        return (m / n) * (2 * theta_low - 1), (m / n) * (2 * theta_high - 1)
    if method == "wald":
        delta = (gained - lost) / n
        half = z * math.sqrt(max(m / n - delta * delta, 0.0) / n)
        return max(-1.0, delta - half), min(1.0, delta + half)
    raise ValueError(f"method={method!r}: must be one of {', '.join(CI_METHODS)}")


def noninferiority(
    n: int, lost: int, gained: int, margin: float, alpha: float = 0.025
) -> NonInferiorityResult:
    """Score test (Tango/Nam) of H0: delta <= -margin; non-inferior when the one-sided p < alpha."""
    check_counts(n, lost, gained)
    check_probability("margin", margin)
    check_probability("alpha", alpha)
    statistic = tango_statistic(n, lost, gained, -margin)
    p_value = float(norm.sf(statistic))
    return NonInferiorityResult(
        statistic=statistic, p_value=p_value, non_inferior=p_value < alpha, margin=margin, alpha=alpha
    )
