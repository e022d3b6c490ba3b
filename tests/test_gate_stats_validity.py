"""Seeded simulations proving the gate's error rates (docs/statistics.md), each beside a naive procedure
that the same simulation shows to be wrong, so the test could fail.

Monte-Carlo error: with R runs an estimated rate p has standard error sqrt(p (1 - p) / R); at alpha =
0.025 and R = 2,000 that is 0.0035, and the bounds below allow 2.5 of them. Each test prints the rates it
measured (``pytest -s``); docs/statistics.md quotes them.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
from scipy.stats import binom, norm

from flyspec.gate.stats import decide, questions_needed_noninferiority
from flyspec.gate.stats.decide import fixed_sequence
from flyspec.gate.stats.paired import tango_statistic
from flyspec.gate.stats.simulation import sequential_decisions
from flyspec.gate.stats.sizing import plan_noninferiority

ALPHA = 0.025
MARGIN = 0.02


def _mc_bound(rate: float, runs: int) -> float:
    return rate + 2.5 * math.sqrt(rate * (1 - rate) / runs)


def _differences(rng: np.random.Generator, runs: int, length: int, psi: float, delta: float) -> np.ndarray:
    u = rng.random((runs, length))
    d = np.zeros((runs, length), dtype=np.int8)
    d[u < (psi - delta) / 2] = -1
    d[u >= 1 - (psi + delta) / 2] = 1
    return d


def _tango(n: np.ndarray, lost: np.ndarray, gained: np.ndarray, delta0: float) -> np.ndarray:
    """Tango's score statistic, vectorised (the closed form of docs/statistics.md)."""
    a = 2.0 * n
    b = -gained - lost + (2.0 * n - gained + lost) * delta0
    c = -lost * delta0 * (1.0 - delta0)
    p_lost = (np.sqrt(np.maximum(b * b - 4 * a * c, 0.0)) - b) / (2 * a)
    return (gained - lost - n * delta0) / np.sqrt(n * (2 * p_lost + delta0 * (1 - delta0)))


def _running_tango(d: np.ndarray, delta0: float) -> np.ndarray:
    n = np.arange(1, d.shape[1] + 1, dtype=float)
    return _tango(n, np.cumsum(d == -1, axis=1, dtype=float), np.cumsum(d == 1, axis=1, dtype=float), delta0)


def test_vectorised_tango_equals_the_library() -> None:
    """The simulations' vectorised statistic is the library's tango_statistic."""
    n, lost, gained = (
        np.array([50.0, 400.0, 1000.0]),
        np.array([7.0, 30.0, 41.0]),
        np.array([1.0, 22.0, 40.0]),
    )
    expected = [
        tango_statistic(int(a), int(b), int(c), -MARGIN) for a, b, c in zip(n, lost, gained, strict=True)
    ]
    assert _tango(n, lost, gained, -MARGIN) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("psi", [0.05, 0.2, 0.4])
def test_continuous_monitoring_keeps_alpha_at_the_null_boundary(psi: float) -> None:
    """delta = -margin, a look after every question up to 2,000: the sequential test PASSes (a false claim
    of non-inferiority) in at most alpha of 2,000 runs, and FAILs (a false claim of a loss beyond the
    margin) as rarely. Re-running the fixed Tango test after every question and stopping at its first PASS
    does not: it PASSes in more than 10% of the same runs, though each single look is about right (the
    last look alone PASSes in 2-3.5%: Tango's test is a large-sample test)."""
    runs, length = 2000, 2000
    d = _differences(np.random.default_rng(int(psi * 1000)), runs, length, psi, -MARGIN)
    decisions, _ = sequential_decisions(d, MARGIN, ALPHA)
    passes = _running_tango(d, -MARGIN) > norm.ppf(1 - ALPHA)
    print(
        f"\npsi {psi}: sequential PASS {np.mean(decisions == 'PASS'):.4f}, "
        f"FAIL {np.mean(decisions == 'FAIL'):.4f}; Tango after every question PASS "
        f"{np.mean(passes.any(axis=1)):.4f}, at the last look alone {np.mean(passes[:, -1]):.4f}"
    )
    assert np.mean(decisions == "PASS") <= _mc_bound(ALPHA, runs)
    assert np.mean(decisions == "FAIL") <= _mc_bound(ALPHA, runs)
    assert np.mean(passes[:, -1]) <= 2 * ALPHA  # one look is a (large-sample) level-alpha test
    assert np.mean(passes.any(axis=1)) > 0.10


