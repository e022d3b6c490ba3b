"""When will a sequential run decide? A forecast from the pairs seen so far, for the progress bar.

The confidence sequence's stopping point depends on data not yet seen, so the forecast simulates it at
the effect seen so far: each simulated continuation extends the observed differences with draws at the
observed loss and gain rates (each count plus one half, so a cell not seen yet is rare, not impossible)
up to the registered question limit, and walks the same sequential rule (`sequential_decisions`,
vectorised over the continuations). The median stopping point among them, divided by the rate at which
pairs complete, is the expected time to a decision; the share of continuations that decide within the
time budget says how likely that is. Early on the observed rates are themselves uncertain, so the
forecast moves as pairs arrive; it is recomputed every few pairs.

This is a description of what the data so far suggest, not part of the test: the decision itself never
uses it, and a forecast made while the run goes on does not affect the confidence sequence's validity.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from flyspec.gate.stats.decision import INCONCLUSIVE
from flyspec.gate.stats.sequential import sequential_decisions

MIN_PAIRS = 20
"""Pairs needed before a forecast is shown: fewer say too little about the rates."""


@dataclass(frozen=True)
class Forecast:
    """The simulated outlook of a sequential run after `pairs` pairs.

    `median_pairs`: the median number of pairs at which the simulated continuations decide (None when
    fewer than half of them decide within the question limit); `likely`: the decision most of the
    deciding continuations reach; `minutes`: time from now to `median_pairs` at `pairs_per_minute`;
    `within_budget`: the share of continuations that decide before the time budget runs out (or before
    the question limit, without a budget).
    """

    pairs: int
    pairs_per_minute: float
    median_pairs: int | None
    likely: str | None
    minutes: float | None
    within_budget: float

    def describe(self) -> str:
        """A phrase for the progress bar, e.g. 'FAIL expected at ~260 pairs (~14 min; 80% within budget)'."""
        if self.median_pairs is None:
            return f"no decision expected within the question limit ({100 * self.within_budget:.0f}% chance)"
        when = f"~{self.minutes:.0f} min" if self.minutes is not None else "rate unknown"
        return (
            f"{self.likely} expected at ~{self.median_pairs} pairs ({when}; "
            f"{100 * self.within_budget:.0f}% within budget)"
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
) -> Forecast | None:
    """Simulate `paths` continuations of the observed `diffs` (candidate - baseline, in order) under the
    run's sequential rule; None before MIN_PAIRS pairs or when nothing is left to simulate."""
    observed = np.asarray(diffs, dtype=np.int8)
    n = len(observed)
    remaining = max_questions - n
    if n < MIN_PAIRS or remaining <= 0:
        return None
    rng = np.random.default_rng(seed)
    counts = np.array([(observed == d).sum() for d in (-1, 0, 1)], dtype=float) + 0.5
    future = rng.choice(np.array([-1, 0, 1], dtype=np.int8), p=counts / counts.sum(), size=(paths, remaining))
    walks = np.concatenate([np.broadcast_to(observed, (paths, n)), future], axis=1)
    decisions, stopped_at = sequential_decisions(walks, margin, alpha, population_size)
    decided = decisions != INCONCLUSIVE
    reachable = max_questions
    if minutes_left is not None and pairs_per_minute > 0:
        reachable = min(max_questions, n + int(pairs_per_minute * minutes_left))
    within = float((decided & (stopped_at <= reachable)).mean())
    if decided.mean() < 0.5:
        return Forecast(n, pairs_per_minute, None, None, None, within)
    median = int(np.median(np.where(decided, stopped_at, max_questions + 1)))
    values, votes = np.unique(decisions[decided], return_counts=True)
    likely = str(values[np.argmax(votes)])
    minutes = max(0, median - n) / pairs_per_minute if pairs_per_minute > 0 else None
    return Forecast(n, pairs_per_minute, median, likely, minutes, within)
