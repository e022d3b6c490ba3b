"""Anytime-valid inference for the paired gate: a betting confidence sequence and the sequential decision.

Each question gives a paired difference ``D = candidate correct - baseline correct`` in {-1, 0, 1}; the
gate wants the mean ``delta = E[D]`` and looks after every question. We map ``X = (D + 1) / 2`` into [0, 1]
and use the hedged capital process of Waudby-Smith and Ramdas, "Estimating means of bounded random
variables by betting" (JRSS-B 2023; arXiv:2010.09686), each side of the hedge betting a mixture of
constant bets (their "diversified Kelly" capital), and for a finite question set visited in random order
without replacement the same processes centred on the mean of the questions not yet seen (Waudby-Smith
and Ramdas, "Confidence sequences for sampling without replacement", NeurIPS 2020). For a candidate mean
``m`` of X:

    K+_t(m) = (1/B) sum_b prod_{i<=t} (1 + min(l_b, c / m_i) (X_i - m_i))
    K-_t(m) = (1/B) sum_b prod_{i<=t} (1 - min(l_b, c / (1 - m_i)) (X_i - m_i))
    m_i = m (i.i.d.)   or   m_i = (N m - sum_{j<i} X_j) / (N - i + 1)   (N questions, without replacement)
    l_b = 2^-b for b = 0 .. 7 (B = 8),  c = 1/2

If m is the true mean, every product is a non-negative martingale with E = 1 (each bet is fixed before
X_i is seen and E[X_i - m_i | past] = 0), hence so are K+, K- and (K+ + K-) / 2, and by Ville's
inequality ``max(K+_t, K-_t) / 2`` ever reaches ``1 / alpha`` with probability at most alpha. The
confidence set at time t is every m where it has not; we keep the running intersection over time, so
bounds never widen. Each factor is non-increasing in m for K+ and non-decreasing for K-, so every set is
an interval, and its lower end passes a value v exactly when K+(v) reaches the threshold: the
sequential decision needs only K+ and K- at the margin.

Why this bet: the paper's default predictable plug-in bet shrinks like 1/sqrt(t log t), which at the
effects the gate must resolve (a 2-point margin, thousands of questions) bets far less than the
growth-optimal amount; in our simulations it needed about twice as many questions as this mixture,
whose bets span the useful range (a factor 2 apart, so one is always within a factor sqrt(2) of the
optimum). See docs/gate.md for the numbers.

Why our own code: the reference implementation (the ``confseq`` package) recomputes every capital process
from the start for each call, needs a C++ build and pulls pandas and pytest at run time, while the gate
updates after every answer. Here each grid point's capital is updated in O(B) per observation, and points
once rejected stay rejected, so the live part of the grid shrinks as evidence accumulates. The grid has
2,000 steps in X (0.001 in D); each reported bound is the nearest *rejected* grid point outside the live
set, so the grid only ever widens the interval.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from flyspec.gate.decision import FAIL, INCONCLUSIVE, PASS, check_margin

GRID_STEPS = 2000
BETS = 2.0 ** -np.arange(8)
_TRUNCATION = 0.5  # c in the cap c / m: every factor stays >= 1 - c, so no bet can ruin the bettor
_RENORMALISE_EVERY = 32  # factors lie in [0.5, 2]: 32 steps cannot overflow or underflow a double
_NEGLIGIBLE = 1e-280  # a component this far below the best adds nothing; zeroing it only lowers K


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


class _Capital:
    """K+ and K- at fixed candidate means of X for R sequences observed in lockstep.

    ``m`` has shape (P,): the same P candidate means for every row. Each side keeps its B components
    relative to a per-(row, mean) log scale, so the hot loop multiplies instead of taking logarithms.
    After ``step``, ``too_low`` and ``too_high`` mark the means the data has ruled out for sure (sampling
    without replacement only).
    """

    def __init__(self, m: np.ndarray, rows: int, alpha: float, population_size: int | None) -> None:
        self.m = m
        self.threshold = math.log(2.0 / alpha)  # (K+ + K-) / 2 >= max(K+, K-) / 2 >= 1 / alpha
        self.population = population_size
        self.t = 0
        shape = (rows, m.size, BETS.size)
        self.kp = np.ones(shape)
        self.km = np.ones(shape)
        # K reaches the threshold when its components' sum reaches ``limit = B exp(threshold - scale)``.
        self.scale_p = np.zeros((rows, m.size))
        self.scale_m = np.zeros((rows, m.size))
        self.limit_p = np.full((rows, m.size), BETS.size * math.exp(self.threshold))
        self.limit_m = self.limit_p.copy()
        self.too_low: np.ndarray | None = None
        self.too_high: np.ndarray | None = None
        self.sum_x = np.zeros(rows)
        if population_size is None:
            # With replacement the caps c / m and c / (1 - m) are constant; 1 / 0 gives inf (no cap).
            with np.errstate(divide="ignore"):
                self.bet_plus = np.minimum(BETS, (_TRUNCATION / m)[:, None])
                self.bet_minus = np.minimum(BETS, (_TRUNCATION / (1.0 - m))[:, None])

    def keep_rows(self, rows: np.ndarray) -> None:
        for name in ("kp", "km", "scale_p", "scale_m", "limit_p", "limit_m", "sum_x"):
            setattr(self, name, getattr(self, name)[rows])

    def keep_columns(self, cut: slice) -> None:
        self.m = self.m[cut]
        for name in ("kp", "km", "scale_p", "scale_m", "limit_p", "limit_m"):
            setattr(self, name, getattr(self, name)[:, cut])
        if self.population is None:
            self.bet_plus, self.bet_minus = self.bet_plus[cut], self.bet_minus[cut]

    def step(self, x: np.ndarray) -> None:
        """Bet on one more observation per row (``x`` has shape (R,))."""
        self.t += 1
        if self.population is None:
            deviation = (x[:, None] - self.m[None, :])[:, :, None]
            bet_plus, bet_minus = self.bet_plus, self.bet_minus
        else:
            # The mean of the questions not seen yet, if the whole set's mean were m.
            m_t = (self.population * self.m[None, :] - self.sum_x[:, None]) / (self.population - self.t + 1)
            self.too_low, self.too_high = m_t < 0.0, m_t > 1.0
            m_t = np.clip(m_t, 0.0, 1.0)
            with np.errstate(divide="ignore"):
                bet_plus = np.minimum(BETS, (_TRUNCATION / m_t)[:, :, None])
                bet_minus = np.minimum(BETS, (_TRUNCATION / (1.0 - m_t))[:, :, None])
            deviation = (x[:, None] - m_t)[:, :, None]
        self.kp *= 1.0 + bet_plus * deviation
        self.km *= 1.0 - bet_minus * deviation
        self.sum_x += x
        if self.t % _RENORMALISE_EVERY == 0:
            self._renormalise(self.kp, self.scale_p, self.limit_p)
            self._renormalise(self.km, self.scale_m, self.limit_m)

    def _renormalise(self, components: np.ndarray, scale: np.ndarray, limit: np.ndarray) -> None:
        top = components.max(axis=2)
        components /= top[:, :, None]
        components[components < _NEGLIGIBLE] = 0.0
        scale += np.log(top)
        limit[...] = BETS.size * np.exp(self.threshold - scale)

    def rejected_plus(self) -> np.ndarray:
        """Means ruled out from below: K+ reached the threshold, or the data already exceeds them."""
        hit = self.kp.sum(axis=2) >= self.limit_p
        return hit if self.too_low is None else hit | self.too_low

    def rejected_minus(self) -> np.ndarray:
        """Means ruled out from above: K- reached the threshold, or the unseen rest cannot reach them."""
        hit = self.km.sum(axis=2) >= self.limit_m
        return hit if self.too_high is None else hit | self.too_high


class _GridConfidenceSequence:
    """The confidence sequence on a grid for R rows: live grid window, running intersection, bounds.

    Grid points are ``d_j = -1 + 2 j / GRID_STEPS`` in D (X = (d + 1) / 2). The window ``[lo, hi]`` (grid
    indices) is the union of the rows' live points; ``live`` marks, per row, the points not yet rejected.
    """

    def __init__(self, rows: int, alpha: float, population_size: int | None) -> None:
        self.grid = np.arange(-GRID_STEPS, GRID_STEPS + 1, 2) / GRID_STEPS
        self.capital = _Capital((self.grid + 1.0) / 2.0, rows, alpha, population_size)
        self.population = population_size
        self.lo, self.hi = 0, GRID_STEPS
        self.live = np.ones((rows, GRID_STEPS + 1), dtype=bool)
        self.low = np.full(rows, -1.0)
        self.high = np.full(rows, 1.0)

    def keep_rows(self, rows: np.ndarray) -> None:
        self.capital.keep_rows(rows)
        self.live, self.low, self.high = self.live[rows], self.low[rows], self.high[rows]

    def update(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Observe one X per row; return each row's running (low, high) for delta."""
        capital = self.capital
        capital.step(x)
        self.live &= ~(capital.rejected_plus() | capital.rejected_minus())
        self._refresh_bounds()
        if self.population is None:
            return self.low.copy(), self.high.copy()
        # What the unseen questions can still contribute bounds the set's mean for sure.
        t, n_total = capital.t, self.population
        logical_low = 2.0 * capital.sum_x / n_total - 1.0
        logical_high = 2.0 * (capital.sum_x + n_total - t) / n_total - 1.0
        low = np.maximum(self.low, logical_low)
        high = np.minimum(self.high, logical_high)
        # Only after a miss (probability <= alpha) can the grid exclude every feasible value.
        crossed = low > high
        low[crossed], high[crossed] = logical_low[crossed], logical_high[crossed]
        return low, high

    def _refresh_bounds(self) -> None:
        width = self.live.shape[1]
        first = np.argmax(self.live, axis=1)
        last = width - 1 - np.argmax(self.live[:, ::-1], axis=1)
        # A row whose every grid point is rejected keeps its last bounds: they still contain the
        # continuous confidence set, which can be narrower than one grid step.
        alive = self.live[np.arange(first.size), first]
        rows: slice | np.ndarray = slice(None)
        if not alive.all():
            if not alive.any():
                return
            rows = np.flatnonzero(alive)
            first, last = first[rows], last[rows]
        first, last = first + self.lo, last + self.lo
        self.low[rows] = self.grid[np.maximum(first - 1, 0)]
        self.high[rows] = self.grid[np.minimum(last + 1, GRID_STEPS)]
        new_lo, new_hi = int(first.min()), int(last.max())
        if (new_lo, new_hi) != (self.lo, self.hi):
            cut = slice(new_lo - self.lo, new_hi - self.lo + 1)
            self.capital.keep_columns(cut)
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
        self._grid = _GridConfidenceSequence(1, alpha, population_size)
        self.n = 0
        self.low, self.high = -1.0, 1.0

    def update(self, d: int) -> tuple[float, float]:
        """Add one paired difference and return the running bounds for delta, each in [-1, 1]."""
        if isinstance(d, bool) or d not in (-1, 0, 1):
            raise ValueError(f"d={d!r}: each paired difference must be -1, 0 or 1")
        _check_population(self.population_size, self.n + 1)
        low, high = self._grid.update(np.array([(d + 1) / 2.0]))
        self.n += 1
        self.low, self.high = float(low[0]), float(high[0])
        return self.low, self.high