@pytest.mark.parametrize(("psi", "delta"), [(0.2, -0.05), (0.5, -0.3)])
def test_time_uniform_coverage(psi: float, delta: float) -> None:
    """The 95% sequence misses the true delta at some n <= 2,000 in at most 5% of 2,000 i.i.d. runs
    (a miss is a crossing of either bound past the truth, which is what sequential_decisions detects
    with margin = -delta). The 95% Tango interval recomputed after each question misses it in far more."""
    runs, length = 2000, 2000
    d = _differences(np.random.default_rng(7), runs, length, psi, delta)
    decisions, _ = sequential_decisions(d, -delta, ALPHA)
    outside = np.abs(_running_tango(d, delta)) > norm.ppf(1 - ALPHA)
    print(
        f"\npsi {psi} delta {delta}: sequence misses {np.mean(decisions != 'INCONCLUSIVE'):.4f}, "
        f"re-computed Tango interval misses {np.mean(outside.any(axis=1)):.4f}"
    )
    assert np.mean(decisions != "INCONCLUSIVE") <= _mc_bound(2 * ALPHA, runs)
    assert np.mean(outside.any(axis=1)) > 0.2


def test_time_uniform_coverage_without_replacement() -> None:
    """A finite set of 1,000 questions (130 lost, 70 gained: mean -0.06) visited in 1,000 random orders:
    the without-replacement 95% sequence misses the set's mean at some n in at most 5% of orders, and so
    does the default (i.i.d.) sequence on the same orders."""
    population = np.array([-1] * 130 + [1] * 70 + [0] * 800, dtype=np.int8)
    rng = np.random.default_rng(11)
    orders = np.stack([rng.permutation(population) for _ in range(1000)])
    for size in (len(population), None):
        decisions, _ = sequential_decisions(orders, 0.06, ALPHA, population_size=size)
        print(f"\npopulation_size {size}: miss {np.mean(decisions != 'INCONCLUSIVE'):.4f}")
        assert np.mean(decisions != "INCONCLUSIVE") <= _mc_bound(2 * ALPHA, len(orders))


def test_sequential_test_reaches_decisions() -> None:
    """Validity is not bought by never deciding: with no loss (6% flips) it PASSes within 4,000 questions
    in 95% of runs, and a 10-point loss FAILs within 1,000 in all of them."""
    rng = np.random.default_rng(3)
    decisions, _ = sequential_decisions(_differences(rng, 500, 4000, 0.06, 0.0), MARGIN, ALPHA)
    assert np.mean(decisions == "PASS") >= 0.95
    decisions, _ = sequential_decisions(_differences(rng, 500, 1000, 0.2, -0.10), MARGIN, ALPHA)
    assert np.all(decisions == "FAIL")


@functools.cache
def _decision(n: int, lost: int, gained: int) -> str:
    return decide(n, lost, gained, MARGIN, ALPHA).decision


def _old_rule(n: int, lost: int, gained: int) -> str:
    """The former report's rule: PASS on the interval, else FAIL also when McNemar shows a loss."""
    interval = decide(n, lost, gained, MARGIN, ALPHA)
    low, high = interval.low, interval.high
    m, k = lost + gained, min(lost, gained)
    p = 1.0 if lost == gained else min(1.0, 2 * float(binom.cdf(k, m, 0.5)))
    if low > -MARGIN:
        return "PASS"
    return "FAIL" if high < -MARGIN or (lost > gained and p < 2 * ALPHA) else "INCONCLUSIVE"


