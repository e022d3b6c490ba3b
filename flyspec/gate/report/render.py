"""How the gate report reads: the plain words, the advice, markdown and HTML (flyspec/gate/report/report.py
builds the numbers)."""

from __future__ import annotations

import base64
import html
import io
import json
from typing import Any

from flyspec.gate.data.spec import SamplingRecord
from flyspec.gate.report.model import Comparison, ReportData
from flyspec.gate.report.wording import explain_decision, points
from flyspec.gate.stats.decide import FAIL, INCONCLUSIVE, PASS
from flyspec.gate.stats.forecast import Design, design_outcome
from flyspec.gate.stats.sizing import flip_rate_upper_bound

POWER_PCT = "80%"
_STOP_REASONS = {
    "max_questions": "it reached its maximum of {n} questions without crossing a boundary",
    "time_budget": "its time budget ran out (a rerun of the same command continues it)",
    "interrupted": "it was interrupted (a rerun of the same command continues it)",
    "error": "an arm failed (a rerun of the same command continues it)",
    "in_progress": "it has not stopped yet: it is still running, or it was killed (a rerun continues it)",
}


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _m(report: ReportData) -> str:
    return f"{100 * report.run.margin:g}"


def _stop_sentence(report: ReportData) -> str:
    stop, plan = report.sequential, report.sequential_plan
    assert stop is not None and plan is not None
    m = _m(report)
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
    lines: list[str] = []
    if report.sequential is not None:
        lines.append(_stop_sentence(report))
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
        return [*lines, *explain_decision(INCONCLUSIVE, -1.0, 1.0, report.run.margin, 0)]
    return lines + explain_decision(
        pooled.decision or INCONCLUSIVE,
        pooled.ci_low,
        pooled.ci_high,
        report.run.margin,
        pooled.n,
        level=report.level,
        sequential=report.sequential is not None,
    )


def _continuation_command(questions: int | None, alpha: float) -> str:
    size = f" --max-questions {questions}" if questions else " --max-questions N"
    return f"`flyspec gate run --sequential{size} --alpha {alpha:g} --run NEW ...`, same arms and data"


def _plan_sentence(pooled: Comparison, margin: str) -> str:
    if pooled.loss_detected:
        return (
            "The candidate is shown to be worse than the baseline, so a plan that assumes it is as accurate "
            f"does not apply: more questions can only tell whether the loss exceeds {margin} points."
        )
    if pooled.questions_needed is None or pooled.flip_rate_upper is None:
        return ""
    flips = pooled.lost + pooled.gained
    if flips == 0:
        return (
            f"No question flipped in these {pooled.n} pairs, so the flip rate is not known: a rate as high "
            f"as {_pct(pooled.flip_rate_upper)} (its one-sided 95% upper confidence bound) would often give "
            f"no flip either. Planned from that bound, a fixed run needs about {pooled.questions_needed} "
            f"questions for {POWER_PCT} power to show non-inferiority within {margin} points."
        )
    return (
        "Planned from the flip rate's one-sided 95% upper confidence bound "
        f"({_pct(pooled.flip_rate_upper)}; observed {_pct(pooled.flip_rate)}), a fixed run needs about "
        f"{pooled.questions_needed} questions for {POWER_PCT} power to show non-inferiority within {margin} "
        f"points if the candidate is truly as accurate (about {pooled.questions_needed_at_observed} at the "
        "observed rate)."
    )


UNLIMITED = 200_000
"""The question limit of the simulated design behind the advice when the claim is about the method."""


def sequential_questions(
    flip_rate: float, margin: float, alpha: float = 0.025, population_size: int | None = None
) -> int | None:
    """Questions by which 90% of simulated sequential runs with no true loss decide, for the registered
    design (the i.i.d. sequence, or the without-replacement one over ``population_size``), by simulating
    it (flyspec/gate/stats/forecast.py); None when fewer than 90% decide even at the design's limit."""
    limit = population_size if population_size is not None else UNLIMITED
    return design_outcome(Design("sequential", limit, population_size), flip_rate, margin, alpha).q90


