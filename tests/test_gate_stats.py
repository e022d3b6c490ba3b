"""Statistics of the paired gate (docs/statistics.md): reference values, scipy as an oracle, simulations."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import binom, binomtest

from flyspec.gate.stats import (
    mcnemar,
    net_difference_ci,
    noninferiority,
    paired_counts,
    questions_needed,
    questions_needed_noninferiority,
)
from flyspec.gate.stats.paired import tango_statistic, wilson_interval


def test_spec_reference_values() -> None:
    """The documented reference values: Tango interval for n=21, gained=1, lost=7, and Connor sizes."""
    low, high = net_difference_ci(21, lost=7, gained=1)
    assert round(low, 4) == -0.5172
    assert round(high, 4) == -0.0260
    assert questions_needed(0.02, 0.06) == 1175
    assert questions_needed(0.01, 0.06) == 4707
    assert questions_needed(0.02, 0.08) == 1568


@pytest.mark.parametrize("lost", range(0, 26))
def test_mcnemar_exact_p_equals_scipy_binomtest(lost: int) -> None:
    """exact_p equals scipy's two-sided exact binomial test on every (lost, gained) of a 26 x 26 grid."""
    for gained in range(0, 26):
        result = mcnemar(lost, gained)
        expected = 1.0 if lost + gained == 0 else binomtest(lost, lost + gained, 0.5).pvalue
        assert result.exact_p == pytest.approx(expected, rel=1e-12, abs=1e-15)
        assert result.net == gained - lost
        assert (result.lost, result.gained) == (lost, gained)


def test_mcnemar_large_counts_match_scipy() -> None:
    """The exact test stays accurate far into the tail (thousands of flips), against scipy's binomtest."""
    for lost, gained in [(130, 70), (1200, 1000), (40, 5), (2500, 2500)]:
        assert mcnemar(lost, gained).exact_p == pytest.approx(binomtest(lost, lost + gained).pvalue, rel=1e-9)


def test_mcnemar_mid_p_definition() -> None:
    """mid-p: exact p minus the point probability of the observed minimum; 1 - P/2 when lost == gained."""
    assert mcnemar(7, 1).mid_p == pytest.approx(10 / 256)  # 2 * 9/256 - 8/256
    assert mcnemar(3, 3).mid_p == pytest.approx(1 - 20 / 64 / 2)
    for lost, gained in [(2, 9), (15, 4), (30, 31)]:
        m, k = lost + gained, min(lost, gained)
        expected = 2 * binom.cdf(k, m, 0.5) - binom.pmf(k, m, 0.5)
        assert mcnemar(lost, gained).mid_p == pytest.approx(expected)
        assert mcnemar(lost, gained).mid_p < mcnemar(lost, gained).exact_p


def test_paired_counts() -> None:
    """paired_counts counts lost (base right, cand wrong) and gained (the reverse) from 0/1 or bools."""
    assert paired_counts([1, 1, 0, 0, 1], [1, 0, 1, 0, 0]) == (5, 2, 1)
    assert paired_counts([True, False], [False, True]) == (2, 1, 1)
    with pytest.raises(ValueError, match="equal lengths"):
        paired_counts([1, 0], [1])
    with pytest.raises(ValueError, match="0/1"):
        paired_counts([2], [1])


_cached_ci = functools.lru_cache(maxsize=None)(net_difference_ci)


@pytest.mark.parametrize(
    ("n", "p_lost", "p_gained"),
    [(50, 0.10, 0.05), (200, 0.04, 0.06), (500, 0.05, 0.03), (30, 0.20, 0.10)],
)
def test_tango_interval_coverage_near_95_percent(n: int, p_lost: float, p_gained: float) -> None:
    """In a seeded simulation (3,000 paired tables) the 95% Tango interval covers the true net difference
    between 93% and 97.5% of the time, at small and moderate n."""
    rng = np.random.default_rng(20240611 + n)
    tables = rng.multinomial(n, [p_lost, p_gained, 1 - p_lost - p_gained], size=3000)
    truth = p_gained - p_lost
    covered = 0
    for lost, gained, _ in tables:
        low, high = _cached_ci(n, int(lost), int(gained))
        covered += low <= truth <= high
    assert 0.93 <= covered / len(tables) <= 0.975


@pytest.mark.parametrize(("net_loss", "flip_rate"), [(0.02, 0.06), (0.01, 0.06), (0.02, 0.08)])
def test_questions_needed_gives_the_promised_power(net_loss: float, flip_rate: float) -> None:
    """At Connor's n, the exact McNemar test at alpha 0.05 detects the loss in 80% of simulated runs,
    within a few points (the exact conditional test is slightly conservative)."""
    n = questions_needed(net_loss, flip_rate)
    rng = np.random.default_rng(7)
    p_lost, p_gained = (flip_rate + net_loss) / 2, (flip_rate - net_loss) / 2
    tables = rng.multinomial(n, [p_lost, p_gained, 1 - flip_rate], size=6000)
    lost, gained = tables[:, 0], tables[:, 1]
    p = np.minimum(1.0, 2 * binom.cdf(np.minimum(lost, gained), lost + gained, 0.5))
    p[lost == gained] = 1.0
    power = float(np.mean(p < 0.05))
    assert abs(power - 0.80) < 0.04, power


