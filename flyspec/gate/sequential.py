"""Anytime-valid inference for the paired gate: a betting confidence sequence and the sequential decision.

Each question gives a paired difference ``D = candidate correct - baseline correct`` in {-1, 0, 1}; the
gate wants the mean ``delta = E[D]`` and looks after every question. We map ``X = (D + 1) / 2`` into [0, 1]
and use the hedged capital process of Waudby-Smith and Ramdas, "Estimating means of bounded random
variables by betting" (JRSS-B 2023, section 4 and theorem 3), with their predictable plug-in bets; for a
known finite question set sampled in random order without replacement, the same construction with the
mean of the *remaining* questions (Waudby-Smith and Ramdas, "Confidence sequences for sampling without
replacement", NeurIPS 2020, section 3). For each candidate mean ``m`` of X:

    K+_t(m) = prod_{i<=t} (1 + lam+_i(m) (X_i - m_i)),   K-_t(m) = prod_{i<=t} (1 - lam-_i(m) (X_i - m_i))
    m_i = m (i.i.d.)  or  (N m - sum_{j<i} X_j) / (N - i + 1) (without replacement from N questions)
    lam_i = sqrt(2 log(2 / alpha) / (sigma2_{i-1} i log(1 + i)))           (predictable plug-in)
    lam+_i(m) = min(lam_i, c / m_i),  lam-_i(m) = min(lam_i, c / (1 - m_i)),  c = 1/2
    mu_t = (1/2 + sum_{i<=t} X_i) / (t + 1),  sigma2_t = (1/4 + sum_{i<=t} (X_i - mu_i)^2) / (t + 1)

Under the true mean both products are non-negative martingales, so their average with weights 1/2 is one
too, and by Ville's inequality it ever reaches 1/alpha with probability at most alpha. The confidence set
at time t is every m with ``max(K+_t(m), K-_t(m)) / 2 < 1 / alpha``; K+ falls and K- rises in m, so it is
an interval. We keep the running intersection over time, so bounds never widen.

Why our own code: the reference implementation (the ``confseq`` package) recomputes every capital process
from the start for each call, needs a C++ build and pulls pandas and pytest at run time, while the gate
updates after every answer. Here each grid point's log-capital is updated in O(1) per observation, and
points once rejected stay rejected, so the live part of the grid shrinks as evidence accumulates.
The grid has 2,000 steps in X (0.001 in D); each reported bound is the nearest *rejected* grid point
outside the live set, so the grid only ever widens the interval. See docs/gate.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from flyspec.gate.decision import FAIL, INCONCLUSIVE, PASS, check_margin

GRID_STEPS = 2000
_TRUNCATION = 0.5  # c in lam+ <= c / m: keeps every factor >= 1 - c, as the paper recommends


def _check_alpha(alpha: float, name: str = "alpha", upper: float = 1.0) -> None:
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise ValueError(f"{name}={alpha!r}: must be a number")
    if not 0 < alpha < upper:
        raise ValueError(f"{name}={alpha!r}: must lie in (0, {upper:g})")


def _check_population(population_size: int | None, observations: int) -> None:
    if population_size is None:
        return
    if isinstance(population_size, bool) or not isinstance(population_size, int) or population_size < 1:
        raise ValueError(f"population_size={population_size!r}: must be a positive integer or None")
    if observations > population_size:
        raise ValueError(
            f"{observations} differences exceed population_size={population_size}: "
            "sampling without replacement sees each question once"
        )


def _as_diffs(diffs: Sequence[int] | np.ndarray) -> np.ndarray:
    values = np.asarray(diffs)
    if values.size and not np.isin(values, (-1, 0, 1)).all():
        bad = values[~np.isin(values, (-1, 0, 1))].flat[0]
        raise ValueError(f"diffs contains {bad!r}: each paired difference must be -1, 0 or 1")
    return values.astype(np.float64)


class _HedgedCapitalBatch:
    """Hedged capital processes over the live grid window for R sequences observed in lockstep.

    Works in X = (D + 1) / 2. The window ``[lo, hi]`` (global grid indices) is the union of every row's
    live points; ``live`` marks, per row, the points not yet rejected.
    """

    def __init__(self, rows: int, alpha: float, population_size: int | None) -> None:
        self.grid = np.linspace(0.0, 1.0, GRID_STEPS + 1)
        self.threshold = math.log(2.0 / alpha)  # max(K+, K-) / 2 >= 1 / alpha
        self.bet_scale = 2.0 * math.log(2.0 / alpha)
        self.population = population_size
        self.t = 0
        self.lo, self.hi = 0, GRID_STEPS
        shape = (rows, GRID_STEPS + 1)
        self.log_kp = np.zeros(shape)
        self.log_km = np.zeros(shape)
        self.live = np.ones(shape, dtype=bool)
        self.sum_x = np.zeros(rows)
        self.sum_sq = np.zeros(rows)
        self.sigma2 = np.full(rows, 0.25)
        self.low = np.zeros(rows)
        self.high = np.ones(rows)

    def keep(self, rows: np.ndarray) -> None:
        """Continue with the given rows only (an index array or boolean mask)."""
        for name in ("log_kp", "log_km", "live", "sum_x", "sum_sq", "sigma2", "low", "high"):
            setattr(self, name, getattr(self, name)[rows])

    def update(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Observe one X per row; return the rows' running (low, high) for the mean of X."""
        self.t += 1
        t = self.t
        lam = np.sqrt(self.bet_scale / (self.sigma2 * t * math.log1p(t)))[:, None]
        m = self.grid[self.lo : self.hi + 1][None, :]
        if self.population is None:
            m_t = m
            feasible = None
        else:
            # Mean of the questions not yet seen, if the whole set's mean were m.
            m_t = (self.population * m - self.sum_x[:, None]) / (self.population - t + 1)
            feasible = (m_t >= 0.0) & (m_t <= 1.0)
            m_t = np.clip(m_t, 0.0, 1.0)
        with np.errstate(divide="ignore"):
            lam_plus = np.minimum(lam, _TRUNCATION / m_t)
            lam_minus = np.minimum(lam, _TRUNCATION / (1.0 - m_t))
        deviation = x[:, None] - m_t
        self.log_kp += np.log1p(lam_plus * deviation)
        self.log_km += np.log1p(-lam_minus * deviation)
        rejected = np.maximum(self.log_kp, self.log_km) >= self.threshold
        if feasible is not None:
            rejected |= ~feasible
        self.live &= ~rejected

        self.sum_x += x
        mu = (0.5 + self.sum_x) / (t + 1)
        self.sum_sq += (x - mu) ** 2
        self.sigma2 = (0.25 + self.sum_sq) / (t + 1)

        self._refresh_bounds()
        if self.population is not None:
            remaining = self.population - t
            logical_low = self.sum_x / self.population
            logical_high = (self.sum_x + remaining) / self.population
            low = np.maximum(self.low, logical_low)
            high = np.minimum(self.high, logical_high)
            # Only after a miss (probability <= alpha) can the grid exclude every feasible value.
            crossed = low > high
            low[crossed], high[crossed] = logical_low[crossed], logical_high[crossed]
            return low, high
        return self.low.copy(), self.high.copy()

    def _refresh_bounds(self) -> None:
        width = self.live.shape[1]
        any_live = self.live.any(axis=1)
        first = np.argmax(self.live, axis=1)
        last = width - 1 - np.argmax(self.live[:, ::-1], axis=1)
        # A row whose every grid point is rejected keeps its last bounds: they still contain the
        # continuous confidence set, which can be narrower than one grid step.
        rows = np.flatnonzero(any_live)
        if rows.size == 0:
            return
        first_global = self.lo + first[rows]
        last_global = self.lo + last[rows]
        self.low[rows] = self.grid[np.maximum(first_global - 1, 0)]
        self.high[rows] = self.grid[np.minimum(last_global + 1, GRID_STEPS)]
        new_lo, new_hi = int(first_global.min()), int(last_global.max())
        if (new_lo, new_hi) != (self.lo, self.hi):
            cut = slice(new_lo - self.lo, new_hi - self.lo + 1)
            self.log_kp = self.log_kp[:, cut]
            self.log_km = self.log_km[:, cut]
            self.live = self.live[:, cut]
            self.lo, self.hi = new_lo, new_hi


