"""Seeded simulations of gate runs, vectorised over runs (``simulate(design)``, the label advice, the
validity tests, the scripts behind docs/statistics.md's tables). A bound passes ``-margin`` exactly when
the betting capital on its side there reaches the threshold, so two capitals per run decide it, block by
block (``first_crossings``); tests/test_gate_stats_decide.py pins the verdicts to ``decide``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np

from flyspec.gate.stats.decide import check_margin_alpha, crossing_verdicts
from flyspec.gate.stats.judged import LAM_PRIOR, LAM_PRIOR_WEIGHT, JudgedPair, value_range
from flyspec.gate.stats.sequence import (
    BET,
    GRID,
    PRIOR_MEAN,
    PRIOR_VARIANCE,
    Capital,
    as_diffs,
    bet_terms,
    check_bet,
    check_population,
    log_mean_exp,
)

T = TypeVar("T")
ChunkT = TypeVar("ChunkT", contravariant=True)
JUDGES = ("always-A", "coin", "fair", "always-candidate", "harsh", "lenient", "reversed")
"""Simulated judges: ``always-A`` prefers the answer shown first (its two orders always disagree),
``coin`` flips a coin per order, ``fair`` errs with probability ``noise`` per order, ``always-candidate``
prefers the candidate; ``harsh`` is right on the candidate's losses and calls its gains ties (the
adversary of a draw correlated with the order), ``lenient`` its mirror, ``reversed`` always wrong."""


def draw_differences(
    rng: np.random.Generator, rows: int, cols: int, flip_rate: float, delta: float
) -> np.ndarray:
    """i.i.d. paired differences: P(D = -1) = (psi - delta) / 2, P(D = 1) = (psi + delta) / 2."""
    if abs(delta) > flip_rate + 1e-12 or not 0 <= flip_rate <= 1:
        raise ValueError(f"flip_rate={flip_rate}, delta={delta}: need |delta| <= flip rate <= 1")
    u = rng.random((rows, cols), dtype=np.float32)
    d = np.zeros((rows, cols), dtype=np.int8)
    d[u < (flip_rate - delta) / 2] = -1
    d[u >= 1 - (flip_rate + delta) / 2] = 1
    return d


def judge_votes(
    rng: np.random.Generator, d: np.ndarray, judge: str, noise: float = 0.0
) -> tuple[np.ndarray, np.ndarray]:
    """The judge's two orders for pairs whose gold differences are ``d`` (+1: prefers the candidate)."""
    shape = d.shape
    if judge == "always-A":
        # The baseline is shown first in one order and the candidate in the other.
        return -np.ones(shape, dtype=np.int8), np.ones(shape, dtype=np.int8)
    if judge == "coin":
        return tuple(np.where(rng.random(shape) < 0.5, 1, -1).astype(np.int8) for _ in range(2))  # type: ignore[return-value]
    if judge == "always-candidate":
        return np.ones(shape, dtype=np.int8), np.ones(shape, dtype=np.int8)
    if judge in ("harsh", "lenient", "reversed"):
        # harsh: right when the baseline is better (D = -1), a tie when the candidate is (D = 1); lenient:
        # the mirror; reversed: the wrong winner. Identical pairs (D = 0) are never asked.
        kept = {"harsh": d < 0, "lenient": d > 0, "reversed": d != 0}[judge]
        vote = np.where(kept, -d if judge == "reversed" else d, 0).astype(np.int8)
        return vote, vote.copy()
    if judge == "fair":
        votes = []
        for _ in range(2):
            wrong = rng.random(shape) < noise
            # A wrong verdict on a pair with a better answer names the other one; on an equal pair, either.
            other = np.where(d != 0, -d, np.where(rng.random(shape) < 0.5, 1, -1))
            votes.append(np.where(wrong, other, d).astype(np.int8))
        return votes[0], votes[1]
    raise ValueError(f"judge={judge!r}: one of {', '.join(JUDGES)}")


