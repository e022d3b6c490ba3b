"""How many questions a run needs (docs/statistics.md, "Planning a fixed-size run" and "Plans and
forecasts"): the closed forms of a fixed-size run, ``simulate(design)`` on seeded runs, and the forecast of
when a sequential run will decide, which never enters the decision."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.stats import beta, norm

from flyspec.checks import is_int
from flyspec.gate.stats.decide import FAIL, INCONCLUSIVE, PASS, crossing_verdicts
from flyspec.gate.stats.paired import check_probability, restricted_lost_rate, tango_statistic
from flyspec.gate.stats.simulation import Outcomes, iid_runs, judged_runs, sequential_decisions

KINDS = ("fixed", "sequential")
MIN_PAIRS = 20
"""Pairs before the observed effect may be used at all."""
PRIOR, EFFECT = "no-harm prior", "effect seen"


@dataclass(frozen=True)
class SampleSizePlan:
    """A fixed-size run's plan from a pilot's flips: ``questions`` at the flip rate's upper bound
    ``flip_rate_upper``, ``questions_at_observed`` at the observed rate (None without a flip)."""

    flips: int
    pilot_questions: int
    flip_rate: float
    flip_rate_upper: float
    questions: int
    questions_at_observed: int | None


def questions_needed(net_loss: float, flip_rate: float, alpha: float = 0.05, power: float = 0.80) -> int:
    """Questions for McNemar's two-sided test at ``alpha`` to detect a net difference of ``net_loss`` with
    ``power`` (Connor 1987)."""
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
    """Questions for the paired non-inferiority score test to pass with ``power`` (Nam 1997; Liu et al.
    2002), ``sigma0`` from Tango's restricted lost-cell rate at the true cell probabilities."""
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
    """Exact one-sided (Clopper-Pearson) ``level`` upper bound of the flip rate from ``flips`` of ``n``."""
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
    """Plan a fixed-size run from a pilot's ``flips`` of ``n`` at the flip rate's upper bound (a small
    pilot's observed rate underestimates it too often)."""
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
class Design:
    """A registered design: ``questions``, a fixed run's size or a sequential run's most; ``population_size``,
    a finite pool (None: the i.i.d. claim); ``label_rate`` and ``judge_noise`` for a judged run."""

    kind: str
    questions: int
    population_size: int | None = None
    label_rate: float | None = None
    judge_noise: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind={self.kind!r}: one of {', '.join(KINDS)}")
        if self.questions < 1:
            raise ValueError(f"questions={self.questions}: must be at least 1")
        if self.population_size is not None:
            if self.kind != "sequential" or self.label_rate is not None:
                raise ValueError("a finite pool goes with an exact-graded sequential design only")
            if self.questions > self.population_size:
                raise ValueError(f"questions={self.questions} exceed the pool of {self.population_size}")


@dataclass(frozen=True)
class DesignOutcome:
    """Simulated runs of a design: ``median``/``q90``, the questions by which half / 90% decided (None when
    fewer did); the shares of each verdict; each run's ``stops`` and ``decisions``."""

    median: int | None
    q90: int | None
    pass_rate: float
    fail_rate: float
    undecided: float
    runs: int
    stops: np.ndarray
    decisions: np.ndarray


def _quantile(stops: np.ndarray, decided: np.ndarray, share: float) -> int | None:
    """The questions by which a ``share`` of the runs decided; None when fewer did."""
    if decided.mean() < share:
        return None
    ordered = np.sort(np.where(decided, stops, np.iinfo(np.int64).max))
    return int(ordered[math.ceil(share * stops.size) - 1])


def _outcome(out: Outcomes) -> DesignOutcome:
    decided = out.decisions != INCONCLUSIVE
    return DesignOutcome(
        median=_quantile(out.stopped_at, decided, 0.5),
        q90=_quantile(out.stopped_at, decided, 0.9),
        pass_rate=out.share(PASS),
        fail_rate=out.share(FAIL),
        undecided=out.share(INCONCLUSIVE),
        runs=out.decisions.size,
        stops=out.stopped_at,
        decisions=out.decisions,
    )