def _continue_sequential(report: ReportData) -> list[str]:
    """Advice after a sequential run reached its registered maximum undecided: continue the same run."""
    stop, plan, pooled = report.sequential, report.sequential_plan, report.pooled
    assert stop is not None and plan is not None and pooled is not None
    flips = pooled.lost + pooled.gained + pooled.undecided
    upper = flip_rate_upper_bound(flips, pooled.n)
    simulated = sequential_questions(upper, report.run.margin, plan.alpha, plan.sequence_population)
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
        f"flip rate of {_pct(upper)} (the one-sided 95% upper bound of the {_pct(flips / pooled.n)} "
        f"observed), 90% of simulated runs of this design with a candidate that loses nothing decide within "
        f'about {target:,} questions at a {_m(report)}-point margin (docs/statistics.md, "Questions to a '
        'decision"); a candidate that loses part of the margin needs more.'
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
    m = _m(report)
    why = (
        "Do not add questions to this run, rerun it, or test again on other questions to decide again: "
        "looking at a result and then collecting more data until it looks better is optional stopping, and "
        "every further look at this comparison is another chance of a wrong PASS, on fresh questions too "
        "(the claim is about the method, the same hypothesis whatever questions test it)."
    )
    plan = _plan_sentence(pooled, m)
    return [*([plan] if plan else []), f"{why} {_next_look(report, pooled)}"]


