"""The betting confidence sequence and the sequential decision: behaviour and an independent reference.

The simulations that prove validity are in tests/test_gate_stats_validity.py; the method is in
docs/statistics.md.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from flyspec.gate.stats import confidence_sequence, sequential_decision
from flyspec.gate.stats.sequence import BETS, GRID_STEPS, ConfidenceSequence
from flyspec.gate.stats.simulation import sequential_decisions


def _draw(seed: int, p_lost: float, p_gained: float, size: int | tuple[int, int]) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.choice([-1, 0, 1], p=[p_lost, 1 - p_lost - p_gained, p_gained], size=size)


@pytest.mark.parametrize("population", [None, 700])
def test_bounds_are_nested_and_contain_the_running_mean(population: int | None) -> None:
    """One bound pair per observation, in [-1, 1], never widening, shrinking with data, and (on this
    seeded sequence, where the truth is 0) containing the running mean throughout."""
    diffs = _draw(1, 0.1, 0.1, 600).tolist()
    low, high = confidence_sequence(diffs, population_size=population)
    assert len(low) == len(high) == len(diffs)
    assert all(-1 <= a <= b <= 1 for a, b in zip(low, high, strict=True))
    assert all(a <= b for a, b in zip(low, low[1:], strict=False))
    assert all(a >= b for a, b in zip(high, high[1:], strict=False))
    means = np.cumsum(diffs) / np.arange(1, len(diffs) + 1)
    assert all(a <= m <= b for a, m, b in zip(low, means, high, strict=True))
    assert high[-1] - low[-1] < 0.2  # it does shrink


def test_online_object_matches_function() -> None:
    """ConfidenceSequence.update returns exactly what confidence_sequence returns at each step."""
    diffs = [0, -1, 0, 0, 1, -1, -1, 0, 0, 0] * 30
    low, high = confidence_sequence(diffs, alpha=0.1)
    online = ConfidenceSequence(alpha=0.1)
    assert [online.update(d) for d in diffs] == list(zip(low, high, strict=True))
    assert (online.n, online.low, online.high) == (300, low[-1], high[-1])


def test_sequential_decision_stops_at_the_first_crossing() -> None:
    """A large loss FAILs at the first n whose 1 - 2 alpha upper bound is below -margin, reporting the
    bounds there; the decision walks confidence_sequence(diffs, 2 alpha) exactly."""
    diffs = ([-1] * 3 + [0] * 7) * 30
    result = sequential_decision(diffs, margin=0.02)
    low, high = confidence_sequence(diffs, alpha=0.05)
    first = next(i for i, h in enumerate(high) if h < -0.02)
    assert (result.decision, result.stopped_at) == ("FAIL", first + 1)
    assert (result.low, result.high) == (low[first], high[first])
    assert result.loss_detected


def test_sequential_decision_passes_and_walks_the_sequence() -> None:
    """With no loss the decision is PASS at the first n with low_n > -margin."""
    diffs = _draw(3, 0.02, 0.02, 3000).tolist()
    result = sequential_decision(diffs, margin=0.05)
    low, _ = confidence_sequence(diffs, alpha=0.05)
    first = next(i for i, v in enumerate(low) if v > -0.05)
    assert (result.decision, result.stopped_at, result.low) == ("PASS", first + 1, low[first])


def test_sequential_decision_inconclusive_uses_everything() -> None:
    """No crossing: INCONCLUSIVE at len(diffs) with the final bounds, no loss shown."""
    diffs = [0, 1, -1, 0] * 10
    result = sequential_decision(diffs, margin=0.02)
    low, high = confidence_sequence(diffs, alpha=0.05)
    assert (result.decision, result.stopped_at, result.low, result.high) == (
        "INCONCLUSIVE",
        40,
        low[-1],
        high[-1],
    )
    assert not result.loss_detected


@pytest.mark.parametrize("population", [None, 500])
def test_batch_equals_single(population: int | None) -> None:
    """sequential_decisions on a matrix gives, row by row, sequential_decision's decision and stop."""
    rows = np.concatenate([_draw(5, 0.25, 0.05, (8, 500)), _draw(6, 0.03, 0.03, (8, 500))])
    decisions, stops = sequential_decisions(rows, margin=0.02, population_size=population)
    for i, row in enumerate(rows):
        single = sequential_decision(row.tolist(), margin=0.02, population_size=population)
        assert (single.decision, single.stopped_at) == (decisions[i], stops[i])
    assert set(decisions) >= {"PASS", "FAIL"}


def test_without_replacement_closes_on_the_mean() -> None:
    """With population_size = N, the interval after all N questions is the set's exact mean."""
    diffs = _draw(2, 0.2, 0.1, 300).tolist()
    low, high = confidence_sequence(diffs, population_size=300)
    assert low[-1] == pytest.approx(np.mean(diffs)) and high[-1] == pytest.approx(np.mean(diffs))


