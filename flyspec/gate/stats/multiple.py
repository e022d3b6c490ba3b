"""Choosing among several candidate settings without inflating the error: fixed-sequence testing.

``gate tune`` tests settings against one baseline in an order registered before any quality data is seen,
least aggressive first. Each test is the ordinary non-inferiority test at the full alpha; testing stops at
the first setting that does not PASS, and the answer is the last one that did. Because a later hypothesis
is only tested when every earlier one was rejected, the chance of choosing any setting that is truly worse
than the margin stays at most alpha, with no alpha splitting (the fixed-sequence or hierarchical
procedure: Maurer, Hothorn and Lehmacher 1995; Westfall and Krishen 2001). See docs/statistics.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from flyspec.gate.stats.decision import DECISIONS, NOT_TESTED, PASS


class FixedSequenceResult(NamedTuple):
    """``chosen``: index of the last PASS before the first non-PASS (None if the first did not pass);
    ``labels``: each setting's decision, "NOT TESTED" after the first non-PASS."""

    chosen: int | None
    labels: list[str]


def fixed_sequence(decisions: Sequence[str | None]) -> FixedSequenceResult:
    """Apply the fixed-sequence procedure to decisions listed in the registered test order.

    Entries after the first non-PASS are never looked at (they may be None for settings that were not
    run) and are labelled "NOT TESTED"; an entry up to and including that point must be a decision.
    """
    labels: list[str] = []
    chosen: int | None = None
    stopped = False
    for index, decision in enumerate(decisions):
        if stopped:
            labels.append(NOT_TESTED)
            continue
        if decision not in DECISIONS:
            raise ValueError(
                f"decisions[{index}]={decision!r}: a setting reached in the sequence needs a decision, "
                f"one of {', '.join(DECISIONS)}"
            )
        labels.append(decision)
        if decision == PASS:
            chosen = index
        else:
            stopped = True
    return FixedSequenceResult(chosen=chosen, labels=labels)