def _next_look(report: ReportData, pooled: Comparison) -> str:
    """After an INCONCLUSIVE fixed run: the valid way forward the comparison's budget leaves."""
    ledger = report.ledger
    left = ledger.budget - ledger.spent_before - ledger.alpha if ledger is not None else 0.0
    size = None if pooled.loss_detected else pooled.questions_needed
    if ledger is not None and left > 1e-12:
        return (
            f"This comparison's error budget ({ledger.budget:g}) has {left:g} left, so a sequential "
            f"continuation at that alpha is valid ({_continuation_command(size, left)}): it carries "
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
    plan = _plan_sentence(pooled, _m(report))
    return [
        *([plan] if plan else []),
        "Do not add samples to these logs and compare again until the result looks better: that is optional "
        "stopping, and it makes a wrong PASS more likely than alpha. To decide, run the gate with the margin "
        "registered before the first answer on questions these logs have not used, sequentially so that it "
        "can stop as soon as the evidence is clear: `flyspec gate run --sequential --margin M ...`.",
    ]


def _decision_heading(pooled: Comparison) -> str:
    loss = " (loss detected)" if pooled.decision == INCONCLUSIVE and pooled.loss_detected else ""
    return f"## Decision: **{pooled.decision}**{loss}"


def _mcnemar_line(report: ReportData, pooled: Comparison) -> str:
    sig = (
        " The candidate loses significantly more questions than it gains."
        if pooled.significant_loss
        else " The arms do not differ significantly by this test."
    )
    when = " (descriptive at a stopping point the data chose)" if report.sequential is not None else ""
    return (
        f"Exact McNemar test, beside the decision{when}: lost {pooled.lost}, gained {pooled.gained}, "
        f"two-sided p = {pooled.exact_p:.3g} (mid-p {pooled.mid_p:.3g}).{sig}"
    )


def _noise_line(report: ReportData, pooled: Comparison) -> str:
    noise = report.noise
    assert noise is not None
    return (
        f"The baseline's own noise, next to the candidate's flips: pilot `{noise.run_id}` answered "
        f"{noise.n} questions twice with the baseline and {noise.flips} flipped ({_pct(noise.flip_rate)}, "
        f"95% interval [{_pct(noise.low)}, {_pct(noise.high)}]); here the candidate flipped "
        f"{pooled.lost + pooled.gained} of {pooled.n} against the baseline ({_pct(pooled.flip_rate)})."
    )


def _exploratory_lines(report: ReportData) -> list[str]:
    e = report.exploratory
    if e is None:
        return []
    interval = (
        f"interval [{points(e.low)}, {points(e.high)}] points"
        if e.low is not None and e.high is not None
        else "no interval"
    )
    return [
        f"### Exploratory, not the decision: margin {100 * e.margin:g} points",
        "",
        f"At a margin of {100 * e.margin:g} points the same {e.n} pairs read **{e.decision}** ({interval}). "
        f"This margin was chosen after the data; the registered decision above ({report.decision}, margin "
        f"{_m(report)} points) is the one that counts.",
        "",
    ]


def _gate_lines(report: ReportData) -> list[str]:
    pooled = report.pooled
    assert pooled is not None
    lines = [_decision_heading(pooled), "", " ".join(report.explanation), ""]
    if report.gold is not None:
        lines += [_gold_line(report), ""]
        if report.gold.gold_exact_p is not None:
            lines += [_gold_mcnemar_line(report.gold), ""]
    elif report.judge is not None and pooled.n:
        lines += [_undecided_line(report, pooled), ""]
    if pooled.n and report.gold is None:
        lines += [_mcnemar_line(report, pooled), ""]
    if report.noise is not None and pooled.n:
        lines += [_noise_line(report, pooled), ""]
    if report.advice:
        lines += [" ".join(report.advice), ""]
    if report.ledger is not None:
        lines += [report.ledger.describe(), ""]
    lines += _exploratory_lines(report)
    lines += _judge_lines(report)
    lines += [f"**Rule.** {report.rule()}", ""]
    if report.sequential is not None:
        lines += _sequential_lines(report)
    return lines + (_gold_table(report) if report.gold is not None else _paired_table(report))


def _undecided_line(report: ReportData, pooled: Comparison) -> str:
    """Beside the decision of a judged run: how often the judge could not decide, and the two counts."""
    j = report.judge
    assert j is not None
    rate = _pct(j.disagreement_rate)
    return (
        f"Judge disagreement rate: {rate} ({j.undecided} of {j.questions - j.identical} judged pairs "
        "undecided: the two orders said different things, or a verdict could not be read). In the "
        f"{pooled.n} pairs of the decision, {pooled.undecided} are undecided and count against the claim "
        f"being tested: the PASS test counts lost {pooled.lost + pooled.undecided}, gained {pooled.gained}; "
        f"the FAIL test counts lost {pooled.lost}, gained {pooled.gained + pooled.undecided}."
    )


def _gold_line(report: ReportData) -> str:
    """Beside a judged run's decision: the gold labels it rests on and the judge's agreement with them."""
    g = report.gold
    assert g is not None
    who = "the exact grader" if g.source == "exact" else "a person (`flyspec gate label`)"
    agreement = (
        f"The judge agreed with gold on {_pct(g.agreement)} of the {g.labelled} labelled pairs (95% interval "
        f"[{_pct(g.agreement_low)}, {_pct(g.agreement_high)}])."
        if g.agreement is not None
        else "No pair has a gold label yet, so the run decides nothing: a judge's verdicts alone cannot show "
        "that the candidate is within the margin, whatever they say."
    )
    waiting = (
        f" {g.awaiting} drawn pair(s) wait for a label, and the decision's prefix stops at the first of "
        f"them: `flyspec gate label --store {report.store} --run {report.run.run_id}` labels them."
        if g.awaiting
        else ""
    )
    advice = f" {g.advice}" if g.advice and report.decision == INCONCLUSIVE else ""
    draw = (
        "drawn at random, independently of the question order, by a rule fixed before the first answer"
        if g.draw != 1
        else "by the defective draw 1, which took the pairs at the start of the order: see the warning"
    )
    return (
        f"Gold labels: {g.labelled} of the {g.selected} pairs drawn for one ({100 * g.rate:g}% of the pairs "
        f"whose answers differ, {draw}), labelled by {who}. {agreement}{waiting}{advice}"
    )


def _gold_mcnemar_line(g: Any) -> str:
    """McNemar's exact test on the gold labels, beside a judged run's decision."""
    row = g.rows[-1]
    return (
        f"Exact McNemar test on the gold labels, beside the decision: of the {row.labelled} labelled pairs, "
        f"the label found the baseline's answer better in {row.gold_baseline}, the candidate's in "
        f"{row.gold_candidate} and neither in {row.gold_equal} (two-sided p = {g.gold_exact_p:.3g})."
    )


def _judge_sampling(report: ReportData) -> dict[str, Any]:
    judge = report.run.registered.judge
    return judge.sampling if judge is not None else {}


def _judge_lines(report: ReportData) -> list[str]:
    """What lost and gained mean for judged questions, the position-swap counts and the position bias."""
    j = report.judge
    if j is None:
        return []
    if report.gold is not None:
        return _ppi_lines(report, j)
    sampling = _judge_sampling(report)
    lines = [
        "## Judge",
        "",
        f"Questions with grader `judge` were graded by the judge model `{j.model}` (prompt {j.template}; "
        f"temperature 0, max_tokens {sampling.get('max_tokens')}, seed {sampling.get('seed')}), which saw "
        "the request and both answers and said which is better, twice, with the answers' positions "
        "swapped. For these questions **lost** means the judge preferred the baseline's answer in both "
        "orders, **gained** the candidate's in both orders; a tie in both orders, or two identical answers "
        "(the judge is not asked), is a tie. Anything else is **undecided**: the orders said different "
        "things (the position, not the answer, decided), or a verdict could not be read. An undecided pair "
        "counts against the claim being tested: as lost when testing for PASS, as gained when testing for "
        "FAIL, so a judge that cannot tell the answers apart cannot produce a FAIL, nor a PASS unless the "
        "answers differ less often than the margin. The accuracies are the share of questions where the "
        "judge, in both orders, found an arm's answer at least as good (undecided pairs count for neither).",
        "",
        "| judged questions | identical answers (tie) | both orders: tie | both orders: baseline better "
        "(lost) | both orders: candidate better (gained) | orders disagree (undecided) | unreadable verdict "
        "(undecided) | disagreement rate | unreadable verdicts |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {j.questions} | {j.identical} | {j.ties} | {j.baseline_better} | {j.candidate_better} | "
        f"{j.disagree} | {j.unreadable_pairs} | {_pct(j.disagreement_rate)} | "
        f"{j.unreadable} of {j.verdicts} |",
        "",
    ]
    decisive = j.chose_a + j.chose_b
    if decisive:
        share = j.chose_a / decisive
        bias = (
            "a strong position bias: treat its verdicts with care"
            if j.position_p < 0.05
            else "no significant position bias"
        )
        lines += [
            f"Position bias: of {decisive} decisive verdicts the judge chose the answer shown first (A) in "
            f"{j.chose_a} ({100 * share:.0f}%); an unbiased judge chooses A about half the time, since each "
            f"arm is shown first once per question (exact binomial p = {j.position_p:.3g}: {bias}).",
            "",
        ]
    else:
        lines += ["Position bias: the judge gave no decisive verdict (only ties or unreadable ones).", ""]
    if j.undecided:
        lines += [
            f"The judge could not decide {j.undecided} pair(s); each counts as lost for the PASS test and as "
            "gained for the FAIL test, so a judge that often disagrees with itself or fails to state a "
            "verdict ('Verdict: A', 'Verdict: B' or 'Verdict: tie') keeps the gate INCONCLUSIVE.",
            "",
        ]
    return lines


def _ppi_lines(report: ReportData, j: Any) -> list[str]:
    """How a judged run with gold labels decides (prediction-powered inference), in words and counts."""
    g = report.gold
    assert g is not None
    sampling = _judge_sampling(report)
    lines = [
        "## Judge and gold labels",
        "",
        f"The judge model `{j.model}` (prompt {j.template}; temperature 0, max_tokens "
        f"{sampling.get('max_tokens')}) saw each request and both answers and said which is better, "
        "twice, with the answers' positions swapped; two identical answers are a tie without asking it. "
        "Its verdicts are predictions, not the truth: a judge can be biased, noisy or useless (a coin "
        "agrees with itself on the wrong winner a quarter of the time). So the decision rests on gold "
        f"labels for a random subset of the pairs ({100 * g.rate:g}% of the pairs whose answers differ, "
        "drawn by a rule registered before the first answer), combined with the judge's verdicts on every "
        "pair by prediction-powered inference (docs/statistics.md): per question, the judge's verdict, "
        "corrected by the gold label (weighted by 1 / rate) where the pair was drawn; the verdicts narrow "
        "the interval as far as the labels show them to be right.",
        "",
        _proven(report, g),
        "",
        "| pairs | identical (tie) | judge: baseline better | judge: candidate better | judge: other | drawn "
        "for gold | labelled | waiting | agreement with gold |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        f"| {g.pairs} | {g.identical} | {g.lost} | {g.gained} | {g.undecided} | {g.selected} | "
        f"{g.labelled} | {g.awaiting} | {_pct(g.agreement)} "
        f"[{_pct(g.agreement_low)}, {_pct(g.agreement_high)}] |",
        "",
    ]
    decisive = j.chose_a + j.chose_b
    if decisive:
        bias = "a strong position bias" if j.position_p < 0.05 else "no significant position bias"
        lines += [
            f"Position bias: of {decisive} decisive verdicts the judge chose the answer shown first in "
            f"{j.chose_a} ({100 * j.chose_a / decisive:.0f}%; exact binomial p = {j.position_p:.3g}: "
            f"{bias}).",
            "",
        ]
    return lines


def _proven(report: ReportData, g: Any) -> str:
    """What the judged decision proves, for the draw the run registered."""
    if g.draw == 1:
        return (
            "**What is proven: nothing.** This run registered gold-label draw 1, whose drawn pairs were the "
            "start of the question order rather than a random subset, so the 1/rate weight was wrong and the "
            "judge's verdicts after that prefix counted uncorrected; the interval below is not a valid "
            "confidence interval for any judge that errs."
        )
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


def _gold_table(report: ReportData) -> list[str]:
    """A judged run's pairs per dataset: the judge's verdicts and the gold labels, never an accuracy (a
    verdict says which answer is better, not whether either is right), and the pooled interval."""
    g = report.gold
    pooled = report.pooled
    assert g is not None and pooled is not None
    m = _m(report)
    kind = "confidence sequence" if report.sequential is not None else "interval"
    scope = "task" if report.run.kind == "compare" else "dataset"
    lines = [
        "## Judged pairs and gold labels",
        "",
        f"| {scope} | pairs | identical | judge: baseline better | judge: candidate better | judge: other | "
        "drawn for gold | labelled | gold: baseline better | gold: equal | gold: candidate better | "
        f"{100 * report.level:g}% {kind} of net (points) | margin | decision |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for row in g.rows:
        interval, decision = "-", "-"
        if row.scope == "pooled" and pooled.ci_low is not None and pooled.ci_high is not None:
            interval = f"[{100 * pooled.ci_low:+.2f}, {100 * pooled.ci_high:+.2f}]"
            decision = pooled.decision or "-"
            if pooled.interim_decision is not None:
                decision = f"{pooled.decision} (interim {pooled.interim_decision})"
        lines.append(
            f"| {row.scope} | {row.pairs} | {row.identical} | {row.judge_baseline} | {row.judge_candidate} | "
            f"{row.judge_other} | {row.selected} | {row.labelled} | {row.gold_baseline} | {row.gold_equal} | "
            f"{row.gold_candidate} | {interval} | -{m} | {decision} |"
        )
    estimate = f"{100 * g.estimate:+.2f} points" if g.estimate is not None else "none yet"
    return [
        *lines,
        "",
        "judge: what the judge said in both orders (other: the orders disagreed, a tie, or a verdict could "
        "not be read); gold: what the label said on the pairs drawn and labelled. No accuracy is shown: a "
        "judge's verdict says which answer is better, not whether either is right. The pooled row counts "
        "the pairs the decision used and decides, on the prediction-powered "
        f"{kind} (its estimate of the difference: {estimate}).",
        "",
    ]


def _sequential_lines(report: ReportData) -> list[str]:
    stop, plan = report.sequential, report.sequential_plan
    assert stop is not None and plan is not None
    return [
        "## Sequential stopping",
        "",
        f"- registered before the first answer: margin {_m(report)} points, alpha {plan.alpha:g}, at most "
        f"{plan.max_questions} questions in the seeded order (seed {plan.order_seed}) drawn from "
        f"{plan.population_size}",
        f"- stopped at question {stop.stopped_at} ({stop.reason})"
        + (
            f"; the answers in flight then were finished and stored, so {stop.complete_prefix} pairs are "
            "complete along the order now: a rerun counts them first"
            if stop.complete_prefix > stop.stopped_at
            else f"; pairs complete along the order: {stop.complete_prefix}"
        ),
        f"- interval at the stop: [{points(stop.low)}, {points(stop.high)}] points",
        "- the sequence follows the registered order up to the first question still missing an answer, so "
        "the stop depends only on the answers in that order, not on which answers finished first",
        "",
    ]


def _paired_table(report: ReportData) -> list[str]:
    m = _m(report)
    kind = "confidence sequence" if report.sequential is not None else "CI"
    scope = "task" if report.run.kind == "compare" else "dataset"
    lines = [
        "## Paired results",
        "",
        f"| {scope} | n | baseline acc | candidate acc | lost | gained | net | exact p | mid-p | "
        f"{100 * report.level:g}% {kind} of net (points) | margin | decision |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for c in report.comparisons:
        ci = (
            f"[{100 * c.ci_low:+.2f}, {100 * c.ci_high:+.2f}]"
            if c.ci_low is not None and c.ci_high is not None
            else "-"
        )
        n = f"{c.n}" if c.n == c.registered else f"{c.n} of {c.registered}"
        decision = c.decision or "-"
        if c.interim_decision is not None:
            decision = f"{c.decision} (interim {c.interim_decision})"
        lines.append(
            f"| {c.scope} | {n} | {_pct(c.baseline_accuracy)} | {_pct(c.candidate_accuracy)} | {c.lost} | "
            f"{c.gained} | {c.net:+d} | {c.exact_p:.3g} | {c.mid_p:.3g} | {ci} | -{m} | {decision} |"
        )
    detail = (
        "The pooled row's bounds are the confidence sequence at the stop; dataset rows give counts only."
        if report.sequential is not None
        else "The interval is Tango's score interval for (gained - lost) / n."
    )
    undecided = (
        " Judged pairs the judge could not decide are in n but not in lost or gained; the interval's lower "
        "end counts them as lost, its upper end as gained."
        if report.judge is not None
        else ""
    )
    return [
        *lines,
        "",
        f"lost = baseline right, candidate wrong; gained = the reverse; net = gained - lost. {detail} The "
        "exact p is McNemar's conditional binomial test (decided pairs only). The pooled row "
        f"decides.{undecided}",
        "",
    ]


def _pilot_lines(report: ReportData) -> list[str]:
    p = report.pilot
    if p is None:
        return ["## Pilot", "", "No question has both of its answers yet.", ""]
    m = _m(report)
    sampling = report.run.registered.sampling
    if p.mode == "noise":
        head = [
            "## Pilot: run-to-run noise of the baseline",
            "",
            f"The baseline answered {p.n} questions twice (the second pass with fresh per-question seeds, "
            f"nothing cached). {p.flips} questions flipped between the passes.",
        ]
        if sampling is not None and sampling.temperature == 0:
            head.append(
                "At temperature 0 this measures only the nondeterminism of the engine or server "
                "(the other requests in a batch, floating point), not sampling noise."
            )
    else:
        head = [
            "## Pilot: how often the candidate changes the baseline's outcome",
            "",
            f"Both arms answered {p.n} questions: the candidate lost {p.lost} and gained {p.gained} "
            f"({p.flips} flips). Later gate runs in this store leave these questions out, so the run that "
            "decides is not the one that planned it.",
        ]
    rate = (
        f"No question flipped, so the flip rate is not known: zero flips in {p.n} questions are also likely "
        f"at rates up to {_pct(p.flip_rate_upper)} (one-sided 95% upper confidence bound)."
        if p.flips == 0
        else f"Flip rate {_pct(p.flip_rate)}, 95% Wilson interval [{_pct(p.flip_rate_low)}, "
        f"{_pct(p.flip_rate_high)}], one-sided 95% upper bound {_pct(p.flip_rate_upper)}."
    )
    observed = "" if p.questions_needed is None else f" (at the observed rate: {p.questions_needed})"
    return [
        *head,
        rate,
        f"Accuracy: {_pct(p.accuracy_first)} then {_pct(p.accuracy_second)} (exact McNemar p = "
        f"{p.exact_p:.3g}).",
        "",
        f"To show non-inferiority within the registered margin of {m} points with {POWER_PCT} power (alpha "
        f"{report.alpha:g}) if the candidate is truly as accurate, a fixed run needs about "
        f"**{p.questions_needed_upper}** questions, planned from the upper bound of the flip rate{observed}. "
        "A sequential run (`gate run --sequential`) can stop earlier when the evidence is clear.",
        "",
    ]


def _speed_lines(report: ReportData) -> list[str]:
    if not report.speeds:
        return []
    lines = [
        "## Speed (measured in this run)",
        "",
        "| arm | answers | output tokens/s | tokens/s per request | mean latency (s) | "
        "mean acceptance length | acceptance rate | forgiven share |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in report.speeds:
        label = (
            s.arm if report.run.kind != "pilot" or s.arm == "candidate" else f"{s.arm} (pass {s.repeat + 1})"
        )
        absent = "not reported"
        length = _num(s.mean_acceptance_length, 2) if s.acceptance_reported else absent
        rate = _pct(s.acceptance_rate) if s.acceptance_reported else absent
        forgiven = _pct(s.forgiven_share) if s.forgiven_reported else absent
        tps = _num(s.tokens_per_s, 1) if s.tokens_per_s is not None else "shared engine"
        lines.append(
            f"| {label} | {s.answers} | {tps} | {_num(s.request_tokens_per_s, 1)} | "
            f"{_num(s.mean_latency_s, 2)} | {length} | {rate} | {forgiven} |"
        )
    lines.append("")
    for shared in report.shared:
        lines.append(
            f"One engine answered {shared.lanes.replace('#0', '').replace('+', ' and ')} side by side in the "
            f"same batches: {_num(shared.tokens_per_s, 1)} output tokens/s together over its busy time."
        )
    lines += [
        "",
        "Output tokens/s = an arm's generated tokens over its engine's busy time (or, for an endpoint, the "
        "wall time of its requests). Tokens/s per request = tokens over the summed request latencies: for "
        "arms in one engine, the same batches at the same time, so they compare directly. Mean acceptance "
        "length = 1 + accepted / drafts (tokens per target forward); forgiven share = accepted draft tokens "
        "that only the lossy policy's rule kept; 'not reported' means the server did not return the counter.",
        "",
    ]
    return lines


def _registration_lines(report: ReportData) -> list[str]:
    run = report.run
    reg = run.registered
    lines = ["## Registration", ""]
    lines.append(
        f"- margin {run.margin:g} ({100 * run.margin:g} points), alpha {run.alpha:g} (one-sided), seed "
        f"{run.seed}, registered before the first answer; design: {reg.design_name}"
    )
    sampling = reg.sampling or SamplingRecord()
    lines.append(
        f"- sampling: temperature {sampling.temperature}, top_p {sampling.top_p}, "
        f"max_tokens {sampling.max_tokens}; per-question seeds shared by the arms"
    )
    order = reg.order
    if order is not None:
        lines.append(f"- question order: {order.rule} with seed {order.seed} (pool {order.pool})")
    if reg.excluded is not None and reg.excluded.runs:
        lines.append(f"- left out: {reg.excluded.questions} questions used by {', '.join(reg.excluded.runs)}")
    for name, info in reg.datasets.items():
        lines.append(f"- dataset `{name}`: {info.questions} questions, sha256 {str(info.sha256)[:16]}...")
    lines += _arm_lines(report)
    judge = reg.judge
    if judge is not None:
        served = judge.served_model or {}
        lines.append(
            f"- judge: model `{judge.model}` (served id {served.get('id') or 'not reported'}), prompt "
            f"template {judge.template} (sha256 {judge.template_sha256}), sampling "
            f"{json.dumps(judge.sampling, sort_keys=True)}, both positions per question"
        )
    g = report.gold
    if g is not None:
        rule = "independent of the question order" if g.draw != 1 else "DEFECTIVE: the start of the order"
        lines.append(
            f"- gold labels: {100 * g.rate:g}% of the pairs whose answers differ, draw {g.draw} ({rule}), "
            f"seed {reg.gold.seed if reg.gold is not None else None}, labelled by "
            f"{'the exact grader' if g.source == 'exact' else 'a person'}"
        )
    if run.notes.get("shared_engine"):
        lines.append(f"- {run.notes.get('shared_engine_note', 'arms shared one engine')}")
    lines += [f"- note: {note}" for note in report.notes]
    return lines


def _arm_lines(report: ReportData) -> list[str]:
    run = report.run
    fingerprints = run.notes.get("system_fingerprints", {})
    lines = []
    for name, arm in run.registered.arms.items():
        lines.append(f"- arm `{name}`: `{json.dumps(arm, sort_keys=True)}`")
        for executor in run.notes.get("executors", []):
            if "models" not in executor or name not in executor.get("arms", []):
                continue
            for url, card in executor.get("models", {}).items():
                seen = fingerprints.get(name, {}).get(url) or ["not reported"]
                root = card.get("root") or "not reported"
                lines.append(
                    f"  - served at {url}: model id {card.get('id') or 'not reported'}, root {root}, "
                    f"system_fingerprint {', '.join(seen)}"
                )
    return lines


def _source_lines(report: ReportData) -> list[str]:
    """What ``gate compare`` read, and how the margin came about (it replaces the registration)."""
    reg = report.run.registration
    lines = [
        "## Logs compared",
        "",
        f"- margin {report.run.margin:g} ({_m(report)} points), alpha {report.alpha:g} (one-sided): declared "
        "now, after the data (not a pre-registered run)",
    ]
    for side, info in reg.get("sources", {}).items():
        chosen = f", filter {info['filter']}" if info.get("filter") else ""
        lines.append(
            f"- {side}: `{info['source']}` ({info['kind']} log, scored by {info['metric']}{chosen}; "
            f"{info['samples']} samples)"
        )
    epoch = reg.get("epoch")
    epochs = reg.get("epochs") or {}
    if epoch is not None:
        lines.append(f"- epoch {epoch} of each question only (one independent pair per question)")
    elif any(v is not None for v in epochs.values()):
        chosen = ", ".join(f"{side} epoch {v}" for side, v in epochs.items() if v is not None)
        lines.append(f"- {chosen} of each question only (one independent pair per question)")
    else:
        lines.append("- one epoch per question (one independent pair per question)")
    lines.append(
        "- paired by task and question id, with the prompt, document or input hashes checked wherever both "
        "logs carry them"
    )
    return lines


def _title_lines(report: ReportData) -> list[str]:
    kind = report.run.kind
    if kind == "compare":
        return ["# flyspec quality gate: comparing existing logs (margin declared after the data)", ""]
    design = f", {report.design}" if kind == "gate" else ""
    return [f"# flyspec quality gate: run `{report.run.run_id}` ({kind}{design})", ""]


def _warning_lines(report: ReportData) -> list[str]:
    return [line for warning in report.warnings for line in (f"> **WARNING:** {warning}", "")]


def _result_lines(report: ReportData) -> list[str]:
    """A pilot's flips, or a run's (or comparison's) decision and paired results: first each control's (a
    setting known to be harmful, which the gate must catch), then the candidate's."""
    if report.run.kind == "pilot":
        return _pilot_lines(report)
    lines: list[str] = []
    for control in report.family:
        lines += _control_lines(control)
    if report.family:
        lines += [f"# The candidate: `{report.comparison}` against the baseline", ""]
    return lines + _gate_lines(report)


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
            f"{when}, losing more than the {_m(control)}-point margin (interval "
            f"[{_num_pts(pooled.ci_low)}, {_num_pts(pooled.ci_high)}] points)."
        )
    if pooled.decision == PASS:
        return (
            f"Control `{control.comparison}` PASSed after {n} questions{when}: the setting expected to be "
            "harmful was shown to lose less than the margin, so the control did not do its job here (check "
            "that it really is worse on these questions)."
        )
    return (
        f"Control `{control.comparison}` is not decided yet after {n} questions (interval "
        f"[{_num_pts(pooled.ci_low)}, {_num_pts(pooled.ci_high)}] points against -{_m(control)})."
    )


def _num_pts(value: float | None) -> str:
    return "-" if value is None else points(value)


def _control_lines(control: ReportData) -> list[str]:
    alpha = f"alpha {control.alpha:g} of the run's {control.family_alpha or control.alpha:g}"
    return [
        f"# Control: `{control.comparison}` against the baseline (must FAIL; {alpha})",
        "",
        control_sentence(control),
        "",
        *_gate_lines(control),
    ]


def _provenance_lines(report: ReportData) -> list[str]:
    """What was compared: the logs (``gate compare``) or the run's registration."""
    return _source_lines(report) if report.run.kind == "compare" else _registration_lines(report)


# The report's sections, in order: a new section is a function of the report here.
SECTIONS = (_title_lines, _warning_lines, _result_lines, _speed_lines, _provenance_lines)


def markdown(report: ReportData) -> str:
    """The whole report as markdown: every section of SECTIONS in turn."""
    return "\n".join(line for section in SECTIONS for line in section(report)) + "\n"


def plot_png(report: ReportData) -> bytes:
    """A PNG of each interval against the margin (matplotlib, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [c for c in report.comparisons if c.ci_low is not None and c.ci_high is not None]
    fig, ax = plt.subplots(figsize=(7, 1.2 + 0.6 * max(len(rows), 1)))
    colours = {PASS: "tab:green", FAIL: "tab:red", INCONCLUSIVE: "tab:orange"}
    for i, c in enumerate(rows):
        assert c.ci_low is not None and c.ci_high is not None
        y = len(rows) - 1 - i
        colour = colours.get(c.decision or "", "grey")
        ax.plot([100 * c.ci_low, 100 * c.ci_high], [y, y], color=colour, linewidth=3)
        if c.net_difference is not None:
            ax.plot([100 * c.net_difference], [y], "o", color="black")
    margin = report.run.margin
    ax.axvline(-100 * margin, color="tab:red", linestyle="--", label=f"-margin ({-100 * margin:g})")
    ax.axvline(0, color="grey", linewidth=1)
    ax.set_yticks(range(len(rows)), [c.scope for c in reversed(rows)])
    kind = "confidence sequence at the stop" if report.sequential is not None else "Tango interval"
    if report.gold is not None:
        kind = f"prediction-powered {'confidence sequence at the stop' if report.sequential else 'interval'}"
    ax.set_xlabel(f"candidate - baseline accuracy (points), {100 * report.level:g}% {kind}")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return buffer.getvalue()


def html_page(report: ReportData) -> str:
    """A self-contained HTML page: the markdown report as preformatted text plus the embedded plot."""
    image = ""
    if report.run.kind != "pilot" and any(c.ci_low is not None for c in report.comparisons):
        encoded = base64.b64encode(plot_png(report)).decode()
        image = f'<img alt="interval vs margin" src="data:image/png;base64,{encoded}">'
    title = html.escape(f"flyspec gate: {report.run.run_id}")
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title>"
        "<style>body{font-family:sans-serif;max-width:60em;margin:2em auto}"
        "pre{white-space:pre-wrap}</style></head><body>"
        f"<h1>{title}</h1>{image}<pre>{html.escape(markdown(report))}</pre></body></html>\n"
    )
