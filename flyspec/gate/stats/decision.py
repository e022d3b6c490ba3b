"""The names of the gate's verdicts and the checks of a margin and alpha, standard library only, so that
the settings' checks and the command line read them without loading the statistics. The rule that picks
a verdict, and every route that applies it, is flyspec/gate/stats/decide.py."""

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