def test_bad_inputs_are_named() -> None:
    """A difference outside {-1, 0, 1}, a bad alpha or margin, or too many draws raise ValueError."""
    with pytest.raises(ValueError, match="diffs contains 2"):
        confidence_sequence([0, 2])
    with pytest.raises(ValueError, match="alpha"):
        confidence_sequence([0], alpha=1.5)
    with pytest.raises(ValueError, match="alpha"):
        sequential_decision([0], margin=0.02, alpha=0.5)
    with pytest.raises(ValueError, match="margin"):
        sequential_decision([0], margin=0.0)
    with pytest.raises(ValueError, match="population_size"):
        confidence_sequence([0, 0, 0], population_size=2)
    with pytest.raises(ValueError, match="d="):
        ConfidenceSequence().update(3)
    with pytest.raises(ValueError, match="2-D"):
        sequential_decisions(np.zeros(3, dtype=int), margin=0.02)


# --- An independent reference: the capital processes in log space, bounds by bisection -----------------


def _log_capitals(x: np.ndarray, m: float, population: int | None) -> tuple[np.ndarray, np.ndarray]:
    """log K+_s(m) and log K-_s(m) for s = 1..len(x), straight from the formulas in docs/statistics.md."""
    if population is None:
        centre = np.full(len(x), m)
    else:
        seen = np.concatenate([[0.0], np.cumsum(x)[:-1]])
        centre = (population * m - seen) / (population - np.arange(len(x)))
    with np.errstate(divide="ignore"):
        bet_plus = np.minimum(BETS[None, :], 0.5 / centre[:, None])
        bet_minus = np.minimum(BETS[None, :], 0.5 / (1 - centre[:, None]))
    log_plus = np.cumsum(np.log1p(bet_plus * (x - centre)[:, None]), axis=0)
    log_minus = np.cumsum(np.log1p(-bet_minus * (x - centre)[:, None]), axis=0)
    return _log_mean_exp(log_plus), _log_mean_exp(log_minus)


def _log_mean_exp(values: np.ndarray) -> np.ndarray:
    top = values.max(axis=1)
    return top + np.log(np.exp(values - top[:, None]).mean(axis=1))


def _edge(rejected, rejected_end: float, live_end: float) -> float:
    """The edge of a monotone predicate between two ends, by bisection, on the rejected side."""
    if not rejected(rejected_end):
        return rejected_end
    if rejected(live_end):
        return live_end
    inside, outside = live_end, rejected_end
    for _ in range(56):  # to within a few units in the last place
        mid = (inside + outside) / 2
        inside, outside = (inside, mid) if rejected(mid) else (mid, outside)
    return outside


def _reference(diffs: list[int], alpha: float, population: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Exact running-intersection bounds: a mean is out once max_{s<=t} log K_s(m) >= log(2 / alpha)."""
    x = (np.asarray(diffs, dtype=float) + 1) / 2
    threshold = math.log(2 / alpha)
    lows, highs = [], []
    for t in range(1, len(x) + 1):
        head = x[:t]
        floor, ceiling = 0.0, 1.0
        if population is not None:  # what the unseen questions can still contribute
            floor, ceiling = head.sum() / population, (head.sum() + population - t) / population

        def below(m: float, head: np.ndarray = head) -> bool:
            return bool(_log_capitals(head, m, population)[0].max() >= threshold)

        def above(m: float, head: np.ndarray = head) -> bool:
            return bool(_log_capitals(head, m, population)[1].max() >= threshold)

        lows.append(2 * _edge(below, floor, ceiling) - 1)
        highs.append(2 * _edge(above, ceiling, floor) - 1)
    return np.array(lows), np.array(highs)


@pytest.mark.parametrize(
    ("seed", "p_lost", "p_gained", "population"),
    [(1, 0.1, 0.1, None), (2, 0.25, 0.05, None), (4, 0.2, 0.1, 90), (5, 0.3, 0.0, 80)],
)
def test_bounds_match_an_independent_reference(seed: int, p_lost: float, p_gained: float, population) -> None:
    """Against a plain log-space computation with bisection, the i.i.d. bounds are the exact roots (to
    1e-11) and the without-replacement grid bounds lie outside the exact ones by less than one grid step
    (0.0005): neither the closed form, nor the renormalised products, nor the shrinking grid cut the set."""
    diffs = _draw(seed, p_lost, p_gained, population or 90).tolist()
    low, high = (np.array(v) for v in confidence_sequence(diffs, alpha=0.1, population_size=population))
    ref_low, ref_high = _reference(diffs, 0.1, population)
    slack = 2 / GRID_STEPS if population else 1e-11
    assert np.all(low <= ref_low + 1e-12) and np.all(ref_low - low < slack)
    assert np.all(high >= ref_high - 1e-12) and np.all(high - ref_high < slack)
    assert ref_high[-1] - ref_low[-1] < 1.5  # not a comparison of trivial [-1, 1] intervals


def test_hand_computed_crossing() -> None:
    """Thirty losses in a row: delta = 0 (m = 1/2) leaves the 95% sequence at the first t where K-(1/2) =
    (1/8) sum_b (1 + min(2^-b, 1) / 2)^t reaches 2 / 0.05 = 40, which is t = 14 (1.5^14 / 8 = 36.5 and
    the smaller bets add the rest)."""
    capital = [sum((1 + min(2.0**-b, 1.0) / 2) ** t for b in range(8)) / 8 for t in range(1, 31)]
    crossing = next(t for t, k in enumerate(capital, start=1) if k >= 40)
    assert crossing == 14
    _, high = confidence_sequence([-1] * 30, alpha=0.05)
    assert [h <= 0 for h in high] == [t >= crossing for t in range(1, 31)]