class ConfidenceSequence:
    """Online betting confidence sequence for the mean paired difference delta.

    ``update(d)`` takes the next difference (-1, 0 or 1) and returns the running ``(low, high)``: with
    probability at least ``1 - alpha`` the true delta lies in every interval ever returned. With
    ``population_size=N`` the target is the mean over a finite set of N questions visited in uniformly
    random order without replacement, and the interval closes on it as the set is exhausted.
    """

    def __init__(self, alpha: float = 0.05, population_size: int | None = None) -> None:
        _check_alpha(alpha)
        _check_population(population_size, 0)
        self.alpha = alpha
        self.population_size = population_size
        self._batch = _HedgedCapitalBatch(1, alpha, population_size)
        self.n = 0
        self.low, self.high = -1.0, 1.0

    def update(self, d: int) -> tuple[float, float]:
        """Add one paired difference and return the running bounds for delta, each in [-1, 1]."""
        if isinstance(d, bool) or d not in (-1, 0, 1):
            raise ValueError(f"d={d!r}: each paired difference must be -1, 0 or 1")
        _check_population(self.population_size, self.n + 1)
        low, high = self._batch.update(np.array([(d + 1) / 2.0]))
        self.n += 1
        self.low, self.high = float(2.0 * low[0] - 1.0), float(2.0 * high[0] - 1.0)
        return self.low, self.high


