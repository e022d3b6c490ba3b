"""The gate's decision in plain words, written from the numbers so that the words cannot contradict them.

``explain_decision`` checks that the decision it is given is the one the interval implies (the rule of
flyspec/gate/stats/decide.py) and raises ValueError otherwise, then says what the interval shows: where it
lies against zero and against the margin, which is everything the decision rests on.
"""

from __future__ import annotations

from flyspec.gate.stats.decide import FAIL, INCONCLUSIVE, PASS, classify

POWER_PCT = "80%"
"""The power every sample size in a report is planned for, as the words say it."""


def pct(value: float | None) -> str:
    """A fraction as a percentage with one decimal; ``-`` for None."""
    return "-" if value is None else f"{100 * value:.1f}%"


def num(value: float | None, digits: int) -> str:
    """A number with ``digits`` decimals; ``-`` for None."""
    return "-" if value is None else f"{value:.{digits}f}"


def points(value: float, *references: float) -> str:
    """``value`` (a fraction) in signed accuracy points, with enough decimals that it never reads as
    equal to one of ``references`` (zero, the margin) when it is not."""
    digits = 1
    while digits < 4 and any(
        round(100 * value, digits) == round(100 * ref, digits) and value != ref for ref in references
    ):
        digits += 1
    return f"{100 * value:+.{digits}f}"


def explain_decision(
    decision: str,
    low: float,
    high: float,
    margin: float,
    n: int,
    *,
    level: float = 0.95,
    sequential: bool = False,
) -> list[str]:
    """Sentences for a newcomer: the interval of candidate minus baseline accuracy, then what it shows.

    ``low, high``: the interval (fractions); ``margin``: the tolerated loss (fraction); ``n``: questions
    the decision used; ``sequential``: the interval is a confidence sequence at a stopping time.
    """
    if n == 0:
        return ["No question has been answered by both arms yet, so there is nothing to decide."]
    expected = classify(low, high, margin).decision
    if decision != expected:
        raise ValueError(
            f"decision={decision!r} does not follow from the interval [{low}, {high}] and margin {margin} "
            f"(the rule gives {expected})"
        )
    lo, hi = points(low, 0.0, -margin), points(high, 0.0, -margin)
    pct = f"{100 * level:g}%"
    where = (
        " (a confidence sequence: it holds at every number of questions at once, so stopping where it "
        "stopped is allowed)"
        if sequential
        else ""
    )
    return [
        f"After {n} questions, with {pct} confidence the candidate's accuracy minus the baseline's lies "
        f"between {lo} and {hi} points{where}.",
        _what_it_shows(decision, low, high, margin),
    ]


def _what_it_shows(decision: str, low: float, high: float, margin: float) -> str:
    """The sentence on where the interval lies against zero and the margin, ending with the decision."""
    m = f"{100 * margin:g}"
    lo, hi = points(low, 0.0, -margin), points(high, 0.0, -margin)
    lost_lo, lost_hi = points(-high, 0.0, margin).lstrip("+"), points(-low, 0.0, margin).lstrip("+")
    if decision == PASS:
        if low > 0:
            return (
                "The whole interval lies above zero: the candidate is more accurate than the baseline, so "
                f"it is within the margin of {m} points. PASS."
            )
        if high < 0:
            return (
                "The whole interval lies below zero: the candidate is less accurate than the baseline, but "
                f"by less than the margin of {m} points (a loss between {lost_lo} and {lost_hi} points). "
                "PASS: non-inferior within the margin; make sure a loss of that size is acceptable."
            )
        return (
            f"The whole interval lies above -{m} points: the candidate loses less than the margin of {m} "
            "points (it may be a little worse or a little better than the baseline). PASS: non-inferior."
        )
    if decision == FAIL:
        return (
            f"The whole interval lies below -{m} points: the candidate loses more than the margin, at least "
            f"{lost_lo} points of accuracy. FAIL."
        )
    if high < 0:
        return (
            "The whole interval lies below zero: the candidate is worse than the baseline; whether by more "
            f"than the margin of {m} points is not yet known (the loss lies between {lost_lo} and {lost_hi} "
            "points). INCONCLUSIVE (loss detected)."
        )
    gain = "no loss at all" if high == 0 else f"a gain of {hi.lstrip('+')} points"
    return (
        f"The interval reaches from {lo} points, a loss not smaller than the margin of {m}, to {gain}: "
        f"the data cannot tell yet whether the candidate stays within {m} points. INCONCLUSIVE."
    )


def decision_rule(margin: float, level: float, *, sequential: bool, judged: bool = False) -> str:
    """The decision rule in plain words, for a run at ``margin`` and confidence ``level`` (sequential: the
    confidence sequence; else Tango's interval; ``judged``: the prediction-powered interval of a judged run
    with gold labels, fixed or sequential)."""
    m, lvl = f"{100 * margin:g}", f"{100 * level:g}%"
    if judged:
        kind = (
            "a confidence sequence, updated after every question in the registered random order (it holds at "
            "every number of questions at once, so the run may stop at the first crossing)"
            if sequential
            else "an interval whose bet is tuned to the registered number of questions"
        )
        interval = (
            f"a {lvl} prediction-powered betting interval: per question, the judge's verdict corrected by "
            "the gold label where the pair was drawn for one (drawn at random, independently of the order), "
            f"averaged by {kind}"
        )
        mcnemar = (
            "McNemar's exact test on the gold labels is reported beside the decision: it asks whether the "
            "arms differ at all, not whether a loss exceeds the margin."
        )
    else:
        interval = (
            f"a {lvl} betting confidence sequence, updated after every question in the registered random "
            "order (it holds at every number of questions at once, so the run may stop at the first crossing)"
            if sequential
            else f"Tango's {lvl} score interval"
        )
        mcnemar = (
            "The exact McNemar test is reported beside the decision: it asks whether the arms differ at all, "
            "not whether a loss exceeds the margin."
        )
    return (
        f"We estimate the candidate's accuracy minus the baseline's on the same questions with {interval}. "
        f"PASS if its lower end lies above -{m} points (the candidate loses less than the margin: "
        f"non-inferior). FAIL if its upper end lies below -{m} points (it loses more than the margin). "
        "Otherwise INCONCLUSIVE; 'loss detected' when the upper end lies below zero (worse than the "
        f"baseline, by how much not yet known). {mcnemar}"
    )


__all__ = [
    "FAIL",
    "INCONCLUSIVE",
    "PASS",
    "POWER_PCT",
    "decision_rule",
    "explain_decision",
    "num",
    "pct",
    "points",
]
