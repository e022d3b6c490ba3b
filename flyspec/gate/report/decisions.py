"""How a report reaches its decision (docs/statistics.md, "The decision rule"): ``evidence`` gathers one
comparison's registered rule and its stored pairs, ``Rule.decide`` (flyspec/gate/stats/decide.py) decides,
and ``report_fixed``, ``report_sequential`` or ``report_judged`` lay the outcome out in rows beside the
counts, the exact McNemar test and, for a judged run, the gold labels.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace

from flyspec.gate.data.results import Correct, evidence, grades, stored_pairs
from flyspec.gate.data.spec import Gold
from flyspec.gate.data.store import GateStore
from flyspec.gate.report.model import Comparison, Exploratory, GoldRow, GoldSummary, ReportData
from flyspec.gate.stats.decide import (
    INCONCLUSIVE,
    Evidence,
    JudgedDecision,
    Outcome,
    Rule,
    Walk,
    judged_decision,
)
from flyspec.gate.stats.judged import JudgedPair, judge_counts
from flyspec.gate.stats.label_advice import LabelAdvice, labels_needed
from flyspec.gate.stats.monitor import in_order_judged
from flyspec.gate.stats.paired import mcnemar, noninferiority
from flyspec.gate.stats.sizing import plan_noninferiority

Lane = tuple[str, int]
Pair = tuple[bool, bool]
"""(baseline correct, candidate correct) of one question."""
Groups = dict[str, tuple[int, list[Pair]]]
"""Pairs by dataset (or task): (registered questions, complete pairs)."""
Decided = tuple[Rule, Evidence, Outcome]
"""A comparison's registered rule, its evidence and the outcome ``Rule.decide`` gave on it."""

POWER = 0.80


def paired_counts(pairs: list[Pair]) -> tuple[int, int, int]:
    lost = sum(1 for b, c in pairs if b and not c)
    gained = sum(1 for b, c in pairs if c and not b)
    return len(pairs), lost, gained


def counted(scope: str, pairs: list[Pair], registered: int, alpha: float) -> Comparison:
    """Counts, accuracies and the exact McNemar test of the pairs; no interval and no decision."""
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
    )


def _decided(
    row: Comparison, pairs: list[Pair], margin: float, alpha: float, final: Outcome | None = None
) -> Comparison:
    """A fixed-size row decided by ``Rule.decide`` at its registered size (INCONCLUSIVE before, with the
    reading at the pairs in hand kept as ``interim_decision``), with the non-inferiority p and, when
    INCONCLUSIVE, the questions a fixed run would need at its flip rate."""
    if row.n == 0:
        return replace(row, decision=INCONCLUSIVE)
    evidence = Evidence([int(c) - int(b) for b, c in pairs])
    final = final or Rule(margin, alpha, row.registered).decide(evidence)
    now = final if final.final else Rule(margin, alpha, row.n).decide(evidence)
    row = replace(
        row,
        ci_low=now.low,
        ci_high=now.high,
        noninferiority_p=noninferiority(row.n, row.lost, row.gained, margin, alpha).p_value,
        decision=final.decision,
        interim_decision=None if final.final else now.decision,
        loss_detected=now.loss_detected,
    )
    if now.decision != INCONCLUSIVE:
        return row
    plan = plan_noninferiority(row.lost + row.gained, row.n, margin, alpha, POWER)
    return replace(
        row,
        questions_needed=plan.questions,
        questions_needed_at_observed=plan.questions_at_observed,
        flip_rate_upper=plan.flip_rate_upper,
        more_questions=max(0, plan.questions - row.n),
    )


def warn_incomplete(report: ReportData, complete: int, registered: int) -> None:
    if complete < registered and report.sequential_plan is None:
        report.warnings.append(
            f"only {complete} of {registered} registered questions have both answers; the run is incomplete "
            "(rerun `gate run` with the same arguments to finish it). Counts cover complete pairs; the "
            "decision stays INCONCLUSIVE until every registered question is answered."
        )


def by_dataset(
    store: GateStore, run_id: str, lanes: tuple[Lane, Lane], correct: Correct, limit: int | None = None
) -> Groups:
    """Per dataset: (registered count, complete pairs), over the first ``limit`` registered questions."""
    first, second = lanes
    registered: dict[str, int] = defaultdict(int)
    pairs: dict[str, list[Pair]] = defaultdict(list)
    for i, q in enumerate(store.questions(run_id)):
        registered[q.dataset] += 1
        a = correct.get((*first, q.dataset, q.question_id))
        b = correct.get((*second, q.dataset, q.question_id))
        if a is not None and b is not None and (limit is None or i < limit):
            pairs[q.dataset].append((a, b))
    return {ds: (registered[ds], pairs[ds]) for ds in registered}