def confidence_sequence(
    diffs: Sequence[int], alpha: float = 0.05, population_size: int | None = None
) -> tuple[list[float], list[float]]:
    """Running bounds ``(low, high)`` for delta after each paired difference in ``diffs`` (time-uniform).

    ``diffs`` are the per-question differences candidate - baseline (-1, 0 or 1) in observation order.
    The probability that delta ever leaves ``[low[n], high[n]]`` for any n is at most ``alpha``
    (Waudby-Smith and Ramdas 2023, hedged capital with predictable plug-in bets). ``population_size``
    switches to their without-replacement version for a finite question set of that size.
    """
    values = _as_diffs(diffs)
    _check_alpha(alpha)
    _check_population(population_size, len(values))
    batch = _HedgedCapitalBatch(1, alpha, population_size)
    lows: list[float] = []
    highs: list[float] = []
    for x in (values + 1.0) / 2.0:
        low, high = batch.update(np.array([x]))
        lows.append(float(2.0 * low[0] - 1.0))
        highs.append(float(2.0 * high[0] - 1.0))
    return lows, highs


@dataclass(frozen=True)
class SequentialDecision:
    """Outcome of walking the confidence sequence: the decision, where it stopped and the bounds there."""

    decision: str
    stopped_at: int
    low: float
    high: float
    loss_detected: bool


def sequential_decision(
    diffs: Sequence[int], margin: float, alpha: float = 0.025, population_size: int | None = None
) -> SequentialDecision:
    """Walk the ``1 - 2 alpha`` confidence sequence and stop at the first boundary crossing.

    PASS at the first n with ``low_n > -margin``; FAIL at the first n with ``high_n < -margin``;
    INCONCLUSIVE when neither happens within ``diffs`` (``stopped_at = len(diffs)``). Because the
    sequence is valid at every n at once, stopping at a crossing keeps P(PASS | delta <= -margin) <= alpha
    and P(FAIL | delta >= -margin) <= alpha.
    """
    values = _as_diffs(diffs)
    check_margin(margin)
    _check_alpha(alpha, upper=0.5)
    _check_population(population_size, len(values))
    decisions, stops, lows, highs = sequential_decisions(values[None, :], margin, alpha, population_size)
    decision = str(decisions[0])
    return SequentialDecision(
        decision=decision,
        stopped_at=int(stops[0]),
        low=float(lows[0]),
        high=float(highs[0]),
        loss_detected=bool(highs[0] < 0),
    )


def sequential_decisions(
    diffs: np.ndarray, margin: float, alpha: float = 0.025, population_size: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``sequential_decision`` for many sequences at once (rows of ``diffs``), for simulations.

    Returns arrays ``(decision, stopped_at, low, high)``, one entry per row; the same numbers as calling
    ``sequential_decision`` on each row, computed in lockstep so the grid work is vectorised.
    """
    values = _as_diffs(diffs)
    if values.ndim != 2:
        raise ValueError(f"diffs has shape {values.shape}: need a 2-D array, one sequence per row")
    check_margin(margin)
    _check_alpha(alpha, upper=0.5)
    rows, length = values.shape
    _check_population(population_size, length)
    decisions = np.full(rows, INCONCLUSIVE, dtype=object)
    stopped_at = np.full(rows, length, dtype=np.int64)
    lows = np.full(rows, -1.0)
    highs = np.full(rows, 1.0)
    active = np.arange(rows)
    batch = _HedgedCapitalBatch(rows, 2.0 * alpha, population_size)
    x_all = (values + 1.0) / 2.0
    for step in range(length):
        low_x, high_x = batch.update(x_all[active, step])
        low, high = 2.0 * low_x - 1.0, 2.0 * high_x - 1.0
        lows[active], highs[active] = low, high
        passed, failed = low > -margin, high < -margin
        done = passed | failed
        if done.any():
            decisions[active[passed]] = PASS
            decisions[active[failed & ~passed]] = FAIL
            stopped_at[active[done]] = step + 1
            active = active[~done]
            batch.keep(~done)
            if active.size == 0:
                break
    return decisions, stopped_at, lows, highs


__all__ = [
    "GRID_STEPS",
    "ConfidenceSequence",
    "SequentialDecision",
    "confidence_sequence",
    "sequential_decision",
    "sequential_decisions",
]