@pytest.mark.parametrize("n", [1000, 4000])
def test_a_loss_within_the_margin_is_not_a_fail(n: int) -> None:
    """A true 1-point loss with a 2-point margin and 6% flips is acceptable, so FAIL is an error. The old
    rule (FAIL when McNemar is significant) says FAIL in more than 15% of 2,000 runs; decide() says it in
    at most alpha."""
    rng = np.random.default_rng(n)
    psi, delta = 0.06, -0.01
    tables = rng.multinomial(n, [(psi - delta) / 2, (psi + delta) / 2, 1 - psi], size=2000)
    old = [_old_rule(n, int(a), int(b)) for a, b, _ in tables]
    new = [_decision(n, int(a), int(b)) for a, b, _ in tables]
    print(
        f"\nn {n}: old rule FAIL {old.count('FAIL') / len(tables):.4f}, "
        f"decide FAIL {new.count('FAIL') / len(tables):.4f}"
    )
    assert old.count("FAIL") / len(tables) > 0.15
    assert new.count("FAIL") / len(tables) <= _mc_bound(ALPHA, len(tables))


def test_planning_from_the_upper_bound_is_rarely_too_small() -> None:
    """Pilots of 100 questions at a true 6% flip rate: a plan from the observed rate is smaller than the
    true rate's plan in about half of 4,000 pilots (and meaningless with zero flips); a plan from the 95%
    upper bound is too small in at most 5%."""
    needed = questions_needed_noninferiority(MARGIN, 0.06)
    flips = np.random.default_rng(5).binomial(100, 0.06, size=4000)
    plans = {k: plan_noninferiority(int(k), 100, MARGIN) for k in np.unique(flips)}
    short_upper = np.mean([plans[k].questions < needed for k in flips])
    short_observed = np.mean([(plans[k].questions_at_observed or 0) < needed for k in flips])
    print(
        f"\nplan too small: from the upper bound {short_upper:.4f}, "
        f"from the observed rate {short_observed:.4f}"
    )
    assert short_upper <= _mc_bound(0.05, len(flips))
    assert short_observed > 0.3


def _tune_tables(rng: np.random.Generator, runs: int, n: int, deltas: list[float], psi: float) -> np.ndarray:
    """(runs, settings, 2) lost and gained counts; every setting shares one baseline per run."""
    base_right = rng.binomial(n, 0.7, size=runs)
    out = np.empty((runs, len(deltas), 2), dtype=int)
    for j, delta in enumerate(deltas):
        out[:, j, 0] = rng.binomial(base_right, (psi - delta) / 2 / 0.7)
        out[:, j, 1] = rng.binomial(n - base_right, (psi + delta) / 2 / 0.3)
    return out


def test_fixed_sequence_controls_choosing_a_harmful_setting() -> None:
    """Eight settings, least aggressive first: two with no loss, then six exactly at the margin (not
    non-inferior). Testing in the fixed sequence picks one of the six in at most alpha of 2,000 runs and
    still picks a good one in most runs; testing every setting at alpha and taking the most aggressive
    that passed picks a harmful one in more than 6% of the same runs."""
    deltas = [0.0, 0.0] + [-MARGIN] * 6
    harmful = [d <= -MARGIN for d in deltas]
    n = 2000
    tables = _tune_tables(np.random.default_rng(16), 2000, n, deltas, psi=0.06)
    chosen_fixed, chosen_naive = [], []
    for run in tables:
        decisions = [_decision(n, int(lost), int(gained)) for lost, gained in run]
        chosen_fixed.append(fixed_sequence(decisions).chosen)
        passed = [j for j, dec in enumerate(decisions) if dec == "PASS"]
        chosen_naive.append(passed[-1] if passed else None)
    bad_fixed = np.mean([c is not None and harmful[c] for c in chosen_fixed])
    bad_naive = np.mean([c is not None and harmful[c] for c in chosen_naive])
    good = np.mean([c is not None for c in chosen_fixed])
    print(
        f"\nharmful choice: fixed sequence {bad_fixed:.4f}, naive {bad_naive:.4f}; "
        f"a good one chosen {good:.4f}"
    )
    assert bad_fixed <= _mc_bound(ALPHA, len(tables))
    assert good > 0.8
    assert bad_naive > 0.06
