"""The gate's decision rule on an interval for delta = candidate accuracy - baseline accuracy.

One rule for the fixed-size test (Tango's interval) and for the sequential test (the confidence sequence at
its stopping point), explained in docs/statistics.md:

- PASS: the lower bound lies above ``-margin``: the candidate loses less than the margin (non-inferior);
- FAIL: the upper bound lies below ``-margin``: the candidate loses more than the margin;
- INCONCLUSIVE otherwise. ``loss_detected`` (upper bound below 0) says the candidate is shown to be worse,
  whether or not by more than the margin; with INCONCLUSIVE it means "worse, by how much not yet known".
"""

from __future__ import annotations

from flyspec.checks import is_number

PASS, FAIL, INCONCLUSIVE = "PASS", "FAIL", "INCONCLUSIVE"
NOT_TESTED = "NOT TESTED"
DECISIONS = (PASS, FAIL, INCONCLUSIVE)


def check_margin(margin: float) -> None:
    """Raise ValueError unless ``margin`` is a number in (0, 1)."""
    if not is_number(margin):
        raise ValueError(f"margin={margin!r}: must be a number")
    if not 0 < margin < 1:
        raise ValueError(f"margin={margin!r}: must lie in (0, 1)")


def check_margin_alpha(margin: float, alpha: float) -> None:
    """Validate a run's non-inferiority margin and one-sided alpha (set before its first answer)."""
    if not is_number(margin, above=0, below=1):
        raise ValueError(
            f"margin={margin!r}: must lie in (0, 1); it is the tolerated accuracy loss as a fraction "
            "(0.02 = 2 points)"
        )
    if not is_number(alpha, above=0, below=0.5):
        raise ValueError(f"alpha={alpha!r}: must lie in (0, 0.5); it is the one-sided level (0.025 usual)")


def classify(low: float, high: float, margin: float) -> tuple[str, bool]:
    """``(decision, loss_detected)`` for an interval ``[low, high]`` of delta against ``margin``."""
    if low > -margin:
        decision = PASS
    elif high < -margin:
        decision = FAIL
    else:
        decision = INCONCLUSIVE
    return decision, high < 0
