"""How a report reaches its decision, by the run's registered design (docs/statistics.md, "The decision
rule"): ``decide_report`` takes the judged route (prediction-powered, on gold labels), the sequential one (the
run's walk replayed along the registered order, flyspec/gate/stats/monitor.py) or the fixed one (Tango's
interval per dataset and pooled, ``stats.decide``); every verdict comes from flyspec/gate/stats/decide.py.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from typing import Any

from flyspec.gate.data.judged_pairs import stored_pairs
from flyspec.gate.data.spec import Gold
from flyspec.gate.data.store import GateStore, RunEvent, RunRecord
from flyspec.gate.grading.graders import model_graded
from flyspec.gate.report.comparisons import compare_pairs, counted, sequential_row
from flyspec.gate.report.model import Comparison, Exploratory, GoldRow, GoldSummary, ReportData
from flyspec.gate.stats.decide import INCONCLUSIVE
from flyspec.gate.stats.judged import JudgedDecision, JudgedPair, judge_counts, judged_decision
from flyspec.gate.stats.monitor import in_order_judged, judged_stop, sequential_stop
from flyspec.gate.stats.paired import mcnemar

OLD_JUDGED_WARNING = (
    "THIS JUDGED RUN WAS REGISTERED BEFORE GOLD LABELS: its decision follows the old rule (pairs the "
    "judge could not decide count against the claim), which a judge that cannot tell the answers "
    "apart can push to PASS a harmful candidate when few answers differ (docs/gate.md, 'Open-ended "
    "answers: the judge'). Rerun it as a judged run with gold labels (--gold-rate) before acting on "
    "it."
)

DEFECTIVE_DRAW_WARNING = (
    "THIS JUDGED RUN WAS REGISTERED WITH THE DEFECTIVE GOLD-LABEL DRAW (draw 1): the draw hashed the same "
    "string as the question order, so the pairs drawn for a gold label were exactly the differing pairs at "
    "the start of the order and none after. The 1/rate weight of the prediction-powered interval assumes a "
    "random subset, so it was invalid, and after that prefix the judge's verdicts counted uncorrected: a "
    "judge whose errors favour the candidate could make this run PASS a harmful candidate (simulated: a "
    "judge right on the candidate's losses and calling its gains ties PASSed a candidate exactly at the "
    "margin in about 99% of runs). The decision below is recomputed as it was stored; it is not a valid "
    "test. Do not act on it: start a new judged run, which draws its labels independently of the order."
)


Lane = tuple[str, int]


def decide_report(report: ReportData, store: GateStore, correct: dict) -> None:
    """Fill the report's comparisons and decision by the run's registered design, with the warnings a
    judged run registered before gold labels, or with the defective draw, carries."""
    run = report.run
    gold = run.registered.gold
    if gold is None and run.registered.judge is not None:
        report.warnings.append(OLD_JUDGED_WARNING)
    if gold is not None and gold.defective:
        report.warnings.append(DEFECTIVE_DRAW_WARNING)
    if gold is not None:
        _judged_run(report, store, correct, gold)
    elif run.registered.sequential is not None:
        _sequential(report, store, correct)
    else:
        _fixed(report, store, correct)


def _comparison_events(events: list[RunEvent], name: str) -> list[RunEvent]:
    """A run's session events with each stop placed where this comparison's sequence was (a run with
    several comparisons records every comparison's prefix in the stop's detail)."""
    out = []
    for e in events:
        reached = e.detail.get("stopped_at") if isinstance(e.detail, dict) else None
        if isinstance(reached, dict) and name in reached:
            e = replace(e, stopped_at=reached[name])
        out.append(e)
    return out


def warn_incomplete(report: ReportData, complete: int, registered: int) -> None:
    if complete < registered and report.sequential_plan is None:
        report.warnings.append(
            f"only {complete} of {registered} registered questions have both answers; the run is incomplete "
            "(rerun `gate run` with the same arguments to finish it). Counts cover complete pairs; the "
            "decision stays INCONCLUSIVE until every registered question is answered."
        )


def _judged(store: GateStore, run: RunRecord) -> set[tuple[str, str]]:
    """The questions of the run graded by a judge."""
    return {(q.dataset, q.question_id) for q in store.questions(run.run_id) if model_graded(q.grader)}


def _by_dataset(store: GateStore, run: RunRecord, correct: dict, limit: int | None = None) -> dict[str, Any]:
    """Per dataset: (registered count, complete pairs, undecided pairs among them), over the first
    ``limit`` registered questions."""
    first, second = run.registered.lanes
    registered: dict[str, int] = defaultdict(int)
    pairs: dict[str, list[tuple[bool, bool]]] = defaultdict(list)
    undecided: dict[str, int] = defaultdict(int)
    for i, q in enumerate(store.questions(run.run_id)):
        registered[q.dataset] += 1
        a = correct.get((*first, q.dataset, q.question_id))
        b = correct.get((*second, q.dataset, q.question_id))
        if a is not None and b is not None and (limit is None or i < limit):
            pairs[q.dataset].append((a, b))
            undecided[q.dataset] += model_graded(q.grader) and not a and not b
    return {ds: (registered[ds], pairs[ds], undecided[ds]) for ds in registered}


def _fixed(report: ReportData, store: GateStore, correct: dict) -> None:
    run = report.run
    per = _by_dataset(store, run, correct)
    report.comparisons = [
        compare_pairs(ds, p, reg, run.margin, run.alpha, u) for ds, (reg, p, u) in per.items()
    ]
    everything = [pair for _, p, _ in per.values() for pair in p]
    registered = sum(reg for reg, _, _ in per.values())
    undecided = sum(u for _, _, u in per.values())
    report.comparisons.append(
        compare_pairs("pooled", everything, registered, run.margin, run.alpha, undecided)
    )
    warn_incomplete(report, len(everything), registered)
    # A pre-registered run is decided at its registered size: deciding on a partial run would be optional
    # stopping. The interim reading is kept, labelled as such.
    for c in report.comparisons:
        if 0 < c.n < c.registered:
            c.interim_decision, c.decision = c.decision, INCONCLUSIVE
    pooled = report.comparisons[-1]
    if report.margin_overridden and pooled.n:
        other = compare_pairs("pooled", everything, registered, report.margin, run.alpha, undecided)
        decision = other.decision if pooled.n == registered else INCONCLUSIVE
        report.exploratory = Exploratory(
            report.margin, decision or INCONCLUSIVE, other.ci_low, other.ci_high, other.n, other.loss_detected
        )


def _sequential(report: ReportData, store: GateStore, correct: dict) -> None:
    run = report.run
    plan = run.registered.sequential
    assert plan is not None
    order = [(q.dataset, q.question_id) for q in store.questions(run.run_id)]
    lanes = run.registered.lanes
    events = _comparison_events(store.events(run.run_id), lanes[1][0])
    judged = _judged(store, run)
    stop = sequential_stop(order, correct, plan, events, lanes, judged=judged)
    report.decided_after_minutes = _answering_minutes(store, run, order, lanes, stop)
    report.sequential, report.sequential_plan = stop, plan
    per = _by_dataset(store, run, correct, limit=stop.stopped_at)
    # Dataset rows count the pairs the decision used; a fixed-n interval at a stop the data chose would not
    # be valid, and only the pooled sequence decides.
    report.comparisons = [counted(ds, p, reg, run.alpha, u) for ds, (reg, p, u) in per.items()]
    used = [pair for _, p, _ in per.values() for pair in p]
    report.comparisons.append(sequential_row(stop, used, plan.max_questions, run.alpha))
    if report.margin_overridden:
        other = sequential_stop(
            order, correct, replace(plan, margin=report.margin), events, lanes, judged=judged
        )
        report.exploratory = Exploratory(
            report.margin, other.decision, other.low, other.high, other.stopped_at, other.loss_detected
        )


def _answering_minutes(
    store: GateStore, run: RunRecord, order: list[tuple[str, str]], lanes: tuple[Lane, Lane], stop: Any
) -> float | None:
    """Minutes of answering until the pair that decided a sequential comparison was stored; None when it
    has not decided."""
    if stop.reason != "boundary" or stop.stopped_at < 1:
        return None
    times = store.answer_times(run.run_id)
    wanted = {(*lane, *key) for key in order[: stop.stopped_at] for lane in lanes}
    stamps = [times[k] for k in wanted if k in times]
    if len(stamps) < len(wanted):
        return None
    return answering_minutes(store, run.run_id, max(stamps))


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


def _judged_run(report: ReportData, store: GateStore, correct: dict, gold: Gold) -> None:
    """A judged run registered with gold labels: the prediction-powered decision (docs/statistics.md), fixed
    (the plug-in bet tuned to the registered size, once every registered pair is in and labelled) or
    sequential (the anytime mixture along the registered order, stopping at its first crossing). The rows
    count pairs, the judge's verdicts and the gold labels; no accuracy is built from the judge's verdicts
    (a judge's "the baseline is at least as good" is not "the baseline is right")."""
    run = report.run
    lanes = run.registered.lanes
    order = [(q.dataset, q.question_id) for q in store.questions(run.run_id)]
    judged = {(q.dataset, q.question_id) for q in store.questions(run.run_id) if gold.judged(q.grader)}
    pairs = stored_pairs(store, run, lanes, gold)
    seen = in_order_judged(order, pairs)
    plan = run.registered.sequential
    if plan is not None:
        events = _comparison_events(store.events(run.run_id), lanes[1][0])
        stop = judged_stop(order, pairs, plan, events)
        report.sequential, report.sequential_plan = stop, plan
        report.decided_after_minutes = _answering_minutes(store, run, order, lanes, stop)
        limit = stop.stopped_at
        per = _by_dataset(store, run, correct, limit=limit)
        used = [pair for _, p, _ in per.values() for pair in p]
        row = sequential_row(stop, used, plan.max_questions, run.alpha)
        walk = judged_decision(seen[:limit], run.margin, run.alpha, gold.rate, "sequential")
    else:
        limit = len(order)
        per = _by_dataset(store, run, correct)
        everything = [pair for _, p, _ in per.values() for pair in p]
        walk = judged_decision(seen, run.margin, run.alpha, gold.rate, "fixed", horizon=len(order))
        complete = walk.usable == len(order)
        row = replace(
            counted("pooled", everything, len(order), run.alpha),
            ci_low=walk.low,
            ci_high=walk.high,
            decision=walk.decision if complete else INCONCLUSIVE,
            interim_decision=None if complete or not walk.usable else walk.decision,
            loss_detected=walk.loss_detected,
        )
        _warn_unlabelled(report, len(everything), len(order), walk.usable)
    rows = [
        _without_verdict_accuracy(counted(ds, p, reg, run.alpha), judged, ds)
        for ds, (reg, p, _) in per.items()
    ]
    report.gold = _gold_summary(gold, seen, order, limit, walk)
    report.comparisons = [*rows, _judged_pooled(row, walk.estimate, report.gold.rows[-1], run.alpha)]
    if walk.narrow and walk.low <= walk.high:
        report.warnings.append(_narrow_warning(walk, gold))


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


def _gold_summary(
    gold: Gold, seen: list[JudgedPair], order: list[tuple[str, str]], limit: int, walk: JudgedDecision
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
        advice=walk.labels_needed.describe() if walk.labels_needed is not None else None,
        draw=gold.draw,
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


def _narrow_warning(walk: JudgedDecision, gold: Gold) -> str:
    """The words for a judged interval much narrower than its values allow (``JudgedDecision.narrow``)."""
    width = 100 * (walk.high - walk.low)
    reference = f"{100 * walk.normal_width:.2f}" if walk.normal_width is not None else "?"
    emptied = (
        f" After pair {walk.emptied_at} no value of the difference was left in the confidence set."
        if walk.emptied_at is not None
        else ""
    )
    cause = (
        " This run uses the defective gold-label draw 1, which is the known cause."
        if gold.defective
        else " With the registered draw this happened in no simulated run (docs/statistics.md); check that "
        "the labels were given for the pairs shown, and treat the decision with suspicion."
    )
    return (
        f"THE FINAL INTERVAL IS ONLY {width:.2f} POINTS WIDE, less than half of a normal-theory interval "
        f"from the same values ({reference} points).{emptied} A valid run's running bounds rarely meet like "
        "this: the values' mean most likely changed along the order, which the interval assumes it does not."
        + cause
    )