@pytest.mark.parametrize(("margin", "flip_rate", "true_diff"), [(0.02, 0.06, 0.0), (0.03, 0.10, -0.005)])
def test_questions_needed_noninferiority_gives_the_promised_power(
    margin: float, flip_rate: float, true_diff: float
) -> None:
    """At the planned n, the score test declares non-inferiority in 80% of simulated runs (within a few
    points) when the true difference is ``true_diff``."""
    n = questions_needed_noninferiority(margin, flip_rate, true_diff)
    rng = np.random.default_rng(11)
    p_lost, p_gained = (flip_rate - true_diff) / 2, (flip_rate + true_diff) / 2
    tables = rng.multinomial(n, [p_lost, p_gained, 1 - flip_rate], size=3000)
    passed = np.mean([noninferiority(n, int(a), int(b), margin).non_inferior for a, b, _ in tables])
    assert abs(passed - 0.80) < 0.04, (n, passed)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 400).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n))), st.data())
def test_interval_and_noninferiority_agree(n_lost: tuple[int, int], data: st.DataObject) -> None:
    """The score test is the interval inverted: non-inferior at alpha iff the (1 - 2 alpha) lower bound
    exceeds -margin; the interval lies in [-1, 1] and contains the point estimate."""
    n, lost = n_lost
    gained = data.draw(st.integers(0, n - lost))
    margin = data.draw(st.floats(0.005, 0.5))
    low, high = net_difference_ci(n, lost, gained, level=0.95)
    estimate = (gained - lost) / n
    assert -1.0 <= low <= estimate + 1e-9 <= high + 2e-9 <= 1.0 + 2e-9
    if abs(low + margin) > 1e-6:  # away from the boundary, where root-finding tolerance could decide
        assert noninferiority(n, lost, gained, margin).non_inferior == (low > -margin)


def test_tango_statistic_is_zero_at_the_estimate_and_decreasing() -> None:
    """T(delta0) vanishes at the observed net difference and decreases in delta0 (so the interval is one
    connected set found by two root searches)."""
    n, lost, gained = 120, 14, 6
    assert tango_statistic(n, lost, gained, (gained - lost) / n) == pytest.approx(0.0, abs=1e-12)
    grid = np.linspace(-0.99, 0.99, 199)
    values = [tango_statistic(n, lost, gained, float(d)) for d in grid]
    assert all(a > b for a, b in zip(values, values[1:], strict=False))


def test_other_interval_methods() -> None:
    """Wald matches its closed form; Newcombe's conditional interval contains the estimate; both stay in
    [-1, 1]; an unknown method is an error naming the choices."""
    n, lost, gained = 100, 12, 5
    delta, psi = -7 / 100, 17 / 100
    half = 1.959963984540054 * math.sqrt((psi - delta**2) / n)
    assert net_difference_ci(n, lost, gained, method="wald") == pytest.approx((delta - half, delta + half))
    low, high = net_difference_ci(n, lost, gained, method="newcombe")
    assert -psi <= low < delta < high <= psi
    with pytest.raises(ValueError, match="tango, newcombe, wald"):
        net_difference_ci(n, lost, gained, method="exact")


def test_bad_inputs_are_named() -> None:
    """Margins outside (0, 1), impossible tables and bad levels raise ValueError naming the field."""
    for margin in (0.0, 1.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="margin"):
            noninferiority(100, 3, 4, margin)
    with pytest.raises(ValueError, match="exceeds n"):
        net_difference_ci(10, 8, 5)
    with pytest.raises(ValueError, match="level"):
        net_difference_ci(10, 1, 1, level=1.0)
    with pytest.raises(ValueError, match="net_loss"):
        questions_needed(0.0, 0.06)
    with pytest.raises(ValueError, match="true_diff"):
        questions_needed_noninferiority(0.02, 0.06, true_diff=-0.03)
    with pytest.raises(ValueError, match="lost"):
        mcnemar(-1, 3)


def test_wilson_interval_matches_scipy() -> None:
    """The pilot's flip-rate interval equals scipy's Wilson interval."""
    for k, n in [(0, 50), (6, 100), (50, 50), (17, 230)]:
        expected = binomtest(k, n).proportion_ci(0.95, method="wilson")
        assert wilson_interval(k, n) == pytest.approx((expected.low, expected.high), abs=1e-12)
