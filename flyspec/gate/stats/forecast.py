"""What a registered design will do, by seeded simulated runs: ``simulate(design)`` and its cached
``design_outcome`` (the report's advice for INCONCLUSIVE runs, the demo's choice of margin and pool), and
the forecast of when a sequential run will decide (the progress bar, the demo's first line, the report).

A ``Design`` is what a run registers: fixed (Tango's interval at n questions) or sequential (stop at the
first crossing, at most ``questions``), over the i.i.d. claim or a finite pool, exact-graded or judged
(prediction-powered, with a gold-label rate and a fair judge wrong ``judge_noise`` of the time per order).
Why simulate rather than scale a table: the sequential stopping time is not a simple function of margin
and flip rate (the audit found "47,000 x flip rate" off by 15% at a 5-point margin), and finite pools and
judged designs change it further. The vectorised kernels are flyspec/gate/stats/simulation.py; the
closed forms, flyspec/gate/stats/sizing.py.

Early on, the effect seen says little: after 22 pairs a loss of 3 pairs in 22 is noise, and a forecast
built on it promised the demo a decision "at ~278 pairs" where the median was 1,074. So the forecast
has two bases:

- **No-harm prior** (before ``MIN_PAIRS`` pairs, and while the standard error of the effect estimate
  exceeds the margin): simulate the REGISTERED design (i.i.d. or finite sequence, exact or
  judged) at the flip rate seen, with no true effect, and keep the simulated runs that
  had not decided by now (the run being forecast has not). Their median stop is the forecast. Cached by
  the rounded flip rate, so the bar pays once per rate.
- **Effect seen** (afterwards): each simulated continuation extends the observed differences with draws at
  the observed loss and gain rates (each count plus one half, so a cell not seen yet is rare, not
  impossible) up to the registered question limit, and walks the same rule.

Before any pair, ``forecast_from_rate`` gives the design's outlook from a flip rate the caller knows (a
pilot's, or an assumed one), for a line such as "median 1,074 questions, 90% by 1,206".

The median stopping point, divided by the rate at which pairs complete, is the expected time to a
decision; the share of simulated runs that decide within the time budget says how likely that is. This
describes what the data so far suggest, not part of the test: the decision never uses it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.stats import norm

from flyspec.gate.stats.decide import FAIL, INCONCLUSIVE, PASS, crossing_verdicts
from flyspec.gate.stats.paired import tango_statistic
from flyspec.gate.stats.simulation import (
    Outcomes,
    draw_differences,
    iid_stops,
    judged_runs,
    sequential_decisions,
)

KINDS = ("fixed", "sequential")
MIN_PAIRS = 20
"""Pairs before the observed effect may be used at all."""
PRIOR, EFFECT = "no-harm prior", "effect seen"


@dataclass(frozen=True)
class Design:
    """A registered design (see the module docstring). ``questions``: a fixed run's size, or a sequential
    run's most questions; ``population_size``: the pool of a finite-population sequential run (its
    without-replacement sequence), None for the i.i.d. claim; ``label_rate``: set for a judged run."""

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

    def describe(self) -> str:
        """The design in a few words."""
        words = (
            f"{self.kind} run of {'at most ' if self.kind == 'sequential' else ''}{self.questions} questions"
        )
        if self.population_size is not None:
            words += f" (finite pool of {self.population_size})"
        if self.label_rate is not None:
            words += f", judged with gold labels on {100 * self.label_rate:.0f}% of differing pairs"
        return words


@dataclass(frozen=True)
class DesignOutcome:
    """Simulated runs of a design: ``median``/``q90``: questions by which half / 90% of the runs decided
    (None when fewer did within the design's questions); ``pass_rate``, ``fail_rate``, ``undecided``:
    shares of the runs; ``stops``: each run's questions used (the design's questions when undecided) and
    ``decisions``, for conditional questions such as the forecast's."""

    median: int | None
    q90: int | None
    pass_rate: float
    fail_rate: float
    undecided: float
    runs: int
    stops: np.ndarray
    decisions: np.ndarray

    def describe(self) -> str:
        """E.g. 'median 1,074 questions, 90% of runs by 2,150; PASS 0.98, FAIL 0.00, undecided 0.02'."""

        def q(v: int | None) -> str:
            return "not reached" if v is None else f"{v:,}"

        return (
            f"median {q(self.median)} questions, 90% of runs by {q(self.q90)}; PASS {self.pass_rate:.2f}, "
            f"FAIL {self.fail_rate:.2f}, undecided {self.undecided:.2f} ({self.runs} simulated runs)"
        )


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
    """Simulate ``runs`` runs of ``design`` at this flip rate (judged: share of differing answers) and true
    difference (uncached; ``design_outcome`` caches)."""
    if not 0.0 <= flip_rate <= 1.0 or abs(true_diff) > flip_rate + 1e-12:
        raise ValueError(f"flip_rate={flip_rate}, true_diff={true_diff}: need |true_diff| <= flip rate <= 1")
    rng = np.random.default_rng(seed)
    n = design.questions
    if design.label_rate is not None:
        out = judged_runs(
            rng,
            runs,
            n,
            flip_rate,
            true_diff,
            margin,
            alpha,
            "fair",
            design.judge_noise,
            design.label_rate,
            design.kind,
        )
    elif design.kind == "fixed":
        out = _fixed_exact(rng, runs, n, flip_rate, true_diff, margin, alpha)
    elif design.population_size is None:
        out = _sequential_iid(rng, runs, n, flip_rate, true_diff, margin, alpha)
    else:
        out = _sequential_finite(rng, runs, n, design.population_size, flip_rate, true_diff, margin, alpha)
    return _outcome(out)


