"""Statistics of the paired quality gate (docs/gate.md explains each test and the decision rule).

Notation: ``n`` paired questions; ``lost`` = baseline right and candidate wrong; ``gained`` = the reverse;
``delta = (gained - lost) / n`` (the candidate's accuracy minus the baseline's); flip rate
``psi = (lost + gained) / n``. Only the discordant pairs carry information about ``delta``, which is why
the fixed-size tests below need nothing but ``n``, ``lost`` and ``gained``.

The sequential (anytime-valid) statistics live in ``flyspec.gate.stats.sequential`` and the fixed-sequence
procedure for choosing among settings in ``flyspec.gate.stats.multiple``; ``flyspec.gate.stats`` re-exports
every statistic of the gate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from scipy import optimize
from scipy.stats import beta, binom, norm

from flyspec.checks import is_int, is_number
from flyspec.gate.stats.decision import check_margin, classify

CI_METHODS = ("tango", "newcombe", "wald")


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


@dataclass(frozen=True)
class Decision:
    """The gate's decision on a fixed-size run: the outcome, whether a loss is shown, and the interval.

    ``low, high``: Tango's ``1 - 2 alpha`` interval of delta. ``loss_detected``: ``high < 0`` (the
    candidate is shown worse than the baseline; with INCONCLUSIVE, not shown worse than the margin).
    """

    decision: str
    loss_detected: bool
    low: float
    high: float


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


class PairedCounts(NamedTuple):
    """Counts of a paired comparison: questions, lost and gained."""

    n: int
    lost: int
    gained: int


def _check_counts(n: int, lost: int, gained: int) -> None:
    for name, value in (("n", n), ("lost", lost), ("gained", gained)):
        if not is_int(value, 0):
            raise ValueError(f"{name}={value!r}: must be a non-negative integer")
    if n < 1:
        raise ValueError(f"n={n}: must be at least 1")
    if lost + gained > n:
        raise ValueError(f"lost + gained = {lost + gained} exceeds n={n}: a question flips at most once")


def _check_probability(name: str, value: float, *, allow_zero: bool = False, allow_one: bool = False) -> None:
    if not is_number(value):
        raise ValueError(f"{name}={value!r}: must be a number")
    low_ok = value >= 0 if allow_zero else value > 0
    high_ok = value <= 1 if allow_one else value < 1
    if not (low_ok and high_ok):
        interval = f"{'[' if allow_zero else '('}0, 1{']' if allow_one else ')'}"
        raise ValueError(f"{name}={value!r}: must lie in {interval}")


def mcnemar(lost: int, gained: int) -> McNemarResult:
    """Exact (and mid-p) McNemar test: are lost and gained questions equally likely?

    Conditional on ``m = lost + gained`` flips, ``lost ~ Bin(m, 1/2)`` under the null hypothesis.
    ``exact_p = min(1, 2 P[Bin(m, 1/2) <= min(lost, gained)])`` (1 when m = 0) and
    ``mid_p = exact_p - P[Bin(m, 1/2) = min(lost, gained)]``; when ``lost == gained``,
    ``mid_p = 1 - P[Bin(m, 1/2) = lost] / 2``.
    """
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


def _restricted_lost_rate(n: float, lost: float, gained: float, delta0: float) -> float:
    """Maximum-likelihood lost-cell probability under the constraint delta = delta0 (Tango 1998)."""
    a = 2.0 * n
    b = -gained - lost + (2.0 * n - gained + lost) * delta0
    c = -lost * delta0 * (1.0 - delta0)
    disc = max(b * b - 4.0 * a * c, 0.0)
    return (math.sqrt(disc) - b) / (2.0 * a)


def tango_statistic(n: int, lost: int, gained: int, delta0: float) -> float:
    """Tango's score statistic ``T(delta0)`` for the paired difference of proportions.

    Positive when the observed net is above ``delta0``. Where the restricted variance vanishes (only at
    the ends of [-1, 1]) the statistic is 0 for a zero numerator and an infinity of its sign otherwise.
    """
    p_lost = _restricted_lost_rate(n, lost, gained, delta0)
    numerator = gained - lost - n * delta0
    variance = n * (2.0 * p_lost + delta0 * (1.0 - delta0))
    if variance <= 1e-300:
        return 0.0 if abs(numerator) < 1e-12 else math.copysign(math.inf, numerator)
    return numerator / math.sqrt(variance)


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
    _check_probability("level", level)
    return _wilson(successes, trials, float(norm.ppf(0.5 + level / 2)))


def net_difference_ci(
    n: int, lost: int, gained: int, level: float = 0.95, method: str = "tango"
) -> tuple[float, float]:
    """Confidence interval ``(low, high)`` for the net difference ``delta = (gained - lost) / n``.

    Methods:
    - ``"tango"`` (default): Tango (1998) score interval, every ``delta0`` with
      ``|T(delta0)| <= z(1 - alpha/2)``; good coverage even with few flips.
    - ``"newcombe"``: the conditional approach discussed by Newcombe (1998): a Wilson interval for the
      share of flips that are gains, scaled by the observed flip rate, ``psi * (2 theta - 1)``. It treats
      the flip count as fixed, so with no flips at all it collapses to (0, 0).
    - ``"wald"``: ``delta +- z sqrt((psi - delta^2) / n)``, clipped to [-1, 1]; for comparison only.
    """
    _check_counts(n, lost, gained)
    _check_probability("level", level)
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
    """Score test (Tango/Nam) of H0: delta <= -margin; non-inferior when the one-sided p < alpha.

    Equivalent to the lower bound of the two-sided ``1 - 2 alpha`` Tango interval lying above -margin.
    """
    _check_counts(n, lost, gained)
    _check_probability("margin", margin)
    _check_probability("alpha", alpha)
    statistic = tango_statistic(n, lost, gained, -margin)
    p_value = float(norm.sf(statistic))
    return NonInferiorityResult(
        statistic=statistic, p_value=p_value, non_inferior=p_value < alpha, margin=margin, alpha=alpha
    )


def questions_needed(net_loss: float, flip_rate: float, alpha: float = 0.05, power: float = 0.80) -> int:
    """Questions needed to detect a net difference of ``net_loss`` with McNemar's test (Connor 1987).

    ``ceil((z(1-alpha/2) sqrt(psi) + z(power) sqrt(psi - d^2))^2 / d^2)`` for a two-sided test at ``alpha``.
    """
    _check_probability("net_loss", net_loss)
    _check_probability("flip_rate", flip_rate, allow_one=True)
    _check_probability("alpha", alpha)
    _check_probability("power", power)
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
    _check_probability("margin", margin)
    _check_probability("flip_rate", flip_rate, allow_zero=True, allow_one=True)
    _check_probability("alpha", alpha)
    _check_probability("power", power)
    if not (math.isfinite(true_diff) and true_diff > -margin):
        raise ValueError(
            f"true_diff={true_diff!r}: must exceed -margin={-margin} (otherwise no n gives power)"
        )
    if abs(true_diff) > flip_rate:
        raise ValueError(f"|true_diff|={abs(true_diff)} exceeds flip_rate={flip_rate}: impossible table")
    psi = flip_rate
    p_lost, p_gained = (psi - true_diff) / 2, (psi + true_diff) / 2
    delta0 = -margin
    p_tilde = _restricted_lost_rate(1.0, p_lost, p_gained, delta0)
    sigma0 = math.sqrt(max(2 * p_tilde + delta0 * (1 - delta0), 0.0))
    sigma1 = math.sqrt(max(psi - true_diff * true_diff, 0.0))
    z_a = float(norm.ppf(1 - alpha))
    z_b = float(norm.ppf(power))
    return max(1, math.ceil((z_a * sigma0 + z_b * sigma1) ** 2 / (true_diff - delta0) ** 2))


def decide(n: int, lost: int, gained: int, margin: float, alpha: float = 0.025) -> Decision:
    """The gate's rule on Tango's ``1 - 2 alpha`` interval ``[low, high]`` of delta.

    PASS when ``low > -margin`` (non-inferior); FAIL when ``high < -margin`` (worse than the margin);
    INCONCLUSIVE otherwise. ``loss_detected = high < 0``. A significant McNemar test alone never makes a
    FAIL: a loss smaller than the margin is what the margin allows; report ``mcnemar`` beside this.
    """
    _check_counts(n, lost, gained)
    check_margin(margin)
    _check_probability("alpha", alpha)
    if alpha >= 0.5:
        raise ValueError(f"alpha={alpha!r}: must lie in (0, 0.5) (the interval has level 1 - 2 alpha)")
    low, high = net_difference_ci(n, lost, gained, level=1 - 2 * alpha)
    decision, loss_detected = classify(low, high, margin)
    return Decision(decision=decision, loss_detected=loss_detected, low=low, high=high)


def decide_with_undecided(
    n: int, lost: int, gained: int, undecided: int, margin: float, alpha: float = 0.025
) -> Decision:
    """``decide`` when ``undecided`` of the ``n`` pairs could not be called (a judge whose two orders
    disagree, or a verdict that could not be read): each counts against the claim being tested.

    ``lost`` and ``gained`` are the decided discordant pairs. PASS needs the lower end of Tango's interval
    on ``(n, lost + undecided, gained)`` above ``-margin``; FAIL needs the upper end of the interval on
    ``(n, lost, gained + undecided)`` below it. Each interval is computed from counts at least as
    unfavourable to its claim as the truth, so each claim keeps its error at most alpha; ``low``/``high``
    are those two ends. With ``undecided = 0`` it is ``decide``.
    """
    if not is_int(undecided, 0):
        raise ValueError(f"undecided={undecided!r}: must be an integer >= 0")
    _check_counts(n, lost, gained)
    _check_counts(n, lost + undecided, gained)
    against_pass = decide(n, lost + undecided, gained, margin, alpha)
    if undecided == 0:
        return against_pass
    against_fail = decide(n, lost, gained + undecided, margin, alpha)
    low, high = against_pass.low, against_fail.high
    decision, loss_detected = classify(low, high, margin)
    return Decision(decision=decision, loss_detected=loss_detected, low=low, high=high)


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
    _check_probability("level", level)
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
