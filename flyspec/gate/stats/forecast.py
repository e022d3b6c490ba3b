"""When will a sequential run decide? A forecast for the progress bar, the demo's first line and the report.

Early on, the effect seen says little: after 22 pairs a loss of 3 pairs in 22 is noise, and a forecast
built on it promised the demo a decision "at ~278 pairs" where the median was 1,074. So the forecast
has two bases:

- **No-harm prior** (before ``MIN_PAIRS`` pairs, and while the standard error of the effect estimate
  exceeds the margin): simulate the REGISTERED design (flyspec/gate/stats/designs.py: i.i.d. or finite
  sequence, exact or judged) at the flip rate seen, with no true effect, and keep the simulated runs that
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

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from flyspec.gate.stats.decide import sequential_decisions
from flyspec.gate.stats.decision import INCONCLUSIVE
from flyspec.gate.stats.designs import Design, design_outcome, rounded_rate, sequential_iid

MIN_PAIRS = 20
"""Pairs before the observed effect may be used at all."""
PRIOR, EFFECT = "no-harm prior", "effect seen"


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
    ordered = np.sort(np.where(decided, stops, max_questions + 1))

    def quantile(share: float) -> int | None:
        value = int(ordered[math.ceil(share * ordered.size) - 1])
        return None if value > max_questions else value

    median, q90 = quantile(0.5), quantile(0.9)
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
        out = sequential_iid(
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