def pooled_pairs(groups: Groups) -> list[Pair]:
    """The pairs of every group, pooled."""
    return [pair for _, pairs in groups.values() for pair in pairs]


def fixed_rows(
    groups: Groups, margin: float, alpha: float, pooled_outcome: Outcome | None = None
) -> list[Comparison]:
    """Each group's fixed-size comparison (a dataset's, or a compared log's task), then the pooled one:
    counts, exact McNemar, and ``decide`` on Tango's interval (INCONCLUSIVE without pairs)."""
    pooled = (sum(size for size, _ in groups.values()), pooled_pairs(groups))
    return [
        _decided(counted(scope, pairs, registered, alpha), pairs, margin, alpha)
        for scope, (registered, pairs) in groups.items()
    ] + [_decided(counted("pooled", pooled[1], pooled[0], alpha), pooled[1], margin, alpha, pooled_outcome)]


def report_fixed(report: ReportData, store: GateStore, correct: Correct, decided: Decided) -> None:
    """A fixed run's rows at its registered size: each dataset's, and the pooled one that decides."""
    reg = report.registered
    per = by_dataset(store, report.run.run_id, reg.lanes, correct)
    report.comparisons = fixed_rows(per, reg.margin, reg.alpha, decided[2])
    pooled = report.comparisons[-1]
    warn_incomplete(report, pooled.n, pooled.registered)
    if report.margin_overridden and pooled.n:
        rule, evidence, _ = decided
        other = replace(rule, margin=report.margin).decide(evidence)
        report.exploratory = Exploratory(
            report.margin, other.decision, other.low, other.high, other.stopped_at, other.loss_detected
        )


def report_sequential(report: ReportData, store: GateStore, correct: Correct, decided: Decided) -> None:
    """A sequential run's rows, at the stop its walk reaches along the registered order."""
    reg = report.registered
    rule, evidence, stop = decided
    order = [(q.dataset, q.question_id) for q in store.questions(report.run.run_id)]
    per, pooled = _at_stop(report, store, correct, order, stop)
    # Dataset rows count the pairs the decision used; a fixed-n interval at a stop the data chose would not
    # be valid, and only the pooled sequence decides.
    report.comparisons = [*(counted(ds, p, size, reg.alpha) for ds, (size, p) in per.items()), pooled]
    if report.margin_overridden:
        other = replace(rule, margin=report.margin).decide(evidence)
        report.exploratory = Exploratory(
            report.margin, other.decision, other.low, other.high, other.stopped_at, other.loss_detected
        )


def _at_stop(
    report: ReportData, store: GateStore, correct: Correct, order: list[tuple[str, str]], stop: Outcome
) -> tuple[Groups, Comparison]:
    """A sequential run at its stop: the stop on the report, with the minutes of answering until the pair
    that decided was stored (None when it has not decided); the pairs by dataset up to the stop, and the
    pooled row with the sequence's bounds there."""
    run, reg = report.run, report.registered
    assert reg.sequential is not None
    report.sequential = stop
    if stop.reason == "boundary" and stop.stopped_at >= 1:
        times = store.answer_times(run.run_id)
        wanted = {(*lane, *key) for key in order[: stop.stopped_at] for lane in reg.lanes}
        stamps = [times[k] for k in wanted if k in times]
        if len(stamps) == len(wanted):
            report.decided_after_minutes = answering_minutes(store, run.run_id, max(stamps))
    per = by_dataset(store, run.run_id, reg.lanes, correct, limit=stop.stopped_at)
    row = counted("pooled", pooled_pairs(per), reg.sequential.max_questions, report.alpha)
    if row.n == 0:
        return per, replace(row, decision=INCONCLUSIVE)
    return per, replace(
        row, ci_low=stop.low, ci_high=stop.high, decision=stop.decision, loss_detected=stop.loss_detected
    )


def answering_minutes(store: GateStore, run_id: str, until: float | None = None) -> float:
    """Minutes a run spent answering up to ``until`` (seconds since the epoch; default: its last stored
    answer), summed over its sessions from each start event to its stop (models' loading excluded); a
    session without a stop (running, or killed) counts up to ``until``."""
    if until is None:
        until = max(store.answer_times(run_id).values(), default=0.0)
    sessions: list[tuple[float, float]] = []
    began: float | None = None
    for e in store.events(run_id):
        if e.event == "start":
            began = e.created_at
        elif e.event == "stop" and began is not None:
            sessions.append((began, e.created_at))
            began = None
    if began is not None:
        sessions.append((began, until))
    return sum(max(0.0, min(end, until) - start) for start, end in sessions) / 60