def rounded_rate(flip_rate: float) -> float:
    """The flip rate to two significant digits (the cache key): 0.1637 -> 0.16, 0.0234 -> 0.023."""
    if flip_rate <= 0:
        return 0.0
    return float(f"{flip_rate:.2g}")


@functools.lru_cache(maxsize=256)
def _cached(
    design: Design, rate: float, margin: float, alpha: float, true_diff: float, runs: int, seed: int
) -> DesignOutcome:
    return simulate(design, rate, margin, alpha, true_diff, runs, seed)


def design_outcome(
    design: Design,
    flip_rate: float,
    margin: float,
    alpha: float,
    true_diff: float = 0.0,
    runs: int = 400,
    seed: int = 0,
) -> DesignOutcome:
    """Questions-to-decision quantiles and decision shares of ``design`` at the flip rate rounded to two
    significant digits and this true difference (default: no true effect), by ``runs`` seeded simulated
    runs, cached."""
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
    """Questions a fixed judged run needs for ``power`` (PASS when ``true_diff > -margin``), by simulated
    runs: a bisection on n with the same seed at every n (common random numbers, so the simulated power
    rises with n). None when even ``most`` questions fall short. Takes a few seconds."""

    def power_at(n: int) -> float:
        out = simulate(
            Design("fixed", n, label_rate=label_rate, judge_noise=judge_noise),
            differing,
            margin,
            alpha,
            true_diff,
            runs,
            seed,
        )
        return out.pass_rate if true_diff > -margin else out.fail_rate

    low, high = 1, 1000
    while power_at(high) < power:
        low, high = high, high * 2
        if high > most:
            return None if power_at(most) < power else _bisect(power_at, low, most, power)
    return _bisect(power_at, low, high, power)


