"""The decision rule on fixed-size runs, sample-size planning, and fixed-sequence testing
(docs/statistics.md).

The simulations behind these rules are in tests/test_gate_stats_validity.py.
"""

from __future__ import annotations

import dataclasses

import pytest
from scipy.stats import binom

from flyspec.gate.stats import (
    confidence_sequence,
    decide,
    decide_with_undecided,
    fixed_sequence,
    flip_rate_upper_bound,
    mcnemar,
    net_difference_ci,
    plan_noninferiority,
    questions_needed_noninferiority,
    sequential_decision,
    sequential_decision_with_undecided,
)


def test_decide_fields_and_interval() -> None:
    """decide returns a frozen dataclass with exactly decision, loss_detected, low, high; the bounds are
    Tango's 1 - 2 alpha interval."""
    result = decide(58, 14, 1, 0.02)
    assert [f.name for f in dataclasses.fields(result)] == ["decision", "loss_detected", "low", "high"]
    assert (result.low, result.high) == net_difference_ci(58, 14, 1, level=0.95)
    assert (decide(58, 14, 1, 0.02, alpha=0.05).low, decide(58, 14, 1, 0.02, alpha=0.05).high) == (
        net_difference_ci(58, 14, 1, level=0.90)
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.decision = "PASS"  # type: ignore[misc]


def test_decide_outcomes() -> None:
    """PASS above -margin, FAIL below it, INCONCLUSIVE between; loss_detected means high < 0."""
    clear = decide(1000, 20, 20, 0.02)
    assert (clear.decision, clear.loss_detected) == ("PASS", False)
    fail = decide(58, 14, 1, 0.02)
    assert (fail.decision, fail.loss_detected) == ("FAIL", True)
    assert (decide(1000, 30, 20, 0.02).decision, decide(1000, 30, 20, 0.02).loss_detected) == (
        "INCONCLUSIVE",
        False,
    )


def test_a_significant_loss_is_reported_beside_the_decision() -> None:
    """A loss McNemar calls highly significant (p = 0.001) is INCONCLUSIVE with loss_detected when the
    interval straddles the margin, and PASS (still loss_detected) when it lies above it: never FAIL."""
    assert mcnemar(40, 15).exact_p < 0.002
    straddles = decide(1000, 40, 15, 0.03)
    assert (straddles.decision, straddles.loss_detected) == ("INCONCLUSIVE", True)
    assert straddles.low < -0.03 < straddles.high < 0
    within = decide(1000, 45, 15, 0.05)
    assert (within.decision, within.loss_detected) == ("PASS", True)


def test_decide_bad_inputs() -> None:
    """A bad margin, alpha or table raises ValueError naming the field."""
    with pytest.raises(ValueError, match="margin"):
        decide(100, 3, 4, 0.0)
    with pytest.raises(ValueError, match="alpha"):
        decide(100, 3, 4, 0.02, alpha=0.5)
    with pytest.raises(ValueError, match="exceeds n"):
        decide(10, 8, 5, 0.02)


@pytest.mark.parametrize(("flips", "n"), [(0, 50), (1, 50), (6, 100), (17, 230), (49, 50)])
def test_flip_rate_upper_bound_is_clopper_pearson(flips: int, n: int) -> None:
    """The bound u solves P[Binomial(n, u) <= flips] = 1 - level (the exact Clopper-Pearson definition)."""
    upper = flip_rate_upper_bound(flips, n)
    assert binom.cdf(flips, n, upper) == pytest.approx(0.05, abs=1e-9)


def test_zero_flips_do_not_mean_a_zero_rate() -> None:
    """No flips in 50: the 95% bound is 1 - 0.05^(1/50) = 5.8%, and the plan uses it, offering no plan at
    the observed rate; all flips: bound 1."""
    assert flip_rate_upper_bound(0, 50) == pytest.approx(1 - 0.05 ** (1 / 50))
    assert flip_rate_upper_bound(50, 50) == 1.0
    plan = plan_noninferiority(0, 50, 0.02)
    assert plan.flip_rate == 0.0 and plan.questions_at_observed is None
    assert plan.questions == questions_needed_noninferiority(0.02, plan.flip_rate_upper)
    with pytest.raises(ValueError, match="flips"):
        flip_rate_upper_bound(51, 50)


def test_plan_from_a_pilot_with_flips() -> None:
    """With flips seen, both plans are given and the upper-bound plan is the larger."""
    plan = plan_noninferiority(6, 100, 0.02)
    assert plan.questions_at_observed == questions_needed_noninferiority(0.02, 0.06)
    assert plan.questions > plan.questions_at_observed
    shifted = plan_noninferiority(6, 100, 0.02, true_diff=-0.005)
    assert shifted.questions == questions_needed_noninferiority(0.02, shifted.flip_rate_upper, -0.005)


def test_fixed_sequence_labels() -> None:
    """The chosen index is the last PASS before the first non-PASS; later settings are NOT TESTED, even
    ones that would have passed; nothing passes when the first does not."""
    assert fixed_sequence(["PASS", "PASS", "INCONCLUSIVE", "PASS"]) == (
        1,
        ["PASS", "PASS", "INCONCLUSIVE", "NOT TESTED"],
    )
    assert fixed_sequence(["FAIL", None]) == (None, ["FAIL", "NOT TESTED"])
    assert fixed_sequence(["PASS", "PASS"]) == (1, ["PASS", "PASS"])
    assert fixed_sequence([]) == (None, [])
    with pytest.raises(ValueError, match=r"decisions\[0\]"):
        fixed_sequence([None, "PASS"])
    with pytest.raises(ValueError, match=r"decisions\[1\]"):
        fixed_sequence(["PASS", "maybe"])


def test_undecided_pairs_count_against_each_claim() -> None:
    """decide_with_undecided: the lower bound is Tango's on (n, lost + undecided, gained), the upper on
    (n, lost, gained + undecided); without undecided pairs it is decide. 100 pairs with 10 lost, 10 gained
    PASS at 15 points; 40 more undecided pairs of 140 make the PASS test count 50 lost and the FAIL test
    50 gained, so it is INCONCLUSIVE; a large clear loss still FAILs. Bad counts are refused."""
    assert decide_with_undecided(100, 10, 10, 0, 0.15) == decide(100, 10, 10, 0.15)
    assert decide(100, 10, 10, 0.15).decision == "PASS"
    mixed = decide_with_undecided(140, 10, 10, 40, 0.15)
    assert mixed.decision == "INCONCLUSIVE"
    assert mixed.low == net_difference_ci(140, 50, 10, level=0.95)[0]
    assert mixed.high == net_difference_ci(140, 10, 50, level=0.95)[1]
    assert decide_with_undecided(1000, 300, 10, 20, 0.05).decision == "FAIL"
    with pytest.raises(ValueError, match="undecided=-1"):
        decide_with_undecided(10, 1, 1, -1, 0.1)
    with pytest.raises(ValueError, match="exceeds n=10"):
        decide_with_undecided(10, 4, 4, 3, 0.1)


def test_sequential_undecided_pairs_walk_two_sequences() -> None:
    """sequential_decision_with_undecided: without undecided pairs it is sequential_decision; with them
    its bounds at the stop are the lower bound of the sequence with undecided pairs as -1 and the upper
    bound of the one with them as +1, and the stop is the first crossing of either."""
    diffs = [0, 1, -1, 0, 0] * 200
    assert sequential_decision_with_undecided(diffs, [False] * 1000, 0.2) == sequential_decision(diffs, 0.2)
    undecided = [i % 10 == 0 for i in range(1000)]
    agreed = [0 if u else d for d, u in zip(diffs, undecided, strict=True)]
    walk = sequential_decision_with_undecided(agreed, undecided, 0.2)
    lows = confidence_sequence([-1 if u else d for d, u in zip(agreed, undecided, strict=True)], 0.05)[0]
    highs = confidence_sequence([1 if u else d for d, u in zip(agreed, undecided, strict=True)], 0.05)[1]
    first = next(i for i, low in enumerate(lows) if low > -0.2)
    assert all(high >= -0.2 for high in highs[: first + 1])
    assert (walk.decision, walk.stopped_at, walk.low, walk.high) == (
        "PASS",
        first + 1,
        lows[first],
        highs[first],
    )
    with pytest.raises(ValueError, match="must be 0"):
        sequential_decision_with_undecided([1], [True], 0.2)
    with pytest.raises(ValueError, match="1 entries for 2"):
        sequential_decision_with_undecided([0, 0], [False], 0.2)
