"""The paired comparison of one dataset (or of all, pooled): counts, the exact McNemar test, and for a
fixed-size run Tango's interval and the decision; for a sequential run's pooled row, the confidence
sequence's bounds at its stop."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from flyspec.gate.report.model import Comparison
from flyspec.gate.stats.decide import INCONCLUSIVE, decide_with_undecided
from flyspec.gate.stats.monitor import SequentialStop
from flyspec.gate.stats.paired import mcnemar, noninferiority
from flyspec.gate.stats.sizing import plan_noninferiority

POWER = 0.80


def _plan_fields(n: int, flips: int, margin: float, alpha: float) -> dict[str, Any]:
    plan = plan_noninferiority(flips, n, margin, alpha, POWER)
    return {
        "questions_needed": plan.questions,
        "questions_needed_at_observed": plan.questions_at_observed,
        "flip_rate_upper": plan.flip_rate_upper,
        "more_questions": max(0, plan.questions - n),
    }


def paired_counts(pairs: list[tuple[bool, bool]]) -> tuple[int, int, int]:
    lost = sum(1 for b, c in pairs if b and not c)
    gained = sum(1 for b, c in pairs if c and not b)
    return len(pairs), lost, gained


def counted(
    scope: str, pairs: list[tuple[bool, bool]], registered: int, alpha: float, undecided: int = 0
) -> Comparison:
    """Counts, accuracies and the exact McNemar test of the pairs; no interval and no decision.
    ``undecided`` of the pairs (each graded wrong on both sides) are judged pairs the judge could not
    decide; McNemar, reported beside the decision, uses the decided pairs only."""
    n, lost, gained = paired_counts(pairs)
    test = mcnemar(lost, gained)
    return Comparison(
        scope=scope,
        n=n,
        registered=registered,
        baseline_accuracy=sum(b for b, _ in pairs) / n if n else None,
        candidate_accuracy=sum(c for _, c in pairs) / n if n else None,
        lost=lost,
        gained=gained,
        net=gained - lost,
        net_difference=(gained - lost) / n if n else None,
        flip_rate=(lost + gained) / n if n else None,
        exact_p=test.exact_p,
        mid_p=test.mid_p,
        ci_low=None,
        ci_high=None,
        noninferiority_p=None,
        significant_loss=lost > gained and test.exact_p < 2 * alpha,
        decision=None,
        undecided=undecided,
    )


def compare_pairs(
    scope: str,
    pairs: list[tuple[bool, bool]],
    registered: int,
    margin: float,
    alpha: float,
    undecided: int = 0,
) -> Comparison:
    """A fixed-size comparison of (baseline correct, candidate correct) pairs: counts, exact McNemar,
    Tango's interval and ``stats.decide``; when INCONCLUSIVE, the questions a fixed run would need.
    ``undecided`` of the pairs are judged pairs the judge could not decide (``stats.decide_with_undecided``
    counts them against the claim being tested)."""
    comparison = counted(scope, pairs, registered, alpha, undecided)
    n, lost, gained = comparison.n, comparison.lost, comparison.gained
    if n == 0:
        return replace(comparison, decision=INCONCLUSIVE)
    result = decide_with_undecided(n, lost, gained, undecided, margin, alpha)
    comparison = replace(
        comparison,
        ci_low=result.low,
        ci_high=result.high,
        noninferiority_p=noninferiority(n, lost + undecided, gained, margin, alpha).p_value,
        decision=result.decision,
        loss_detected=result.loss_detected,
    )
    if result.decision == INCONCLUSIVE:
        comparison = replace(comparison, **_plan_fields(n, lost + undecided + gained, margin, alpha))
    return comparison


def sequential_row(
    stop: SequentialStop, pairs: list[tuple[bool, bool]], registered: int, alpha: float
) -> Comparison:
    """The pooled row of a sequential run: the pairs up to the stop and the sequence's bounds there."""
    row = counted("pooled", pairs, registered, alpha, stop.undecided)
    if not pairs:
        return replace(row, decision=INCONCLUSIVE)
    return replace(
        row, ci_low=stop.low, ci_high=stop.high, decision=stop.decision, loss_detected=stop.loss_detected
    )