@dataclass
class JudgedBlock:
    """A block of judged pairs, one row per run; ``gold`` is the true D whether or not selected."""

    identical: np.ndarray
    prediction: np.ndarray
    selected: np.ndarray
    gold: np.ndarray
    votes: tuple[np.ndarray, np.ndarray]

    def pairs(self, row: int = 0) -> list[JudgedPair]:
        """One run's pairs as a judged run records them (a gold label only where the pair was drawn)."""
        return [
            JudgedPair(
                bool(self.identical[row, i]),
                float(self.prediction[row, i]),
                bool(self.selected[row, i]),
                int(self.gold[row, i]) if self.selected[row, i] else None,
            )
            for i in range(self.identical.shape[1])
        ]


def draw_judged(
    rng: np.random.Generator,
    rows: int,
    cols: int,
    differing: float,
    delta: float,
    judge: str,
    noise: float,
    rate: float,
    d: np.ndarray | None = None,
    draws: np.ndarray | None = None,
) -> JudgedBlock:
    """i.i.d. judged pairs, a share ``differing`` with a better answer (or the differences ``d``); a pair is
    drawn for gold when its ``draws`` number (else a uniform) is below ``rate``."""
    if d is None:
        d = draw_differences(rng, rows, cols, differing, delta)
    identical = d == 0
    first, second = judge_votes(rng, d, judge, noise)
    prediction = np.where(identical, 0.0, (first.astype(float) + second) / 2)
    u = rng.random(d.shape) if draws is None else draws
    selected = (u < rate) & ~identical
    return JudgedBlock(identical, prediction, selected, d, (first, second))