def report_judged(report: ReportData, store: GateStore, correct: Correct, decided: Decided) -> None:
    """A judged run registered with gold labels: the prediction-powered decision (docs/statistics.md), fixed
    (the plug-in bet tuned to the registered size, once every registered pair is in and labelled) or
    sequential (the anytime mixture along the registered order, stopping at its first crossing). The rows
    count pairs, the judge's verdicts and the gold labels; no accuracy is built from the judge's verdicts
    (a judge's "the baseline is at least as good" is not "the baseline is right")."""
    run, reg = report.run, report.registered
    gold, (_, _, outcome) = reg.gold, decided
    assert gold is not None
    order = [(q.dataset, q.question_id) for q in store.questions(run.run_id)]
    judged = {(q.dataset, q.question_id) for q in store.questions(run.run_id) if gold.judged(q.grader)}
    seen = in_order_judged(order, stored_pairs(store, run, reg.lanes, gold))
    plan = reg.sequential
    if plan is not None:
        per, row = _at_stop(report, store, correct, order, outcome)
        limit = outcome.stopped_at
        walk = judged_decision(seen[:limit], reg.margin, reg.alpha, gold.rate, "sequential", bet=gold.bet)
    else:
        limit = len(order)
        per = by_dataset(store, report.run.run_id, reg.lanes, correct)
        everything = pooled_pairs(per)
        # The reading at the pairs in hand (and the values behind it) for the interim and the gold rows.
        walk = judged_decision(
            seen, reg.margin, reg.alpha, gold.rate, "fixed", horizon=len(order), bet=gold.bet
        )
        row = replace(
            counted("pooled", everything, len(order), reg.alpha),
            ci_low=outcome.low,
            ci_high=outcome.high,
            decision=outcome.decision,
            interim_decision=None if outcome.final or not walk.usable else walk.decision,
            loss_detected=outcome.loss_detected,
        )
        _warn_unlabelled(report, len(everything), len(order), walk.usable)
    rows = [
        _without_verdict_accuracy(counted(ds, p, size, reg.alpha), judged, ds)
        for ds, (size, p) in per.items()
    ]
    # The label advice is for runs of the registered size (a sequential run's most questions).
    size = plan.max_questions if plan is not None else len(order)
    report.gold = _gold_summary(
        gold, seen, order, limit, walk, _label_advice(walk, seen, size, reg.margin, reg.alpha)
    )
    report.comparisons = [*rows, _judged_pooled(row, walk.estimate, report.gold.rows[-1], reg.alpha)]
    if walk.narrow and walk.low <= walk.high:
        report.warnings.append(_narrow_warning(walk))


def _without_verdict_accuracy(row: Comparison, judged: set[tuple[str, str]], dataset: str) -> Comparison:
    """A dataset row of a judged run: accuracies only where no question was graded by the judge (its
    "correct" is a verdict, not a grade); McNemar's test there is on the exact grades."""
    if not any(ds == dataset for ds, _ in judged):
        return row
    return replace(row, baseline_accuracy=None, candidate_accuracy=None, net_difference=None)


def _judged_pooled(row: Comparison, estimate: float | None, gold: GoldRow, alpha: float) -> Comparison:
    """The pooled row of a judged run: no accuracy from verdicts; the estimate is the prediction-powered
    one (the mean of the values the interval is built on), not the judge's count; McNemar's test, reported
    beside the decision, is on the gold labels (``lost``/``gained`` stay the judge's verdicts)."""
    test = mcnemar(gold.gold_baseline, gold.gold_candidate)
    return replace(
        row,
        baseline_accuracy=None,
        candidate_accuracy=None,
        net_difference=estimate,
        exact_p=test.exact_p,
        mid_p=test.mid_p,
        significant_loss=gold.gold_baseline > gold.gold_candidate and test.exact_p < 2 * alpha,
    )


def _label_advice(
    walk: JudgedDecision, seen: list[JudgedPair], size: int, margin: float, alpha: float
) -> LabelAdvice | None:
    """How many gold labels would let runs like this one decide (None when it decided, or has no pair):
    from every complete pair, the judge's verdicts and the labels given so far, those past the decision's
    prefix too (the advice plans a run; it is no part of the test)."""
    if walk.decision != INCONCLUSIVE or not seen:
        return None
    return labels_needed(judge_counts(seen), margin, alpha, walk.design, size, seen, walk.bet)


