"""How many questions a run needs: the closed forms of a fixed-size run (McNemar: Connor 1987; the
non-inferiority score test: Nam 1997, Liu et al. 2002) and the plan a pilot's flips imply. What a
registered design does by simulated runs is flyspec/gate/stats/forecast.py; how many gold labels a judged
run needs, flyspec/gate/stats/label_advice.py. docs/statistics.md, "Planning a fixed-size run".

**Pilots.** A plan is made at the flip rate's exact upper confidence bound, not at the observed rate,
which a small pilot (and above all one with no flips) underestimates too often.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scipy.stats import beta, norm

from flyspec.checks import is_int
from flyspec.gate.stats.paired import check_probability, restricted_lost_rate


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