def simulate(
    design: Design,
    flip_rate: float,
    margin: float,
    alpha: float,
    true_diff: float = 0.0,
    runs: int = 400,
    seed: int = 0,
) -> DesignOutcome:
    """``runs`` seeded runs of ``design`` at this flip rate (judged: share of differing answers) and true
    difference, by the vectorised rule that tests/test_gate_stats_decide.py pins to ``decide``."""
    if not 0.0 <= flip_rate <= 1.0 or abs(true_diff) > flip_rate + 1e-12:
        raise ValueError(f"flip_rate={flip_rate}, true_diff={true_diff}: need |true_diff| <= flip rate <= 1")
    rng = np.random.default_rng(seed)
    n = design.questions
    if design.label_rate is not None:
        noise, rate = design.judge_noise, design.label_rate
        out = judged_runs(rng, runs, n, flip_rate, true_diff, margin, alpha, "fair", noise, rate, design.kind)
    elif design.kind == "fixed":
        cells = [(flip_rate - true_diff) / 2, (flip_rate + true_diff) / 2, 1 - flip_rate]
        tables = rng.multinomial(n, cells, size=runs)
        t = tango_statistic(n, tables[:, 0].astype(float), tables[:, 1].astype(float), -margin)
        # Tango's statistic at -margin beyond z(1 - alpha) is the interval's lower bound above -margin.
        z = float(norm.ppf(1 - alpha))
        out = Outcomes(crossing_verdicts(t > z, t < -z), np.full(runs, n, dtype=np.int64))
    elif design.population_size is None:
        out = iid_runs(rng, runs, n, flip_rate, true_diff, margin, alpha)
    else:
        # Each run's own order of a pool at this flip rate and mean.
        size = design.population_size
        lost = round(size * (flip_rate - true_diff) / 2)
        gained = min(round(size * (flip_rate + true_diff) / 2), size - lost)
        pool = np.array([-1] * lost + [1] * gained + [0] * (size - lost - gained), dtype=np.int8)
        orders = np.stack([rng.permutation(pool)[:n] for _ in range(runs)])
        out = Outcomes(*sequential_decisions(orders, margin, alpha, size))
    return _outcome(out)


def rounded_rate(flip_rate: float) -> float:
    """The flip rate to two significant digits (the cache key): 0.1637 -> 0.16, 0.0234 -> 0.023."""
    if flip_rate <= 0:
        return 0.0
    return float(f"{flip_rate:.2g}")


_cached = functools.lru_cache(maxsize=256)(simulate)


def design_outcome(
    design: Design,
    flip_rate: float,
    margin: float,
    alpha: float,
    true_diff: float = 0.0,
    runs: int = 400,
    seed: int = 0,
) -> DesignOutcome:
    """``simulate``, cached by the flip rate rounded to two significant digits."""
    rate = rounded_rate(flip_rate)
    diff = min(max(round(true_diff, 4), -rate), rate)
    return _cached(design, rate, round(margin, 6), round(alpha, 6), diff, runs, seed)


def judged_questions_needed(
    differing: float,
    margin: float,
    alpha: float,
    label_rate: float,
    judge_noise: float,
    true_diff: float = 0.0,
    power: float = 0.8,
    runs: int = 400,
    most: int = 200_000,
    seed: int = 0,
) -> int | None:
    """Questions a fixed judged run needs for ``power`` (of PASS when ``true_diff > -margin``, else FAIL),
    with one seed at every n; None when even ``most`` fall short."""

    def reaches(n: int) -> bool:
        design = Design("fixed", n, label_rate=label_rate, judge_noise=judge_noise)
        out = simulate(design, differing, margin, alpha, true_diff, runs, seed)
        return (out.pass_rate if true_diff > -margin else out.fail_rate) >= power

    low, high = 1, 1000
    while not reaches(high):
        low, high = high, high * 2
        if high > most:
            return first_reaching(reaches, low, most) if reaches(most) else None
    return first_reaching(reaches, low, high)