def _gold_summary(
    gold: Gold,
    seen: list[JudgedPair],
    order: list[tuple[str, str]],
    limit: int,
    walk: JudgedDecision,
    advice: LabelAdvice | None,
) -> GoldSummary:
    """The gold labels and the judge's counts over the complete pairs along the order, with the rows of
    the pairs the decision used (per dataset and pooled)."""
    counts = judge_counts(seen)
    rows: dict[str, GoldRow] = {}
    pooled = GoldRow("pooled")
    for (dataset, _), pair in zip(order[:limit], seen[:limit], strict=False):
        for row in (rows.setdefault(dataset, GoldRow(dataset)), pooled):
            _count(row, pair)
    return GoldSummary(
        rate=gold.rate,
        source=gold.source,
        pairs=counts.n,
        identical=counts.identical,
        lost=counts.lost,
        gained=counts.gained,
        undecided=counts.undecided,
        selected=counts.selected,
        labelled=counts.labelled,
        awaiting=sum(p.waiting for p in seen),
        agreement=counts.agreement,
        agreement_low=counts.agreement_low,
        agreement_high=counts.agreement_high,
        advice=advice.describe() if advice is not None else None,
        labels_needed=advice.labels if advice is not None else None,
        advised_rate=advice.rate if advice is not None else None,
        draw=gold.draw,
        bet=gold.bet,
        rows=[*rows.values(), pooled],
        gold_exact_p=mcnemar(pooled.gold_baseline, pooled.gold_candidate).exact_p
        if pooled.labelled
        else None,
        estimate=walk.estimate,
        normal_width=walk.normal_width,
        narrow=walk.narrow,
    )


def _count(row: GoldRow, pair: JudgedPair) -> None:
    row.pairs += 1
    if pair.identical:
        row.identical += 1
        return
    row.judge_baseline += pair.prediction == -1
    row.judge_candidate += pair.prediction == 1
    row.judge_other += pair.prediction not in (-1, 1)
    row.selected += pair.selected
    if pair.gold is not None:
        row.labelled += 1
        row.gold_baseline += pair.gold == -1
        row.gold_equal += pair.gold == 0
        row.gold_candidate += pair.gold == 1


def _warn_unlabelled(report: ReportData, answered: int, registered: int, usable: int) -> None:
    """A fixed judged run decides once every registered question has both answers and every drawn pair
    its gold label; say which of the two is missing."""
    if answered < registered:
        warn_incomplete(report, answered, registered)
    elif usable < registered:
        report.warnings.append(
            f"all {registered} registered questions have both answers, but the pair at place {usable + 1} of "
            "the registered order (and maybe later ones) waits for its gold label: the decision stays "
            "INCONCLUSIVE until every drawn pair is labelled (`flyspec gate label`)."
        )


def _narrow_warning(walk: JudgedDecision) -> str:
    """The words for a judged interval much narrower than its values allow (``JudgedDecision.narrow``)."""
    width = 100 * (walk.high - walk.low)
    reference = f"{100 * walk.normal_width:.2f}" if walk.normal_width is not None else "?"
    emptied = (
        f" After pair {walk.emptied_at} no value of the difference was left in the confidence set."
        if walk.emptied_at is not None
        else ""
    )
    cause = (
        " With the registered draw this happened in no simulated run (docs/statistics.md); check that the "
        "labels were given for the pairs shown, and treat the decision with suspicion."
    )
    return (
        f"THE FINAL INTERVAL IS ONLY {width:.2f} POINTS WIDE, less than half of a normal-theory interval "
        f"from the same values ({reference} points).{emptied} A valid run's running bounds rarely meet like "
        "this: the values' mean most likely changed along the order, which the interval assumes it does not."
        + cause
    )


@dataclass(frozen=True)
class Step:
    """The ``1 - 2 alpha`` bounds of the net difference (candidate minus baseline, a fraction) after the
    first ``n`` pairs in the registered order."""

    n: int
    low: float
    high: float


def interval_path(store: GateStore, run_id: str) -> list[Step]:
    """The bounds after each pair the decision of sequential run ``run_id`` used (empty before the first),
    walked along the same evidence as ``Rule.decide`` (the shadow's /status plots them); its last step is
    the report's interval at the stop. ValueError for a run that is not sequential."""
    run = store.get_run(run_id)
    if run is None:
        raise ValueError(f"run {run_id!r} is not in {store.path}")
    reg = run.registered
    if reg.sequential is None:
        raise ValueError(f"run {run_id!r} is not sequential: its interval is read once, not after each pair")
    rule, data = evidence(store, run, reg, grades(store.answers(run_id)))
    walk = _Recorded(rule.walk())
    rule.decide(data, walk)  # type: ignore[arg-type]
    return walk.steps


class _Recorded:
    """A walk that keeps its bounds after each pair ``Rule.decide`` adds (so the path is walked once)."""

    def __init__(self, walk: Walk) -> None:
        self.walk = walk
        self.steps: list[Step] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self.walk, name)

    def add(self, item: int | JudgedPair) -> None:
        self.walk.add(item)
        self.steps.append(Step(self.walk.n, self.walk.low, self.walk.high))
