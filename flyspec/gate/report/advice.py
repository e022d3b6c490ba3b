"""A report's sentences, written from its numbers so that they cannot contradict them: the explanation
under the decision, the advice on what to do next (computed when the report is built), and the sentences
on a control and on a judge."""

from __future__ import annotations

from flyspec.gate.report.model import (
    POWER_PCT,
    Comparison,
    GoldSummary,
    JudgeSummary,
    ReportData,
    pct,
    points,
)
from flyspec.gate.stats.decide import FAIL, INCONCLUSIVE, PASS, classify
from flyspec.gate.stats.sizing import Design, design_outcome, flip_rate_upper_bound


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
    """Sentences for a newcomer: the interval (fractions) of candidate minus baseline accuracy after ``n``
    questions, then what it shows against ``margin``; ValueError when ``decision`` does not follow."""
    if n == 0:
        return ["No question has been answered by both arms yet, so there is nothing to decide."]
    expected = classify(low, high, margin).decision
    if decision != expected:
        raise ValueError(
            f"decision={decision!r} does not follow from the interval [{low}, {high}] and margin {margin} "
            f"(the rule gives {expected})"
        )
    lo, hi = points(low, 0.0, -margin), points(high, 0.0, -margin)
    confidence = f"{100 * level:g}%"
    where = (
        " (a confidence sequence: it holds at every number of questions at once, so stopping where it "
        "stopped is allowed)"
        if sequential
        else ""
    )
    return [
        f"After {n} questions, with {confidence} confidence the candidate's accuracy minus the baseline's "
        f"lies between {lo} and {hi} points{where}.",
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


_STOP_REASONS = {
    "max_questions": "it reached its maximum of {n} questions without crossing a boundary",
    "time_budget": "its time budget ran out (a rerun of the same command continues it)",
    "interrupted": "it was interrupted (a rerun of the same command continues it)",
    "error": "an arm failed (a rerun of the same command continues it)",
    "in_progress": "it has not stopped yet: it is still running, or it was killed (a rerun continues it)",
}


def _stop_sentence(report: ReportData) -> str:
    stop, plan = report.sequential, report.sequential_plan
    assert stop is not None and plan is not None
    m = report.margin_points
    if stop.reason == "boundary":
        why = (
            f"the lower bound rose above -{m} points"
            if stop.decision == PASS
            else f"the upper bound fell below -{m} points"
        )
    else:
        why = _STOP_REASONS[stop.reason].format(n=plan.max_questions)
    extra = stop.complete_prefix - stop.stopped_at
    later = (
        f" {extra} more pairs that were already in flight are stored; they do not change the decision."
        if extra > 0 and stop.final
        else ""
    )
    return f"The run stopped after {stop.stopped_at} of at most {plan.max_questions} questions: {why}.{later}"


def explanation(report: ReportData) -> list[str]:
    """The plain words under the decision; they follow the numbers in every case."""
    pooled = report.pooled
    assert pooled is not None
    lines = [_stop_sentence(report)] if report.sequential is not None else []
    if pooled.interim_decision is not None:
        if report.gold is not None and pooled.n == pooled.registered:
            return [
                *lines,
                f"All {pooled.n} registered questions have both answers, but {report.gold.awaiting} pair(s) "
                "drawn for a gold label still wait for it, so there is no decision yet; the interim reading "
                f"on the pairs before the first of them is {pooled.interim_decision}. Label them with "
                "`flyspec gate label` and the report decides.",
            ]
        return [
            *lines,
            f"The run is incomplete ({pooled.n} of {pooled.registered} questions answered by both arms), so "
            f"there is no decision yet; the interim estimate reads {pooled.interim_decision}. Finish the run "
            "by repeating the same `gate run` command.",
        ]
    if pooled.n == 0 or pooled.ci_low is None or pooled.ci_high is None:
        return [*lines, *explain_decision(INCONCLUSIVE, -1.0, 1.0, report.registered_margin, 0)]
    return lines + explain_decision(
        pooled.decision or INCONCLUSIVE,
        pooled.ci_low,
        pooled.ci_high,
        report.registered_margin,
        pooled.n,
        level=report.level,
        sequential=report.sequential is not None,
    )


def _plan_sentence(pooled: Comparison, margin: str) -> list[str]:
    """The fixed run's plan from the flip rate's upper bound, if one applies."""
    if pooled.loss_detected:
        return [
            "The candidate is shown to be worse than the baseline, so a plan that assumes it is as accurate "
            f"does not apply: more questions can only tell whether the loss exceeds {margin} points."
        ]
    if pooled.questions_needed is None or pooled.flip_rate_upper is None:
        return []
    flips = pooled.lost + pooled.gained
    if flips == 0:
        return [
            f"No question flipped in these {pooled.n} pairs, so the flip rate is not known: a rate as high "
            f"as {pct(pooled.flip_rate_upper)} (its one-sided 95% upper confidence bound) would often give "
            f"no flip either. Planned from that bound, a fixed run needs about {pooled.questions_needed} "
            f"questions for {POWER_PCT} power to show non-inferiority within {margin} points."
        ]
    return [
        "Planned from the flip rate's one-sided 95% upper confidence bound "
        f"({pct(pooled.flip_rate_upper)}; observed {pct(pooled.flip_rate)}), a fixed run needs about "
        f"{pooled.questions_needed} questions for {POWER_PCT} power to show non-inferiority within {margin} "
        f"points if the candidate is truly as accurate (about {pooled.questions_needed_at_observed} at the "
        "observed rate)."
    ]


UNLIMITED = 200_000
"""The question limit of a simulated design whose claim is about the method (no population)."""


def sequential_questions(
    flip_rate: float, margin: float, alpha: float = 0.025, population_size: int | None = None
) -> int | None:
    """Questions by which 90% of simulated sequential runs with no true loss decide (without replacement
    over ``population_size`` if given); None when fewer than 90% decide even at the design's limit."""
    limit = population_size if population_size is not None else UNLIMITED
    return design_outcome(Design("sequential", limit, population_size), flip_rate, margin, alpha).q90


def _continue_sequential(report: ReportData) -> list[str]:
    """Advice after a sequential run reached its registered maximum undecided: continue the same run."""
    stop, plan, pooled = report.sequential, report.sequential_plan, report.pooled
    assert stop is not None and plan is not None and pooled is not None
    flips = pooled.lost + pooled.gained
    upper = flip_rate_upper_bound(flips, pooled.n)
    simulated = sequential_questions(upper, report.registered_margin, plan.alpha, plan.sequence_population)
    target = max(simulated or UNLIMITED, stop.stopped_at + 1)
    head = (
        f"The confidence sequence did not cross within the {stop.stopped_at} registered questions. Unlike a "
        "fixed run, this run may go on: its confidence sequence holds at every number of questions, so "
        "more questions in the same registered order keep its guarantee."
    )
    if plan.max_questions >= plan.population_size:
        return [
            f"{head} It has used every question of its pool ({plan.population_size}), so continue it on "
            "other data: a new sequential run with more datasets, or a larger benchmark."
        ]
    total = min(target, plan.population_size)
    reach = f" (its whole pool; the simulations say about {target} at that rate)" if total < target else ""
    return [
        f"{head} Continue this run: rerun the same command with `--max-questions {total}`{reach}. At a "
        f"flip rate of {pct(upper)} (the one-sided 95% upper bound of the {pct(flips / pooled.n)} "
        f"observed), 90% of simulated runs of this design with a candidate that loses nothing decide within "
        f"about {target:,} questions at a {report.margin_points}-point margin (docs/statistics.md, "
        '"Questions to a decision"); a candidate that loses part of the margin needs more.'
    ]


def advice(report: ReportData) -> list[str]:
    """What to do next when the decision is INCONCLUSIVE (an empty list otherwise)."""
    pooled = report.pooled
    if pooled is None or pooled.decision != INCONCLUSIVE:
        return []
    stop = report.sequential
    if pooled.interim_decision is not None or (stop is not None and not stop.final):
        return ["Rerun the same command to continue this run."]
    if pooled.n == 0:
        return []
    if stop is not None:
        return _continue_sequential(report)
    why = (
        "Do not add questions to this run, rerun it, or test again on other questions to decide again: "
        "looking at a result and then collecting more data until it looks better is optional stopping, and "
        "every further look at this comparison is another chance of a wrong PASS, on fresh questions too "
        "(the claim is about the method, the same hypothesis whatever questions test it)."
    )
    return [*_plan_sentence(pooled, report.margin_points), f"{why} {_next_look(report, pooled)}"]


def _next_look(report: ReportData, pooled: Comparison) -> str:
    """After an INCONCLUSIVE fixed run: the valid way forward the comparison's budget leaves."""
    ledger = report.ledger
    left = ledger.budget - ledger.spent_before - ledger.alpha if ledger is not None else 0.0
    size = None if pooled.loss_detected else pooled.questions_needed
    if ledger is not None and left > 1e-12:
        command = (
            f"`flyspec gate run --sequential --max-questions {size or 'N'} --alpha {left:g} --run NEW ...`"
        )
        return (
            f"This comparison's error budget ({ledger.budget:g}) has {left:g} left, so a sequential "
            f"continuation at that alpha is valid ({command}, same arms and data): it carries "
            "this run's answers first, in their order (counted once), and holds whenever it stops."
        )
    budget = f" ({ledger.budget:g})" if ledger is not None else ""
    return (
        f"This run spent the comparison's whole error budget{budget}, so the alpha ledger refuses another "
        "look at it: act on this result as it stands. Next time, register a fixed run with room for a "
        "continuation (for example `--alpha 0.0125 --alpha-budget 0.025`), or run sequentially from the "
        "start: a sequential run may continue until it decides. A sequential run with `--population finite` "
        "on questions no look at this comparison used makes only a narrower claim, about those questions."
    )


def compare_advice(report: ReportData) -> list[str]:
    """What to do next after ``gate compare`` reads INCONCLUSIVE (an empty list otherwise)."""
    pooled = report.pooled
    if pooled is None or pooled.decision != INCONCLUSIVE or pooled.n == 0:
        return []
    return [
        *_plan_sentence(pooled, report.margin_points),
        "Do not add samples to these logs and compare again until the result looks better: that is optional "
        "stopping, and it makes a wrong PASS more likely than alpha. To decide, run the gate with the margin "
        "registered before the first answer on questions these logs have not used, sequentially so that it "
        "can stop as soon as the evidence is clear: `flyspec gate run --sequential --margin M ...`.",
    ]


def control_sentence(control: ReportData) -> str:
    """One sentence on a control: whether the gate caught it, after how many questions and minutes."""
    pooled = control.pooled
    stop = control.sequential
    if pooled is None or pooled.decision is None:
        return f"Control `{control.comparison}`: no question has been answered by both arms yet."
    n = stop.stopped_at if stop is not None else pooled.n
    minutes = control.decided_after_minutes
    when = f" ({minutes:.0f} minutes of answering)" if minutes is not None else ""
    if pooled.decision == FAIL:
        return (
            f"The gate caught a harmful setting: control `{control.comparison}` FAILed after {n} questions"
            f"{when}, losing more than the {control.margin_points}-point margin (interval "
            f"[{points(pooled.ci_low)}, {points(pooled.ci_high)}] points)."
        )
    if pooled.decision == PASS:
        return (
            f"Control `{control.comparison}` PASSed after {n} questions{when}: the setting expected to be "
            "harmful was shown to lose less than the margin, so the control did not do its job here (check "
            "that it really is worse on these questions)."
        )
    return (
        f"Control `{control.comparison}` is not decided yet after {n} questions (interval "
        f"[{points(pooled.ci_low)}, {points(pooled.ci_high)}] points against -{control.margin_points})."
    )


def position_bias(j: JudgeSummary) -> str:
    """How often the judge chose the answer shown first, against the half an unbiased judge would."""
    decisive = j.chose_a + j.chose_b
    if not decisive:
        return "Position bias: the judge gave no decisive verdict (only ties or unreadable ones)."
    bias = (
        "a strong position bias: treat its verdicts with care"
        if j.position_p < 0.05
        else "no significant position bias"
    )
    return (
        f"Position bias: of {decisive} decisive verdicts the judge chose the answer shown first (A) in "
        f"{j.chose_a} ({100 * j.chose_a / decisive:.0f}%); an unbiased judge chooses A about half the time, "
        f"since each arm is shown first once per question (exact binomial p = {j.position_p:.3g}: {bias})."
    )


def judged_proof(report: ReportData, g: GoldSummary) -> str:
    """What the judged decision proves, for the draw the run registered."""
    design = (
        "at every number of questions at once" if report.sequential is not None else "at its registered size"
    )
    return (
        f"**What is proven, for this run's draw** (draw {g.draw}: each pair whose answers differ is drawn "
        f"with probability {g.rate:g}, from a hash of the seed and the question independent of the question "
        "order and of every answer): given the pairs before it, each question's value has the true "
        "difference as its mean whatever the judge says, so the betting interval holds "
        f"{design} (Ville's inequality): P(PASS) <= alpha when the candidate truly loses the margin and "
        "P(FAIL) <= alpha when it loses nothing, for any judge. The seeded simulations of docs/statistics.md "
        "check it for seven judges (a coin, position bias, always the candidate, harsh, lenient, reversed, "
        "fair) through the gate's own order and draw. The truth is the gold source's: with human labels, "
        "what the person would say on every pair."
    )