class CapitalAtMargin:
    """``BoundedMeanSequence``'s K+ and K- (level ``1 - 2 alpha``) for rows of values in ``[lo, hi]`` at the
    grid's neighbours of ``-margin`` only: K+ at the first grid point above it, K- at the last one below."""

    def __init__(
        self,
        rows: int,
        lo: float,
        hi: float,
        margin: float,
        alpha: float,
        horizon: int | None,
        fail_side: bool = True,
        pass_side: bool = True,
        bet: int = BET,
    ) -> None:
        self.fail_side, self.pass_side = fail_side, pass_side
        self.bets = check_bet(bet)
        self.lo, self.span = lo, hi - lo
        grid = GRID
        self.m_plus = (float(grid[grid > -margin][0]) - lo) / self.span
        self.m_minus = (float(grid[grid < -margin][-1]) - lo) / self.span
        self.horizon = horizon
        self.threshold = math.log(1.0 / alpha)  # log(2 / (2 alpha)): the 1 - 2 alpha sequence
        width = self.bets.fractions.size if horizon is None else 1
        self.plus = np.zeros((rows, width))
        self.minus = np.zeros((rows, width))
        self.t = 0
        self.sum_x = np.zeros(rows)
        self.sum_sq = np.zeros(rows)

    def keep(self, rows: np.ndarray) -> None:
        self.plus, self.minus = self.plus[rows], self.minus[rows]
        self.sum_x, self.sum_sq = self.sum_x[rows], self.sum_sq[rows]

    def step(self, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Bet on a block (rows, cols); returns whether K+ / K- has reached its threshold at each step."""
        x = np.clip((y - self.lo) / self.span, 0.0, 1.0)
        cols = x.shape[1]
        if self.horizon is None:
            up = (self.bets.fractions / self.m_plus)[None, None, :]
            down = (self.bets.fractions / (1 - self.m_minus))[None, None, :]
        else:
            steps = self.t + np.arange(1, cols + 1, dtype=float)
            mu = (PRIOR_MEAN + self.sum_x[:, None] + np.cumsum(x, axis=1)) / (steps + 1)
            sq = self.sum_sq[:, None] + np.cumsum((x - mu) ** 2, axis=1)
            before = np.concatenate([self.sum_sq[:, None], sq[:, :-1]], axis=1)
            lam = np.sqrt(2.0 * self.threshold / (self.horizon * (PRIOR_VARIANCE + before) / steps))
            up = np.minimum(lam, self.bets.truncation / self.m_plus)[:, :, None]
            down = np.minimum(lam, self.bets.truncation / (1 - self.m_minus))[:, :, None]
            self.sum_x += x.sum(axis=1)
            self.sum_sq = sq[:, -1]
        self.t += cols
        # Each side's components (rows, cols, B; one for the plug-in bet), averaged over B.
        log_plus = log_minus = np.zeros(x.shape)
        x3 = x[:, :, None]
        if self.pass_side:
            plus = self.plus[:, None, :] + np.cumsum(np.log1p(up * (x3 - self.m_plus)), axis=1)
            self.plus = plus[:, -1, :]
            log_plus = log_mean_exp(plus, axis=2)
        if self.fail_side:
            minus = self.minus[:, None, :] + np.cumsum(np.log1p(-down * (x3 - self.m_minus)), axis=1)
            self.minus = minus[:, -1, :]
            log_minus = log_mean_exp(minus, axis=2)
        return log_plus >= self.threshold, log_minus >= self.threshold


class JudgedStream:
    """Prediction-powered values of blocks of judged pairs, the PPI++ weight carried across blocks, bet on
    by ``capital``: its crossings, which a sequential run heeds only after its first gold label."""

    def __init__(self, rows: int, rate: float, capital: CapitalAtMargin) -> None:
        self.rate, self.capital = rate, capital
        self.sum_df = np.full(rows, LAM_PRIOR * LAM_PRIOR_WEIGHT)
        self.sum_ff = np.full(rows, LAM_PRIOR_WEIGHT)
        self.labelled = np.zeros(rows, dtype=np.int64)

    def keep(self, rows: np.ndarray) -> None:
        self.sum_df, self.sum_ff, self.labelled = self.sum_df[rows], self.sum_ff[rows], self.labelled[rows]
        self.capital.keep(rows)

    def crossed(self, block: JudgedBlock) -> tuple[np.ndarray, np.ndarray]:
        xi = block.selected.astype(float)
        f = block.prediction
        df = np.cumsum(xi * block.gold * f, axis=1)
        ff = np.cumsum(xi * f * f, axis=1)
        before_df = self.sum_df[:, None] + df - xi * block.gold * f
        before_ff = self.sum_ff[:, None] + ff - xi * f * f
        lam = np.clip(before_df / before_ff, 0.0, 1.0)
        y = np.where(block.identical, 0.0, lam * f + xi / self.rate * (block.gold - lam * f))
        labels = self.labelled[:, None] + np.cumsum(block.selected, axis=1)
        self.sum_df += df[:, -1]
        self.sum_ff += ff[:, -1]
        self.labelled = labels[:, -1]
        plus, minus = self.capital.step(y)
        if self.capital.horizon is not None:
            return plus, minus
        return plus & (labels >= 1), minus & (labels >= 1)


@dataclass(frozen=True)
class Outcomes:
    """Simulated runs: each run's decision ("PASS", "FAIL", "INCONCLUSIVE") and questions used."""

    decisions: np.ndarray
    stopped_at: np.ndarray

    def share(self, decision: str) -> float:
        return float(np.mean(self.decisions == decision))


class Stops:
    """Where many runs first cross: ``passed`` (the lower bound above -margin), ``failed`` (only the upper
    bound below it) and ``stopped_at`` (questions used; ``length`` for a run that never crossed)."""

    def __init__(self, rows: int, length: int) -> None:
        self.passed = np.zeros(rows, dtype=bool)
        self.failed = np.zeros(rows, dtype=bool)
        self.stopped_at = np.full(rows, length, dtype=np.int64)

    def record(self, active: np.ndarray, begin: int, up: np.ndarray, down: np.ndarray) -> np.ndarray:
        """Record the first crossing of the runs ``active`` in a block from ``begin`` (``up`` counted first
        where both hold); returns the mask of runs still undecided."""
        either = up | down
        hit = either.any(axis=1)
        rows = np.flatnonzero(hit)
        first = np.argmax(either, axis=1)[rows]
        lower = up[rows, first]
        self.passed[active[rows]] = lower
        self.failed[active[rows]] = ~lower
        self.stopped_at[active[rows]] = begin + first + 1
        return ~hit

    def outcomes(self) -> Outcomes:
        """The verdicts where the runs crossed, and their stops."""
        return Outcomes(crossing_verdicts(self.passed, self.failed), self.stopped_at)


class Kernel(Protocol[ChunkT]):
    """The capital of many runs at ``-margin``: ``crossed(chunk)`` bets on a block of the undecided runs'
    observations (rows) and says where K+ / K- reached the threshold; ``keep`` drops the decided rows."""

    def crossed(self, chunk: ChunkT, /) -> tuple[np.ndarray, np.ndarray]: ...

    def keep(self, rows: np.ndarray) -> None: ...


def first_crossings(
    rows: int,
    length: int,
    block_of: Callable[[np.ndarray, int, int], T],
    kernel: Kernel[T],
    block: int,
    begin: int = 0,
    fixed: bool = False,
    settle: float | None = None,
) -> Stops:
    """Where ``rows`` runs of ``length`` questions first cross ``-margin``, ``block_of(active, start, cols)``
    giving the undecided runs' observations from ``start`` on (drawn there, so decided runs stop drawing).
    ``fixed``: whether the bounds ever crossed, where a fixed run's running bounds end. ``settle``: stop
    once whether a share ``settle`` of the runs decide is settled; the runs left count as undecided."""
    stops = Stops(rows, length)
    active = np.arange(rows)
    for start in range(begin, length, block):
        plus, minus = kernel.crossed(block_of(active, start, min(block, length - start)))
        if fixed:
            stops.passed |= plus.any(axis=1)
            stops.failed |= minus.any(axis=1)
            continue
        keep = stops.record(active, start, plus, minus)
        if not keep.all():
            active = active[keep]
            kernel.keep(keep)
        if active.size == 0 or (settle is not None and rows - active.size >= settle * rows):
            break
    return stops


def judged_runs(
    rng: np.random.Generator,
    runs: int,
    questions: int,
    differing: float,
    delta: float,
    margin: float,
    alpha: float,
    judge: str,
    noise: float,
    rate: float,
    design: str,
    population: np.ndarray | None = None,
    block: int = 256,
    fail_side: bool = True,
    pass_side: bool = True,
    draws: np.ndarray | None = None,
    orders: np.ndarray | None = None,
    bet: int = BET,
) -> Outcomes:
    """``walk_judged`` on pairs from ``judge``: i.i.d., or a finite ``population`` of differences in each
    run's order (``orders``, else random); ``draws``: each pair's number of the gold draw. ``fail_side``
    / ``pass_side=False`` skip a side (faster; the other side's share can then only be overstated)."""
    if population is not None and orders is None:
        orders = np.argsort(rng.random((runs, population.size)), axis=1)[:, :questions]

    def block_of(active: np.ndarray, start: int, cols: int) -> JudgedBlock:
        d = None if population is None or orders is None else population[orders[active, start : start + cols]]
        u = None if draws is None else draws[active, start : start + cols]
        return draw_judged(rng, active.size, cols, differing, delta, judge, noise, rate, d, u)

    return walk_judged(
        runs, questions, block_of, margin, alpha, rate, design, block, fail_side, pass_side, bet=bet
    )


def walk_judged(
    runs: int,
    questions: int,
    block_of: Callable[[np.ndarray, int, int], JudgedBlock],
    margin: float,
    alpha: float,
    rate: float,
    design: str,
    block: int = 256,
    fail_side: bool = True,
    pass_side: bool = True,
    settle: float | None = None,
    bet: int = BET,
) -> Outcomes:
    """The rule of ``judged_decision`` on ``runs`` simulated runs of ``questions`` pairs, ``block_of(active,
    start, cols)`` giving the undecided runs' pairs from ``start`` on (``settle``: ``first_crossings``)."""
    lo, hi = value_range(rate)
    horizon = questions if design == "fixed" else None
    capital = CapitalAtMargin(runs, lo, hi, margin, alpha, horizon, fail_side, pass_side, bet)
    stream = JudgedStream(runs, rate, capital)
    stops = first_crossings(runs, questions, block_of, stream, block, fixed=design == "fixed", settle=settle)
    if design == "fixed":
        # Without a gold label a run decides nothing.
        stops.passed &= stream.labelled > 0
        stops.failed &= stream.labelled > 0
    return stops.outcomes()


class CountsAtMargin:
    """The i.i.d. sequence's K+ and K- at ``-margin`` for rows of differences: with constant bets they
    depend on the running counts (lost, tied, gained) only, continued from ``start``."""

    def __init__(self, rows: int, margin: float, alpha: float, start: tuple[int, int, int]) -> None:
        m = (1.0 - margin) / 2.0
        self.threshold = math.log(1.0 / alpha)  # the 1 - 2 alpha sequence: log(2 / (2 alpha))
        self.terms = {side: np.array(bet_terms(m, side)) for side in (1, -1)}  # (B, 3)
        self.counts = np.repeat(np.array(start, dtype=float)[:, None], rows, axis=1)

    def keep(self, rows: np.ndarray) -> None:
        self.counts = self.counts[:, rows]

    def crossed(self, chunk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        running = [self.counts[k][:, None] + np.cumsum(chunk == d, axis=1) for k, d in enumerate((-1, 0, 1))]
        self.counts = np.array([count[:, -1] for count in running])
        return self._above(running, self.terms[1]), self._above(running, self.terms[-1])

    def _above(self, running: list[np.ndarray], terms: np.ndarray) -> np.ndarray:
        """Where log K > threshold, from the running counts and the bets' log terms (B, 3)."""
        logs = [running[0] * a + running[1] * b + running[2] * c for a, b, c in terms]
        top = logs[0].copy()
        for log_b in logs[1:]:
            np.maximum(top, log_b, out=top)
        # The mean of B products lies between the largest / B and the largest: only the few entries in
        # between need the full log-mean-exp.
        hit = top - math.log(len(logs)) > self.threshold
        unsure = np.nonzero(~hit & (top > self.threshold))
        if unsure[0].size:
            near = np.stack([log_b[unsure] for log_b in logs])
            hit[unsure] = top[unsure] + np.log(np.exp(near - top[unsure]).mean(axis=0)) > self.threshold
        return hit


class PoolAtMargin(Capital):
    """The without-replacement sequence's K+ and K- at the grid's neighbours of ``-margin``, stepping one
    question at a time, with the bounds that hold for sure."""

    def __init__(self, rows: int, margin: float, alpha: float, population_size: int) -> None:
        grid = GRID
        neighbours = grid[[np.flatnonzero(grid > -margin)[0], np.flatnonzero(grid < -margin)[-1]]]
        super().__init__((neighbours + 1.0) / 2.0, rows, 2.0 * alpha, population_size)
        self.margin = margin

    def crossed(self, chunk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        self.step((chunk[:, 0] + 1.0) / 2.0)
        logical_low, logical_high = self.logical_bounds()
        passed = self.rejected_plus()[:, 0] | (logical_low > -self.margin)
        failed = self.rejected_minus()[:, 1] | (logical_high < -self.margin)
        return passed[:, None], failed[:, None]


def iid_runs(
    rng: np.random.Generator,
    runs: int,
    questions: int,
    flip_rate: float,
    delta: float,
    margin: float,
    alpha: float,
    start: tuple[int, int, int] = (0, 0, 0),
) -> Outcomes:
    """Runs of the exact-graded i.i.d. sequential rule, continuing from the counts ``start`` (lost, tied,
    gained), on which alone the i.i.d. capital depends."""

    def draw(active: np.ndarray, _begin: int, cols: int) -> np.ndarray:
        return draw_differences(rng, active.size, cols, flip_rate, delta)

    kernel = CountsAtMargin(runs, margin, alpha, start)
    return first_crossings(runs, questions, draw, kernel, block=1024, begin=sum(start)).outcomes()


def sequential_decisions(
    diffs: np.ndarray, margin: float, alpha: float = 0.025, population_size: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``sequential_decision`` for many sequences (rows): ``(decision, stopped_at)`` arrays, equal to its
    answers except after a miss that empties the set."""
    values = as_diffs(diffs, ndim=2)
    check_margin_alpha(margin, alpha)
    check_population(population_size, values.shape[1])
    rows, length = values.shape
    if population_size is None:
        kernel: Kernel[np.ndarray] = CountsAtMargin(rows, margin, alpha, (0, 0, 0))
    else:
        kernel = PoolAtMargin(rows, margin, alpha, population_size)
    block = 512 if population_size is None else 1
    stops = first_crossings(rows, length, lambda active, b, cols: values[active, b : b + cols], kernel, block)
    return stops.outcomes().decisions, stops.stopped_at
