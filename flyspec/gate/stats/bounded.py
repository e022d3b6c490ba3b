"""Anytime-valid inference on values in a known range: the bounded-mean betting sequence of judged runs.

A judged run (flyspec/gate/stats/judged.py) turns each
question into a value ``Y`` in a known range ``[lo, hi]`` whose conditional mean given the past is the
target. Each ``Y`` is mapped to ``X = (Y - lo) / (hi - lo)`` in [0, 1] and the same two gamblers bet on a
grid of candidate means; by Ville's inequality either reaches ``2 / alpha`` at the true mean with
probability at most ``alpha``. Two bets, chosen before the run (the registration records which):

- **Anytime** (``horizon=None``): each side is a mixture of constant bets, each a fixed fraction of the
  largest bet the range allows (``1 / m`` for ``K+``, ``1 / (1 - m)`` for ``K-``; a larger bet could make
  the capital negative). Valid at every n at once, for sequential runs.
- **Fixed horizon** (``horizon=n``): the paper's predictable plug-in bet tuned to the planned size,
  ``lambda_t = sqrt(2 log(2 / alpha) / (n sigma_{t-1}^2))`` from the running variance estimate, truncated
  at a fraction (``Bets.truncation``) of the largest bet: the paper's confidence interval for a fixed n (its
  hedged-capital CI), valid at n without any central limit theorem (and at every n before, by the same
  martingale argument; after n the bet is no longer tuned, but stays valid).

The fractions and the truncation come in versions (``BET_VERSIONS``) that a run registers: any bet fixed
before its value is seen and below the largest the range allows keeps every argument above.

Both capitals fall as ``m`` rises (``K+``) or rise with it (``K-``), so every confidence set is an
interval; the online class tracks both on a grid of candidate means, each bound reported as the nearest
rejected grid point (so the grid can only widen the interval), and keeps the running intersection.

The betting arguments and the paper are those of flyspec/gate/stats/sequence.py, whose grid this uses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from flyspec.checks import is_int, is_number
from flyspec.gate.stats.sequence import GRID


@dataclass(frozen=True)
class Bets:
    """One version of the bounded-mean bets: ``fractions``, the anytime mixture's constant bets as
    fractions of the largest bet the range allows (``1 / m`` for K+), ``truncation``, the largest
    fraction of it the fixed-horizon bet may take, and ``words`` for the report. Every fraction is below
    1, so no factor reaches 0."""

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
"""The bets judged runs register by version. Version 2 reaches 0.99 of the largest bet: with a judge that
agrees with gold the values' spread is far inside their range, the best bet sits at that cap, and the
capped bet sets how many pairs (so labels) a decision takes (docs/statistics.md, "Fewer labels for a good
judge"); the smallest fraction, which only a weak judge's very noisy values want, made room for it."""
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
    """Online confidence sequence for the mean of values in ``[lo, hi]`` (target in ``[-1, 1]``).

    ``update(y)`` takes the next value and returns the running ``(low, high)``: with probability at least
    ``1 - alpha`` the target lies in every interval returned, provided each value's conditional mean given
    the past equals the target. ``horizon=None`` bets the anytime mixture, ``horizon=n`` the plug-in bet
    tuned to n (see the module docstring), each as ``bet`` (a key of ``BET_VERSIONS``) sets them. Only the
    grid points still in the set are tracked.
    """

    def __init__(
        self, lo: float, hi: float, alpha: float, horizon: int | None = None, bet: int = BET
    ) -> None:
        if not (is_number(lo) and is_number(hi) and lo < hi):
            raise ValueError(f"range [{lo!r}, {hi!r}]: need two finite numbers lo < hi")
        if not is_number(alpha, above=0, below=1):
            raise ValueError(f"alpha={alpha!r}: must lie in (0, 1)")
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
        live = self.live[self._first : self._last + 1]
        if not live.any():
            # Keep the last bounds: the set empties only after a miss (probability <= alpha) or when the
            # values' conditional mean was not constant, which the report flags.
            if self.emptied_at is None:
                self.emptied_at = self.n
            return
        first = self._first + int(np.argmax(live))
        last = self._last - int(np.argmax(live[::-1]))
        self._first, self._last = first, last
        self.low = float(self.grid[max(first - 1, 0)])
        self.high = float(self.grid[min(last + 1, self.grid.size - 1)])


def _plug_in_bets(x: np.ndarray, alpha: float, horizon: int) -> np.ndarray:
    """The fixed-horizon bet before each observation (untruncated), for rows of observations in [0, 1].

    ``lambda_t = sqrt(2 log(2 / alpha) / (horizon sigma_{t-1}^2))`` with the running estimates
    ``mu_t = (1/2 + sum_{i<=t} x_i) / (t + 1)`` and
    ``sigma_t^2 = (1/4 + sum_{i<=t} (x_i - mu_i)^2) / (t + 1)``
    (Waudby-Smith and Ramdas 2024, section 4: the predictable plug-in tuned to n); each bet uses only
    earlier observations.
    """
    steps = np.arange(1, x.shape[-1] + 1, dtype=float)
    mu = (PRIOR_MEAN + np.cumsum(x, axis=-1)) / (steps + 1)
    sigma2 = (PRIOR_VARIANCE + np.cumsum((x - mu) ** 2, axis=-1)) / (steps + 1)
    before = np.concatenate([np.full(x.shape[:-1] + (1,), PRIOR_VARIANCE), sigma2[..., :-1]], axis=-1)
    return np.sqrt(2.0 * math.log(2.0 / alpha) / (horizon * before))


def log_capital(
    x: np.ndarray, m: float, side: int, alpha: float, horizon: int | None, bet: int = BET
) -> np.ndarray:
    """Running log capital of one side at the candidate mean ``m`` (in X units) for rows of observations
    ``x`` in [0, 1] (shape (runs, n)): ``side=1`` is K+ (it grows when the mean is above m), ``-1`` K-.

    ``BoundedMeanSequence`` for many rows at once (its test reference); a PASS happens exactly when K+ at
    the margin reaches the threshold.
    """
    if not 0.0 < m < 1.0:
        raise ValueError(f"m={m!r}: must lie strictly inside (0, 1)")
    room = m if side > 0 else 1.0 - m
    deviation = side * (x - m)
    if horizon is None:
        logs = [np.cumsum(np.log1p((f / room) * deviation), axis=-1) for f in check_bet(bet).fractions]
        return log_mean_exp(np.stack(logs), axis=0)
    bets = np.minimum(_plug_in_bets(x, alpha, horizon), check_bet(bet).truncation / room)
    return np.cumsum(np.log1p(bets * deviation), axis=-1)


def log_mean_exp(logs: np.ndarray, axis: int = -1) -> np.ndarray:
    """log of the mean of exp over ``axis`` (a mixture's average capital from its components' logs)."""
    top = logs.max(axis=axis, keepdims=True)
    return (top + np.log(np.exp(logs - top).mean(axis=axis, keepdims=True))).squeeze(axis)
