"""Anytime-valid confidence sequences by betting (docs/statistics.md, "Sequential runs" and "Judged runs"):
the hedged capital of Waudby-Smith and Ramdas (JRSS-B 2023), for paired differences (i.i.d. or without
replacement over a finite pool) and for values in a known range (a judged run's). Every bound is the first
rejected candidate, so a grid can only widen the interval. Our own code rather than ``confseq``, which
recomputes from the start at every update and needs a C++ build.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import optimize

from flyspec.checks import is_int, is_number
from flyspec.gate.stats.paired import check_probability

BETS = 2.0 ** -np.arange(8)
_BET_SIZES = BETS.tolist()
GRID_STEPS = 4000
GRID = np.arange(-GRID_STEPS, GRID_STEPS + 1, 2) / GRID_STEPS
"""Candidate means of delta: ``GRID_STEPS`` steps over [-1, 1] (0.0005 each)."""
_TRUNCATION = 0.5  # c in the cap c / m: every factor stays >= 1 - c, so no bet can ruin the bettor
_RENORMALISE_EVERY = 32  # factors lie in [0.5, 2]: 32 steps cannot overflow or underflow a double
_NEGLIGIBLE = 1e-280  # a component this far below the best adds nothing; zeroing it only lowers K
_ROOT_TOLERANCE = 1e-13


def check_population(population_size: int | None, observations: int) -> None:
    if population_size is None:
        return
    if not is_int(population_size, 1):
        raise ValueError(f"population_size={population_size!r}: must be a positive integer or None")
    if observations > population_size:
        raise ValueError(
            f"{observations} differences exceed population_size={population_size}: "
            "sampling without replacement sees each question once"
        )


def as_diffs(diffs: Sequence[int] | np.ndarray, ndim: int) -> np.ndarray:
    values = np.asarray(diffs)
    if values.ndim != ndim:
        need = "one flat sequence" if ndim == 1 else "a 2-D array, one sequence per row"
        raise ValueError(f"diffs has shape {values.shape}: need {need}")
    if values.dtype == bool or (values.size and not np.isin(values, (-1, 0, 1)).all()):
        bad = values.flat[0] if values.dtype == bool else values[~np.isin(values, (-1, 0, 1))].flat[0]
        raise ValueError(f"diffs contains {bad.item()!r}: each paired difference must be -1, 0 or 1")
    return values.astype(np.int8)


def bet_terms(m: float, side: int) -> list[tuple[float, float, float]]:
    """Per bet b, log(1 + s lam_b (x - m)) for x = 0, 1/2, 1, where s = 1 for K+ and -1 for K-."""
    room = m if side > 0 else 1.0 - m
    cap = _TRUNCATION / room if room > 0 else math.inf
    terms = []
    for bet in _BET_SIZES:
        lam = side * min(bet, cap)
        terms.append((math.log1p(-lam * m), math.log1p(lam * (0.5 - m)), math.log1p(lam * (1.0 - m))))
    return terms


def _log_capital(counts: list[int], terms: list[tuple[float, float, float]]) -> float:
    """log K at one candidate mean after i.i.d. observations with these counts (lost, tied, gained): with
    constant bets each product is prod_x (1 + s lam (x - m))^count_x, so only the counts matter."""
    lost, tied, gained = counts
    logs = [lost * a + tied * b + gained * c for a, b, c in terms]
    top = max(logs)
    return top + math.log(math.fsum(math.exp(v - top) for v in logs) / len(logs))


class _ExactSequence:
    """The i.i.d. confidence sequence: counts, the running bounds in X, and exact roots when they move."""

    def __init__(self, alpha: float) -> None:
        self.threshold = math.log(2.0 / alpha)
        self.counts = [0, 0, 0]
        self.low, self.high = 0.0, 1.0
        # The bet terms at the current bounds, which stay put on most steps.
        self._terms = {1: bet_terms(self.low, 1), -1: bet_terms(self.high, -1)}

    def update(self, d: int) -> tuple[float, float]:
        """Observe one more difference; return the running (low, high) for delta."""
        self.counts[d + 1] += 1
        self.low = self._move(self.low, self.high, side=1)
        self.high = self._move(self.high, self.low, side=-1)
        return 2.0 * self.low - 1.0, 2.0 * self.high - 1.0

    def _move(self, bound: float, other: float, side: int) -> float:
        """The new bound: unchanged unless K now rejects it, else the root of K = threshold towards
        ``other`` (all of [bound, other] rejected means the set is empty: a miss; both ends meet)."""

        def excess(m: float) -> float:
            return _log_capital(self.counts, bet_terms(m, side)) - self.threshold

        if _log_capital(self.counts, self._terms[side]) < self.threshold:
            return bound
        if excess(other) >= 0:
            moved = other
        else:
            lo, hi = min(bound, other), max(bound, other)
            root = optimize.brentq(excess, lo, hi, xtol=_ROOT_TOLERANCE)
            # Report a rejected value: brentq may land a hair inside the set.
            if excess(root) < 0:
                root = min(max(root - side * 2 * _ROOT_TOLERANCE, lo), hi)
            moved = root
        self._terms[side] = bet_terms(moved, side)
        return moved


class Capital:
    """Without replacement: K+ and K- at the candidate means ``m`` (P,) of X for R sequences in lockstep.
    The bets' centre moves with the data, so each mean needs its own running product; each side keeps its
    B components relative to a per-(row, mean) log scale, so the hot loop multiplies instead of taking
    logarithms."""

    def __init__(self, m: np.ndarray, rows: int, alpha: float, population_size: int) -> None:
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
        self.too_low = np.zeros((rows, m.size), dtype=bool)
        self.too_high = np.zeros((rows, m.size), dtype=bool)
        self.sum_x = np.zeros(rows)

    def keep(self, rows: np.ndarray) -> None:
        for name in ("kp", "km", "scale_p", "scale_m", "limit_p", "limit_m", "too_low", "too_high", "sum_x"):
            setattr(self, name, getattr(self, name)[rows])

    def keep_columns(self, cut: slice) -> None:
        self.m = self.m[cut]
        for name in ("kp", "km", "scale_p", "scale_m", "limit_p", "limit_m", "too_low", "too_high"):
            setattr(self, name, getattr(self, name)[:, cut])

    def step(self, x: np.ndarray) -> None:
        """Bet on one more observation per row (``x`` has shape (R,))."""
        self.t += 1
        # The mean of the questions not seen yet, if the whole set's mean were m.
        m_t = (self.population * self.m[None, :] - self.sum_x[:, None]) / (self.population - self.t + 1)
        self.too_low, self.too_high = m_t < 0.0, m_t > 1.0
        m_t = np.clip(m_t, 0.0, 1.0)
        with np.errstate(divide="ignore"):  # 1 / 0 = inf: no cap at the ends
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
        with np.errstate(over="ignore"):  # a capital that has shrunk to nothing can never reach it: inf
            limit[...] = BETS.size * np.exp(self.threshold - scale)

    def logical_bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """Bounds for the set's mean of D that hold for sure (every unseen question at -1, or at 1), from
        integers so that a mean equal to a margin is not pushed past it by rounding."""
        sum_d = 2.0 * self.sum_x - self.t
        remaining = self.population - self.t
        return (sum_d - remaining) / self.population, (sum_d + remaining) / self.population

    def rejected_plus(self) -> np.ndarray:
        """Means ruled out from below: K+ reached the threshold, or the data already exceeds them."""
        return (self.kp.sum(axis=2) >= self.limit_p) | self.too_low

    def rejected_minus(self) -> np.ndarray:
        """Means ruled out from above: K- reached the threshold, or the unseen rest cannot reach them."""
        return (self.km.sum(axis=2) >= self.limit_m) | self.too_high


def _live_window(live: np.ndarray) -> tuple[int, int] | None:
    """The first and last candidate means not yet rejected (indices into ``live``); None when none is."""
    if not live.any():
        return None
    return int(np.argmax(live)), live.size - 1 - int(np.argmax(live[::-1]))


def _grid_bounds(first: int, last: int) -> tuple[float, float]:
    """The nearest rejected grid points around the live ones ``first..last``."""
    return float(GRID[max(first - 1, 0)]), float(GRID[min(last + 1, GRID_STEPS)])


class _GridConfidenceSequence:
    """Without replacement: the confidence sequence on the grid, tracking only the window of live points
    (from grid index ``lo``) and keeping the running intersection."""

    def __init__(self, alpha: float, population_size: int) -> None:
        self.capital = Capital((GRID + 1.0) / 2.0, 1, alpha, population_size)
        self.lo = 0
        self.live = np.ones(GRID_STEPS + 1, dtype=bool)
        self.low, self.high = -1.0, 1.0

    def update(self, d: int) -> tuple[float, float]:
        """Observe one more difference; return the running (low, high) for delta."""
        capital = self.capital
        capital.step(np.array([(d + 1) / 2.0]))
        self.live &= ~(capital.rejected_plus()[0] | capital.rejected_minus()[0])
        # With every grid point rejected the last bounds stay: they still contain the continuous
        # confidence set, which can be narrower than one grid step.
        window = _live_window(self.live)
        if window is not None:
            first, last = window
            self.low, self.high = _grid_bounds(self.lo + first, self.lo + last)
            if (first, last) != (0, self.live.size - 1):
                capital.keep_columns(slice(first, last + 1))
                self.live = self.live[first : last + 1]
                self.lo += first
        logical_low, logical_high = (float(bound[0]) for bound in capital.logical_bounds())
        low, high = max(self.low, logical_low), min(self.high, logical_high)
        # Only after a miss (probability <= alpha) can the grid exclude every feasible value.
        return (logical_low, logical_high) if low > high else (low, high)


class ConfidenceSequence:
    """Online betting confidence sequence for the mean paired difference delta: with probability at least
    ``1 - alpha`` it lies in every interval ``update(d)`` returns. With ``population_size=N`` the target is
    the mean over N questions visited in random order without replacement."""

    def __init__(self, alpha: float = 0.05, population_size: int | None = None) -> None:
        check_probability("alpha", alpha)
        check_population(population_size, 0)
        self.alpha = alpha
        self.population_size = population_size
        self._sequence: _ExactSequence | _GridConfidenceSequence = _ExactSequence(alpha)
        if population_size is not None:
            self._sequence = _GridConfidenceSequence(alpha, population_size)
        self.n = 0
        self.low, self.high = -1.0, 1.0

    def update(self, d: int) -> tuple[float, float]:
        """Add one paired difference and return the running bounds for delta, each in [-1, 1]."""
        if isinstance(d, bool) or d not in (-1, 0, 1):
            raise ValueError(f"d={d!r}: each paired difference must be -1, 0 or 1")
        check_population(self.population_size, self.n + 1)
        self.n += 1
        self.low, self.high = self._sequence.update(int(d))
        return self.low, self.high


def confidence_sequence(
    diffs: Sequence[int], alpha: float = 0.05, population_size: int | None = None
) -> tuple[list[float], list[float]]:
    """``ConfidenceSequence``'s running bounds ``(low, high)`` after each of the paired differences
    ``diffs`` (candidate - baseline: -1, 0 or 1) in observation order: two lists."""
    values = as_diffs(diffs, ndim=1)
    check_probability("alpha", alpha)
    check_population(population_size, len(values))
    sequence = ConfidenceSequence(alpha, population_size)
    bounds = [sequence.update(d) for d in values.tolist()]
    return [low for low, _ in bounds], [high for _, high in bounds]


@dataclass(frozen=True)
class Bets:
    """One version of the bounded-mean bets, as fractions (below 1) of the largest bet the range allows:
    the anytime mixture's constant bets, the fixed-horizon bet's cap (``truncation``), ``words`` for the
    report."""

    fractions: np.ndarray
    truncation: float
    words: str


BET_VERSIONS = {
    1: Bets(
        np.array([0.95, 0.8, 0.6, 0.45, 0.3, 0.2, 0.13, 0.09]),
        0.9,
        "at most 0.9 of the largest safe bet in a fixed run, 0.95 in the sequential mixture",
    ),
    2: Bets(
        np.array([0.99, 0.95, 0.8, 0.6, 0.45, 0.3, 0.2, 0.13]),
        0.99,
        "at most 0.99 of the largest safe bet",
    ),
}
"""The bets judged runs register by version (docs/statistics.md, "Fewer labels for a good judge")."""
BET = 2
"""The version new runs register; a run registered before versions existed reads as 1."""


def check_bet(bet: int) -> Bets:
    """The bets of version ``bet``; ValueError for a version this flyspec does not know."""
    if not is_int(bet) or bet not in BET_VERSIONS:
        raise ValueError(f"bet={bet!r}: a version of the bounded-mean bets, one of {sorted(BET_VERSIONS)}")
    return BET_VERSIONS[bet]


ENDPOINT_ROOM = 1e-12
"""The room given a grid end at ``m = 0`` or ``1`` (see ``BoundedMeanSequence.update``)."""
PRIOR_MEAN, PRIOR_VARIANCE = 0.5, 0.25
"""The paper's start for the plug-in's running mean and variance in [0, 1]."""


class BoundedMeanSequence:
    """Online confidence sequence for the mean (in ``[-1, 1]``) of values in ``[lo, hi]`` whose conditional
    mean given the past is the target: ``horizon=None`` bets the anytime mixture, ``horizon=n`` the plug-in
    bet tuned to n, as version ``bet`` sets them."""

    def __init__(
        self, lo: float, hi: float, alpha: float, horizon: int | None = None, bet: int = BET
    ) -> None:
        if not (is_number(lo) and is_number(hi) and lo < hi):
            raise ValueError(f"range [{lo!r}, {hi!r}]: need two finite numbers lo < hi")
        check_probability("alpha", alpha)
        if horizon is not None and not is_int(horizon, 1):
            raise ValueError(f"horizon={horizon!r}: must be a positive integer or None (anytime)")
        if lo > -1.0 or hi < 1.0:
            raise ValueError(f"range [{lo}, {hi}] must contain the target's range [-1, 1]")
        self.lo, self.hi, self.alpha, self.horizon = lo, hi, alpha, horizon
        self.bets = check_bet(bet)
        self.threshold = math.log(2.0 / alpha)
        self.grid = GRID
        self.live = np.ones(self.grid.size, dtype=bool)
        self._first, self._last = 0, self.grid.size - 1  # the window of live grid points
        self._m = (self.grid - lo) / (hi - lo)
        width = self.bets.fractions.size if horizon is None else 1
        self._plus = np.zeros((self.grid.size, width))
        self._minus = np.zeros((self.grid.size, width))
        self._sum_sq = 0.0
        self._sum = 0.0
        self.n = 0
        self.low, self.high = -1.0, 1.0
        self.emptied_at: int | None = None
        """The observation after which every candidate mean was rejected (None while some survive)."""

    def update(self, y: float) -> tuple[float, float]:
        """Add one value (it must lie in ``[lo, hi]``) and return the running bounds of the mean."""
        if not is_number(y) or not self.lo - 1e-12 <= y <= self.hi + 1e-12:
            raise ValueError(f"y={y!r}: must be a number in [{self.lo}, {self.hi}]")
        x = min(max((y - self.lo) / (self.hi - self.lo), 0.0), 1.0)
        window = slice(self._first, self._last + 1)
        m = self._m[window, None]
        # When the range is exactly the target's ([-1, 1], every pair labelled) the grid's ends sit at m = 0
        # and 1, where the largest bet is unbounded. Betting it as the limit of a tiny room keeps its meaning
        # (an observation beyond the end rejects it, one at the end costs the fraction) instead of
        # inf * 0 = NaN, which left the end live for ever and the bound stuck at -1 or 1.
        room_up, room_down = np.maximum(m, ENDPOINT_ROOM), np.maximum(1.0 - m, ENDPOINT_ROOM)
        if self.horizon is None:
            up, down = self.bets.fractions / room_up, self.bets.fractions / room_down
        else:
            sigma2 = (PRIOR_VARIANCE + self._sum_sq) / (self.n + 1)  # from the observations before this one
            lam = math.sqrt(2.0 * math.log(2.0 / self.alpha) / (self.horizon * sigma2))
            cap = self.bets.truncation
            up, down = np.minimum(lam, cap / room_up), np.minimum(lam, cap / room_down)
            self._sum += x
            self._sum_sq += (x - (PRIOR_MEAN + self._sum) / (self.n + 2)) ** 2
        plus = self._plus[window]
        minus = self._minus[window]
        plus += np.log1p(up * (x - m))
        minus += np.log1p(-down * (x - m))
        self.n += 1
        rejected = (log_mean_exp(plus) >= self.threshold) | (log_mean_exp(minus) >= self.threshold)
        self.live[window] &= ~rejected
        self._refresh()
        return self.low, self.high

    def _refresh(self) -> None:
        window = _live_window(self.live[self._first : self._last + 1])
        if window is None:
            # Keep the last bounds: the set empties only after a miss (probability <= alpha) or when the
            # values' conditional mean was not constant, which the report flags.
            if self.emptied_at is None:
                self.emptied_at = self.n
            return
        self._first, self._last = self._first + window[0], self._first + window[1]
        self.low, self.high = _grid_bounds(self._first, self._last)


def log_mean_exp(logs: np.ndarray, axis: int = -1) -> np.ndarray:
    """log of the mean of exp over ``axis`` (a mixture's average capital from its components' logs)."""
    top = logs.max(axis=axis, keepdims=True)
    return (top + np.log(np.exp(logs - top).mean(axis=axis, keepdims=True))).squeeze(axis)