def confidence_sequence(
    diffs: Sequence[int], alpha: float = 0.05, population_size: int | None = None
) -> tuple[list[float], list[float]]:
    """Running bounds ``(low, high)`` for delta after each paired difference in ``diffs`` (time-uniform).

    ``diffs`` are the per-question differences candidate - baseline (-1, 0 or 1) in observation order.
    The probability that delta ever leaves ``[low[n], high[n]]`` for any n is at most ``alpha``
    (Waudby-Smith and Ramdas 2023: hedged capital, each side a mixture of constant bets). ``population_size``
    switches to their without-replacement version for a finite question set of that size.
    """
    values = _as_diffs(diffs)
    if values.ndim != 1:
        raise ValueError(f"diffs has shape {values.shape}: need one flat sequence")
    _check_alpha(alpha)
    _check_population(population_size, len(values))
    grid = _GridConfidenceSequence(1, alpha, population_size)
    lows: list[float] = []
    highs: list[float] = []
    for x in (values + 1.0) / 2.0:
        low, high = grid.update(np.array([x]))
        lows.append(float(low[0]))
        highs.append(float(high[0]))
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
    sequence holds at every n at once, stopping at a crossing keeps P(PASS) <= alpha when delta <= -margin
    and P(FAIL) <= alpha when delta >= -margin, however long one keeps looking.
    """
    values = _as_diffs(diffs)
    if values.ndim != 1:
        raise ValueError(f"diffs has shape {values.shape}: need one flat sequence")
    check_margin(margin)
    _check_alpha(alpha, upper=0.5)
    _check_population(population_size, len(values))
    grid = _GridConfidenceSequence(1, 2.0 * alpha, population_size)
    decision, low, high, used = INCONCLUSIVE, -1.0, 1.0, 0
    for x in (values + 1.0) / 2.0:
        used += 1
        lows, highs = grid.update(np.array([x]))
        low, high = float(lows[0]), float(highs[0])
        if low > -margin:
            decision = PASS
            break
        if high < -margin:
            decision = FAIL
            break
    return SequentialDecision(decision=decision, stopped_at=used, low=low, high=high, loss_detected=high < 0)


def sequential_decisions(
    diffs: np.ndarray, margin: float, alpha: float = 0.025, population_size: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Decisions and stopping points of ``sequential_decision`` for many sequences (rows), for simulations.

    Returns ``(decision, stopped_at)`` arrays. Because K+ falls and K- rises in the candidate mean, the
    lower bound first exceeds -margin exactly when K+ at the first grid point above -margin reaches the
    threshold (and the upper bound first drops below it when K- at the last grid point below does), so
    two capital processes per row replace the whole grid. The answers equal ``sequential_decision``'s
    except after a miss that rejects a row's entire grid at once (narrower than one grid step).
    """
    values = np.asarray(diffs)
    if values.ndim != 2:
        raise ValueError(f"diffs has shape {values.shape}: need a 2-D array, one sequence per row")
    if values.size and not np.isin(values, (-1, 0, 1)).all():
        raise ValueError("diffs: each paired difference must be -1, 0 or 1")
    check_margin(margin)
    _check_alpha(alpha, upper=0.5)
    rows, length = values.shape
    _check_population(population_size, length)
    grid = np.arange(-GRID_STEPS, GRID_STEPS + 1, 2) / GRID_STEPS
    above = int(np.flatnonzero(grid > -margin)[0])
    below = int(np.flatnonzero(grid < -margin)[-1])
    capital = _Capital((grid[[above, below]] + 1.0) / 2.0, rows, 2.0 * alpha, population_size)
    decisions = np.full(rows, INCONCLUSIVE, dtype=object)
    stopped_at = np.full(rows, length, dtype=np.int64)
    active = np.arange(rows)
    for step in range(length):
        capital.step((values[active, step] + 1.0) / 2.0)
        passed = capital.rejected_plus()[:, 0]
        failed = capital.rejected_minus()[:, 1]
        if population_size is not None:
            sum_x, remaining = capital.sum_x, population_size - (step + 1)
            passed |= 2.0 * sum_x / population_size - 1.0 > -margin
            failed |= 2.0 * (sum_x + remaining) / population_size - 1.0 < -margin
        done = passed | failed
        if done.any():
            decisions[active[passed]] = PASS
            decisions[active[failed & ~passed]] = FAIL
            stopped_at[active[done]] = step + 1
            active = active[~done]
            capital.keep_rows(~done)
            if active.size == 0:
                break
    return decisions, stopped_at


__all__ = [
    "GRID_STEPS",
    "ConfidenceSequence",
    "SequentialDecision",
    "confidence_sequence",
    "sequential_decision",
    "sequential_decisions",
]