def first_reaching(reaches: Callable[[int], bool], low: int, high: int) -> int:
    """The smallest n in ``(low, high]`` that ``reaches``, by bisection, given that ``high`` does and ``low``
    does not; to 1% of ``high`` (a simulated power has a standard error of about 0.02)."""
    while high - low > max(1, high // 100):
        mid = (low + high) // 2
        if reaches(mid):
            high = mid
        else:
            low = mid
    return high


@dataclass(frozen=True)
class Forecast:
    """A sequential run's simulated outlook after ``pairs`` pairs; ``basis``: ``PRIOR`` (no true effect at
    ``flip_rate``) or ``EFFECT`` (the effect seen)."""

    pairs: int
    pairs_per_minute: float
    median_pairs: int | None
    likely: str | None
    minutes: float | None
    within_budget: float
    q90_pairs: int | None = None
    basis: str = EFFECT
    flip_rate: float | None = None

    def describe(self) -> str:
        """A phrase for the progress bar: 'PASS expected at ~3,400 pairs (~14 min; 80% within budget)'."""
        head = ""
        if self.basis == PRIOR and self.flip_rate is not None:
            head = f"if no true effect (flip rate {100 * self.flip_rate:.1f}%): "
        if self.median_pairs is None:
            return (
                f"{head}no decision expected within the question limit "
                f"({100 * self.within_budget:.0f}% chance)"
            )
        when = f"~{self.minutes:.0f} min" if self.minutes is not None else "rate unknown"
        return (
            f"{head}{self.likely} expected at ~{self.median_pairs:,} pairs ({when}; "
            f"{100 * self.within_budget:.0f}% within budget)"
        )

    def outlook(self) -> str:
        """Quantiles in words, for a run's first line: 'median 1,074 questions, 90% by 1,206'."""
        if self.median_pairs is None:
            return f"fewer than half the simulated runs decide ({100 * self.within_budget:.0f}% do)"
        q90 = "beyond the limit" if self.q90_pairs is None else f"{self.q90_pairs:,}"
        return f"median {self.median_pairs:,} questions, 90% by {q90}"


def _summarise(
    decisions: np.ndarray,
    stops: np.ndarray,
    n: int,
    max_questions: int,
    pairs_per_minute: float,
    minutes_left: float | None,
    basis: str,
    flip_rate: float | None,
) -> Forecast:
    decided = decisions != INCONCLUSIVE
    reachable = max_questions
    if minutes_left is not None and pairs_per_minute > 0:
        reachable = min(max_questions, n + int(pairs_per_minute * minutes_left))
    within = float((decided & (stops <= reachable)).mean())
    median, q90 = _quantile(stops, decided, 0.5), _quantile(stops, decided, 0.9)
    if median is None:
        return Forecast(n, pairs_per_minute, None, None, None, within, None, basis, flip_rate)
    values, votes = np.unique(decisions[decided], return_counts=True)
    likely = str(values[np.argmax(votes)])
    minutes = max(0, median - n) / pairs_per_minute if pairs_per_minute > 0 else None
    return Forecast(n, pairs_per_minute, median, likely, minutes, within, q90, basis, flip_rate)


def forecast_from_rate(
    flip_rate: float,
    design: Design,
    *,
    margin: float,
    alpha: float,
    pairs: int = 0,
    pairs_per_minute: float = 0.0,
    minutes_left: float | None = None,
    paths: int = 200,
    seed: int = 0,
) -> Forecast:
    """The design's outlook at ``flip_rate`` with no true effect, among the simulated runs still undecided
    after ``pairs`` pairs."""
    outcome = design_outcome(design, flip_rate, margin, alpha, 0.0, runs=paths, seed=seed)
    alive = (outcome.decisions == INCONCLUSIVE) | (outcome.stops > pairs)
    if not alive.any():
        alive[:] = True  # every simulated run decided already: fall back on all of them
    return _summarise(
        outcome.decisions[alive],
        outcome.stops[alive],
        pairs,
        design.questions,
        pairs_per_minute,
        minutes_left,
        PRIOR,
        rounded_rate(flip_rate),
    )


def forecast(
    diffs: Sequence[int],
    *,
    margin: float,
    alpha: float,
    max_questions: int,
    population_size: int | None,
    pairs_per_minute: float,
    minutes_left: float | None,
    paths: int = 200,
    seed: int = 0,
    design: Design | None = None,
) -> Forecast | None:
    """The outlook of a sequential run from its observed ``diffs`` in order (None before the first pair or
    at the limit); ``design`` replaces the exact-graded one simulated under the no-harm prior."""
    observed = np.asarray(diffs, dtype=np.int8)
    n = len(observed)
    if n == 0 or max_questions - n <= 0:
        return None
    lost, gained = int((observed == -1).sum()), int((observed == 1).sum())
    psi, delta = (lost + gained) / n, (gained - lost) / n
    # An early effect is noise (docs/statistics.md, "Plans and forecasts"): until it is measured, the
    # no-harm prior simulates the registered design with no true effect.
    if n < MIN_PAIRS or math.sqrt(max(psi - delta * delta, 0.0) / n) > margin:
        registered = design or Design("sequential", max_questions, population_size)
        # A rate of exactly zero flips would forecast the easiest case; half a flip keeps it honest.
        rate = max(psi, 0.5 / n)
        return forecast_from_rate(
            rate,
            registered,
            margin=margin,
            alpha=alpha,
            pairs=n,
            pairs_per_minute=pairs_per_minute,
            minutes_left=minutes_left,
            paths=paths,
            seed=seed,
        )
    # Continue the run at the effect seen (each count plus half a pair), decided as the run would be.
    rng = np.random.default_rng(seed)
    p_lost, p_gained = (lost + 0.5) / (n + 1.5), (gained + 0.5) / (n + 1.5)
    if population_size is None:
        # The i.i.d. capital depends on the counts only: continue from them, drawing as far as needed.
        start = (lost, n - lost - gained, gained)
        out = iid_runs(rng, paths, max_questions, p_lost + p_gained, p_gained - p_lost, margin, alpha, start)
        decisions, stops = out.decisions, out.stopped_at
    else:
        probs = np.array([p_lost, 1 - p_lost - p_gained, p_gained])
        future = rng.choice(np.array([-1, 0, 1], dtype=np.int8), p=probs, size=(paths, max_questions - n))
        walks = np.concatenate([np.broadcast_to(observed, (paths, n)), future], axis=1)
        decisions, stops = sequential_decisions(walks, margin, alpha, population_size)
    return _summarise(decisions, stops, n, max_questions, pairs_per_minute, minutes_left, EFFECT, psi)
