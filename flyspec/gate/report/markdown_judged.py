"""The markdown of a judged run: the judge's rulings and how the prediction-powered decision rests on its
gold labels (the sections ``markdown.py`` adds for a run with a judge)."""

from __future__ import annotations

from collections.abc import Mapping

from flyspec.gate.report.model import GoldSummary, JudgeSummary, ReportData, pct
from flyspec.gate.stats.decide import INCONCLUSIVE


def gold_line(report: ReportData) -> str:
    """Beside a judged run's decision: the gold labels it rests on and the judge's agreement with them."""
    g = report.gold
    assert g is not None
    who = "the exact grader" if g.source == "exact" else "a person (`flyspec gate label`)"
    agreement = (
        f"The judge agreed with gold on {pct(g.agreement)} of the {g.labelled} labelled pairs (95% interval "
        f"[{pct(g.agreement_low)}, {pct(g.agreement_high)}])."
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
    return (
        f"Gold labels: {g.labelled} of the {g.selected} pairs drawn for one ({100 * g.rate:g}% of the pairs "
        "whose answers differ, drawn at random, independently of the question order, by a rule fixed before "
        f"the first answer), labelled by {who}. {agreement}{waiting}{advice}"
    )


def gold_mcnemar_line(g: GoldSummary) -> str:
    """McNemar's exact test on the gold labels, beside a judged run's decision."""
    row = g.rows[-1]
    return (
        f"Exact McNemar test on the gold labels, beside the decision: of the {row.labelled} labelled pairs, "
        f"the label found the baseline's answer better in {row.gold_baseline}, the candidate's in "
        f"{row.gold_candidate} and neither in {row.gold_equal} (two-sided p = {g.gold_exact_p:.3g})."
    )


def _judge_sampling(report: ReportData) -> Mapping[str, object]:
    judge = report.run.registered.judge
    return judge.sampling if judge is not None else {}


def judge_lines(report: ReportData) -> list[str]:
    """How a judged run decides on its gold labels (prediction-powered inference), in words and counts:
    the judge's verdicts, the labels and the position bias."""
    j, g = report.judge, report.gold
    if j is None or g is None:
        return []
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
        f"{g.labelled} | {g.awaiting} | {pct(g.agreement)} "
        f"[{pct(g.agreement_low)}, {pct(g.agreement_high)}] |",
        "",
    ]
    return [*lines, _position_bias(j), ""]


def _position_bias(j: JudgeSummary) -> str:
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


def _proven(report: ReportData, g: GoldSummary) -> str:
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


def gold_table(report: ReportData) -> list[str]:
    """A judged run's pairs per dataset: the judge's verdicts and the gold labels, never an accuracy (a
    verdict says which answer is better, not whether either is right), and the pooled interval."""
    g = report.gold
    pooled = report.pooled
    assert g is not None and pooled is not None
    m = report.margin_points
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
