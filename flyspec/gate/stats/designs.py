"""How many questions a registered design needs to decide, by simulating it: the numbers behind the
report's advice for INCONCLUSIVE runs, the progress bar's forecast and the demo's choice of margin and pool.

A ``Design`` is what a run registers: fixed (Tango's interval at n questions) or sequential (stop at the
first crossing, at most ``questions``), over the i.i.d. claim or a finite pool of ``population_size``
questions, exact-graded or judged (prediction-powered, with a gold-label rate and a fair judge wrong
``judge_noise`` of the time per order). ``design_outcome`` simulates ``runs`` runs of it at a flip rate (for
judged designs: the share of differing answers) and a true difference, and returns the quantiles of the
questions used and the shares of each decision. Results are cached by the rounded flip rate (two
significant digits), so a progress bar that asks after every few pairs pays once.

Why simulate rather than scale a table: the sequential design's stopping time is not a simple function of
margin and flip rate (the audit found "47,000 x flip rate" off by 15% at a 5-point margin), and finite
pools and judged designs change it further.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy.stats import norm

from flyspec.gate.stats.decide import crossing_verdicts, sequential_decisions
from flyspec.gate.stats.decision import FAIL, INCONCLUSIVE, PASS
from flyspec.gate.stats.sequential import iid_stops
from flyspec.gate.stats.simulation import Outcomes, draw_differences, judged_runs

KINDS = ("fixed", "sequential")
_BLOCK = 1024


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


def _tango(n: int, lost: np.ndarray, gained: np.ndarray, d0: float) -> np.ndarray:
    a = 2.0 * n
    b = -gained - lost + (2.0 * n - gained + lost) * d0
    c = -lost * d0 * (1.0 - d0)
    p = (np.sqrt(np.maximum(b * b - 4 * a * c, 0.0)) - b) / (2 * a)
    return (gained - lost - n * d0) / np.sqrt(n * (2 * p + d0 * (1 - d0)))


def _fixed_exact(
    rng: np.random.Generator, runs: int, n: int, flip_rate: float, delta: float, margin: float, alpha: float
) -> Outcomes:
    tables = rng.multinomial(n, [(flip_rate - delta) / 2, (flip_rate + delta) / 2, 1 - flip_rate], size=runs)
    t = _tango(n, tables[:, 0].astype(float), tables[:, 1].astype(float), -margin)
    # Tango's statistic at -margin beyond z(1 - alpha) is the interval's lower bound above -margin.
    z = float(norm.ppf(1 - alpha))
    return Outcomes(crossing_verdicts(t > z, t < -z), np.full(runs, n, dtype=np.int64))


def sequential_iid(
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

    passed, failed, stopped = iid_stops(runs, questions, draw, margin, alpha, start, block=_BLOCK)
    return Outcomes(crossing_verdicts(passed, failed), stopped)


def finite_pool(size: int, flip_rate: float, delta: float) -> np.ndarray:
    """A pool of ``size`` differences with about this flip rate and mean (rounded to whole questions)."""
    lost = round(size * (flip_rate - delta) / 2)
    gained = min(round(size * (flip_rate + delta) / 2), size - lost)
    return np.array([-1] * lost + [1] * gained + [0] * (size - lost - gained), dtype=np.int8)


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
        out = sequential_iid(rng, runs, n, flip_rate, true_diff, margin, alpha)
    else:
        pool = finite_pool(design.population_size, flip_rate, true_diff)
        orders = np.stack([rng.permutation(pool)[:n] for _ in range(runs)])
        decisions, stops = sequential_decisions(orders, margin, alpha, design.population_size)
        out = Outcomes(decisions, stops)
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