def _bisect(power_at: Callable[[int], float], low: int, high: int, power: float) -> int:
    # To 1% of n: the simulated power itself has a standard error of about 0.02.
    while high - low > max(1, high // 100):
        mid = (low + high) // 2
        if power_at(mid) >= power:
            high = mid
        else:
            low = mid
    return high


def _fixed_exact(
    rng: np.random.Generator, runs: int, n: int, flip_rate: float, delta: float, margin: float, alpha: float
) -> Outcomes:
    """Fixed-size exact-graded runs of ``n`` questions: ``decide`` on seeded multinomial tables."""
    tables = rng.multinomial(n, [(flip_rate - delta) / 2, (flip_rate + delta) / 2, 1 - flip_rate], size=runs)
    t = tango_statistic(n, tables[:, 0].astype(float), tables[:, 1].astype(float), -margin)
    # Tango's statistic at -margin beyond z(1 - alpha) is the interval's lower bound above -margin.
    z = float(norm.ppf(1 - alpha))
    return Outcomes(crossing_verdicts(t > z, t < -z), np.full(runs, n, dtype=np.int64))


def _sequential_iid(
    rng: np.random.Generator,
    runs: int,
    questions: int,
    flip_rate: float,
    delta: float,
    margin: float,
    alpha: float,
    start: tuple[int, int, int] = (0, 0, 0),
) -> Outcomes:
    """Runs of the exact-graded i.i.d. sequential rule, drawn a block at a time (rows that decided stop
    drawing). ``start``: counts (lost, tied, gained) already observed, which every run continues from (the
    i.i.d. capital depends on the counts only); stops count from the first question."""

    def draw(active: np.ndarray, _begin: int, cols: int) -> np.ndarray:
        return draw_differences(rng, active.size, cols, flip_rate, delta)

    passed, failed, stopped = iid_stops(runs, questions, draw, margin, alpha, start, block=1024)
    return Outcomes(crossing_verdicts(passed, failed), stopped)


def _sequential_finite(
    rng: np.random.Generator,
    runs: int,
    questions: int,
    population_size: int,
    flip_rate: float,
    delta: float,
    margin: float,
    alpha: float,
) -> Outcomes:
    """Runs of the without-replacement sequential rule over a pool of ``population_size`` differences with
    about this flip rate and mean (rounded to whole questions), each in its own random order."""
    lost = round(population_size * (flip_rate - delta) / 2)
    gained = min(round(population_size * (flip_rate + delta) / 2), population_size - lost)
    pool = np.array([-1] * lost + [1] * gained + [0] * (population_size - lost - gained), dtype=np.int8)
    orders = np.stack([rng.permutation(pool)[:questions] for _ in range(runs)])
    return Outcomes(*sequential_decisions(orders, margin, alpha, population_size))


@dataclass(frozen=True)
class Forecast:
    """The simulated outlook of a sequential run after ``pairs`` pairs.

    ``median_pairs``/``q90_pairs``: the pairs by which half / 90% of the simulated runs decide (None when
    fewer do within the question limit); ``likely``: the decision most deciding runs reach; ``minutes``:
    time from now to ``median_pairs`` at ``pairs_per_minute`` (None when the rate is unknown);
    ``within_budget``: the share of runs deciding before the time budget runs out (or the question limit);
    ``basis``: ``PRIOR`` (the registered design at ``flip_rate`` with no true effect) or ``EFFECT``.
    """

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
        """A phrase for the progress bar, e.g. 'if no true effect (flip rate 16%): PASS expected at ~3,400
        pairs (~14 min; 80% within budget)'."""
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


def _reachable(n: int, max_questions: int, pairs_per_minute: float, minutes_left: float | None) -> int:
    if minutes_left is not None and pairs_per_minute > 0:
        return min(max_questions, n + int(pairs_per_minute * minutes_left))
    return max_questions


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
    within = float((decided & (stops <= _reachable(n, max_questions, pairs_per_minute, minutes_left))).mean())
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
    """The registered design's outlook at ``flip_rate`` with no true effect, among simulated runs that had
    not decided after ``pairs`` pairs (0: before the run starts)."""
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
    """The outlook of an exact-graded sequential run from its observed ``diffs`` (candidate - baseline,
    in order); None before the first pair or when nothing is left to simulate.

    ``population_size``: the sequence's pool (``SequentialPlan.sequence_population``: None for the i.i.d.
    claim); ``design`` overrides the design simulated under the no-harm prior (a judged run's). Uses the
    no-harm prior before ``MIN_PAIRS`` pairs and while the effect's standard error exceeds the margin,
    the effect seen afterwards (module docstring).
    """
    observed = np.asarray(diffs, dtype=np.int8)
    n = len(observed)
    if n == 0 or max_questions - n <= 0:
        return None
    lost, gained = int((observed == -1).sum()), int((observed == 1).sum())
    psi, delta = (lost + gained) / n, (gained - lost) / n
    standard_error = math.sqrt(max(psi - delta * delta, 0.0) / n)
    if n < MIN_PAIRS or standard_error > margin:
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
    decisions, stopped_at = _continued(observed, margin, alpha, max_questions, population_size, paths, seed)
    return _summarise(decisions, stopped_at, n, max_questions, pairs_per_minute, minutes_left, EFFECT, psi)


def _continued(
    observed: np.ndarray,
    margin: float,
    alpha: float,
    max_questions: int,
    population_size: int | None,
    paths: int,
    seed: int,
) -> tuple[np.ndarray, np.ndarray]:
    """``paths`` continuations of the observed run up to ``max_questions`` at the effect seen (each count
    smoothed by half a pair), decided as the run would be: ``(decisions, stopped_at)``."""
    n = len(observed)
    lost, gained = int((observed == -1).sum()), int((observed == 1).sum())
    rng = np.random.default_rng(seed)
    p_lost, p_gained = (lost + 0.5) / (n + 1.5), (gained + 0.5) / (n + 1.5)
    if population_size is None:
        # The i.i.d. capital depends on the counts only: continue from them, drawing as far as needed.
        out = _sequential_iid(
            rng,
            paths,
            max_questions,
            p_lost + p_gained,
            p_gained - p_lost,
            margin,
            alpha,
            start=(lost, n - lost - gained, gained),
        )
        return out.decisions, out.stopped_at
    probs = np.array([p_lost, 1 - p_lost - p_gained, p_gained])
    future = rng.choice(np.array([-1, 0, 1], dtype=np.int8), p=probs, size=(paths, max_questions - n))
    walks = np.concatenate([np.broadcast_to(observed, (paths, n)), future], axis=1)
    return sequential_decisions(walks, margin, alpha, population_size)


__all__ = ["EFFECT", "MIN_PAIRS", "PRIOR", "Forecast", "forecast", "forecast_from_rate"]
