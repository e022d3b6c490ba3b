"""The decision rule on fixed-size runs, sample-size planning, and fixed-sequence testing (docs/gate.md)."""

from __future__ import annotations

import pytest

from flyspec.gate.stats import (
    decide,
    fixed_sequence,
    flip_rate_upper_bound,
    net_difference_ci,
    plan_noninferiority,
    questions_needed_noninferiority,
)


def test_decide_outcomes() -> None:
    """PASS above -margin, FAIL below it, INCONCLUSIVE between, loss_detected when high < 0; the bounds
    are Tango's 1 - 2 alpha interval."""
    assert decide(1000, 20, 20, 0.02).decision == "PASS"
    fail = decide(58, 14, 1, 0.02)
    assert fail.decision == "FAIL" and fail.loss_detected
    assert (fail.low, fail.high) == net_difference_ci(58, 14, 1, level=0.95)
    # A significant loss (exact McNemar p < 0.05) that is not shown to exceed the margin.
    loss = decide(1000, 40, 15, 0.03)
    assert loss.decision == "INCONCLUSIVE" and loss.loss_detected
    assert decide(1000, 30, 20, 0.02).loss_detected is False


def test_flip_rate_upper_bound_zero_flips() -> None:
    """With no flips the exact 95% upper bound is 1 - 0.05^(1/n) (about 3/n), not zero."""
    assert flip_rate_upper_bound(0, 50) == pytest.approx(1 - 0.05 ** (1 / 50))
    assert flip_rate_upper_bound(50, 50) == 1.0
    plan = plan_noninferiority(0, 50, 0.02)
    assert plan.questions_at_observed is None
    assert plan.questions == questions_needed_noninferiority(0.02, plan.flip_rate_upper)


def test_fixed_sequence_labels() -> None:
    """The chosen index is the last PASS before the first non-PASS; later settings are NOT TESTED."""
    assert fixed_sequence(["PASS", "PASS", "INCONCLUSIVE", "PASS"]) == (
        1,
        ["PASS", "PASS", "INCONCLUSIVE", "NOT TESTED"],
    )
    assert fixed_sequence(["FAIL", None]) == (None, ["FAIL", "NOT TESTED"])
    assert fixed_sequence(["PASS", "PASS"]) == (1, ["PASS", "PASS"])
    with pytest.raises(ValueError, match=r"decisions\[0\]"):
        fixed_sequence([None, "PASS"])
