"""The gate report: paired counts, exact tests, the interval against the margin, the decision, and speed.

The decision (docs/statistics.md, "The decision rule") is taken on the registered margin, on the pooled
complete pairs:

- a fixed run: ``stats.decide`` on Tango's ``1 - 2 alpha`` interval, once every registered question has
  both answers (deciding on part of a run would be optional stopping);
- a sequential run: the confidence sequence along the registered order, at its stopping point
  (flyspec/gate/stats/monitor.py).

PASS when the lower bound lies above ``-margin``; FAIL when the upper bound lies below ``-margin``;
INCONCLUSIVE otherwise, with ``loss_detected`` when the upper bound lies below zero. The exact McNemar
test is reported beside the decision, never instead of it. ``margin=`` other than the registered one adds
an exploratory decision and changes nothing else: not ``registered_decision``, not the decision object's
``decision``, not the exit code.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from flyspec.checks import is_number
from flyspec.gate.data.gold import Gold
from flyspec.gate.data.judged_pairs import stored_pairs
from flyspec.gate.data.registration import ComparisonPlan
from flyspec.gate.data.speeds import measure_speeds
from flyspec.gate.data.store import AnswerRecord, GateStore, RunEvent, RunRecord
from flyspec.gate.grading.graders import model_graded
from flyspec.gate.grading.judge import UNDECIDED, lane_label, outcome, pair_hash, preferred
from flyspec.gate.report.comparisons import compare_pairs, counted, paired_counts, sequential_row
from flyspec.gate.report.looks import ledger_summary
from flyspec.gate.report.model import (
    Comparison,
    Exploratory,
    GoldRow,
    GoldSummary,
    JudgeSummary,
    NoiseReference,
    PilotSummary,
    ReportData,
)
from flyspec.gate.report.render import advice, explanation, html_page, markdown
from flyspec.gate.stats.decision import FAIL, INCONCLUSIVE, PASS
from flyspec.gate.stats.judged import JudgedDecision, JudgedPair, judge_counts, judged_decision
from flyspec.gate.stats.monitor import in_order_judged, judged_stop, sequential_stop
from flyspec.gate.stats.paired import mcnemar, wilson_interval
from flyspec.gate.stats.planning import plan_noninferiority

POWER = 0.80
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
__all__ = ["FAIL", "INCONCLUSIVE", "PASS", "Comparison", "Report", "build_report", "compare_pairs"]


@dataclass
class Report(ReportData):
    """Everything ``gate report`` shows; ``to_markdown``, ``to_dict`` and ``to_html`` render it."""

    def to_markdown(self) -> str:
        """The report as markdown (what ``gate report`` prints)."""
        return markdown(self)

    def to_html(self) -> str:
        """A self-contained HTML page: the markdown report plus the interval-vs-margin plot."""
        return html_page(self)


# ----------------------------------------------------------------------------------------- pilot


def _view(run: RunRecord, plan: ComparisonPlan) -> RunRecord:
    """The run as the report of one of its comparisons sees it: that comparison's margin, alpha, sequential
    plan and candidate lane in place of the run's."""
    registered = run.registered.for_comparison(plan)
    return replace(run, margin=plan.margin, alpha=plan.alpha, registered=registered)


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


def _pilot(
    run: RunRecord, pairs: list[tuple[bool, bool]], margin: float, alpha: float
) -> PilotSummary | None:
    n, lost, gained = paired_counts(pairs)
    if n == 0:
        return None
    flips = lost + gained
    low, high = wilson_interval(flips, n)
    plan = plan_noninferiority(flips, n, margin, alpha, POWER)
    return PilotSummary(
        mode=run.registered.pilot_mode or "noise",
        n=n,
        flips=flips,
        lost=lost,
        gained=gained,
        flip_rate=flips / n,
        flip_rate_low=low,
        flip_rate_high=high,
        flip_rate_upper=plan.flip_rate_upper,
        accuracy_first=sum(a for a, _ in pairs) / n,
        accuracy_second=sum(b for _, b in pairs) / n,
        exact_p=mcnemar(lost, gained).exact_p,
        questions_needed=plan.questions_at_observed,
        questions_needed_upper=plan.questions,
    )


def _data_key(run: RunRecord) -> str:
    datasets = run.registered.datasets
    return json.dumps({name: info.sha256 for name, info in datasets.items()}, sort_keys=True)


def _noise(store: GateStore, run: RunRecord) -> NoiseReference | None:
    """The latest noise pilot on the same data with the same sampling, if any."""
    for other in reversed(store.runs()):
        if other.kind != "pilot" or other.registered.lanes[1] != ("baseline", 1):
            continue
        same_data = _data_key(other) == _data_key(run)
        if not same_data or other.registered.sampling != run.registered.sampling:
            continue
        correct = {
            (a.arm, a.repeat, a.dataset, a.question_id): a.correct for a in store.answers(other.run_id)
        }
        pairs = _pairs(store, other, correct)
        n, lost, gained = paired_counts(pairs)
        if n:
            low, high = wilson_interval(lost + gained, n)
            return NoiseReference(other.run_id, n, lost + gained, (lost + gained) / n, low, high)
    return None


def _margin_conflicts(store: GateStore, run: RunRecord) -> str | None:
    same = [r for r in store.runs() if r.kind == "gate" and _data_key(r) == _data_key(run)]
    margins = {r.margin for r in same}
    if len(margins) < 2:
        return None
    listing = ", ".join(f"{r.run_id!r} (margin {100 * r.margin:g} points)" for r in same)
    return (
        f"THIS STORE HOLDS {len(same)} GATE RUNS ON THE SAME DATA WITH DIFFERENT MARGINS: {listing}. "
        "Picking the run whose margin gives the answer you want is choosing the margin after the data; "
        f"this report is for {run.run_id!r}, registered with {100 * run.margin:g} points."
    )


# ----------------------------------------------------------------------------------------- build


def _pairs(store: GateStore, run: RunRecord, correct: dict[tuple[str, int, str, str], bool]) -> list[Any]:
    first, second = run.registered.lanes
    out = []
    for q in store.questions(run.run_id):
        a = correct.get((*first, q.dataset, q.question_id))
        b = correct.get((*second, q.dataset, q.question_id))
        if a is not None and b is not None:
            out.append((a, b))
    return out


def build_report(
    store: str | Path | GateStore,
    run_id: str | None = None,
    margin: float | None = None,
    comparison: str | None = None,
) -> Report:
    """Build the report of a run (the latest one when ``run_id`` is None) from the stored answers.

    ``margin`` other than the registered one adds an exploratory decision at that margin (with a loud
    warning); the registered decision, and everything that depends on it, stays as registered. A run with
    several comparisons (controls beside the candidate) is reported for its candidate, with each control's
    report in ``family``; ``comparison`` picks one comparison alone.
    """
    if isinstance(store, GateStore):
        return _build_family(store, run_id, margin, comparison)
    path = Path(store)
    if not path.is_file():
        raise FileNotFoundError(f"store {path} does not exist")
    with GateStore(path) as opened:
        return _build_family(opened, run_id, margin, comparison)


def _build_family(
    store: GateStore, run_id: str | None, margin: float | None, comparison: str | None
) -> Report:
    notes: list[str] = []
    run = _pick_run(store, run_id, notes)
    plans = list(run.registered.comparisons) if run.kind == "gate" else []
    if comparison is not None and comparison not in {p.name for p in plans}:
        names = ", ".join(p.name for p in plans) or "none"
        raise ValueError(f"run {run.run_id!r} has no comparison {comparison!r} (comparisons: {names})")
    if len(plans) < 2:
        return _build(store, run, margin, notes)
    chosen = next(p for p in plans if p.name == (comparison or plans[0].name))
    report = _build(store, _view(run, chosen), margin, notes)
    family = run.registered.family
    family_alpha = family.alpha if family is not None else run.alpha
    report.family_alpha = family_alpha
    if comparison is None:
        report.family = [_build(store, _view(run, p), None, []) for p in plans[1:]]
        for member in report.family:
            member.family_alpha = family_alpha
    return report


def _pick_run(store: GateStore, run_id: str | None, notes: list[str]) -> RunRecord:
    runs = store.runs()
    if not runs:
        raise ValueError(f"store {store.path} holds no runs")
    if run_id is None:
        if len(runs) > 1:
            notes.append(
                f"store holds {len(runs)} runs; reporting the latest, {runs[-1].run_id!r} (pick with --run)"
            )
        return runs[-1]
    found = store.get_run(run_id)
    if found is None:
        raise ValueError(f"run {run_id!r} is not in {store.path}; runs: {', '.join(r.run_id for r in runs)}")
    return found


def _build(store: GateStore, run: RunRecord, margin: float | None, notes: list[str]) -> Report:
    if run.kind in ("tune", "calibration"):
        tune = run.registered.tune_name or run.run_id
        raise ValueError(
            f"run {run.run_id!r} is part of a gate tune: its report is `flyspec gate report --store "
            f"{store.path} --run {tune}` (a calibration run measures speed only and is never graded)"
        )
    overridden = margin is not None and margin != run.margin
    if overridden and not is_number(margin, above=0, below=1):
        raise ValueError(f"margin={margin!r}: must lie in (0, 1)")
    report = Report(
        store=str(store.path),
        run=run,
        margin=float(margin) if overridden else run.margin,  # type: ignore[arg-type]
        margin_overridden=overridden,
        alpha=run.alpha,
        level=1 - 2 * run.alpha,
        notes=notes,
    )
    conflict = _margin_conflicts(store, run)
    if conflict is not None:
        report.warnings.append(conflict)
    if overridden:
        report.warnings.append(
            f"USING MARGIN {margin:g} INSTEAD OF THE REGISTERED {run.margin:g} FOR AN EXPLORATORY DECISION. "
            "A margin chosen after seeing results invalidates the test; the registered decision, the JSON's "
            "`registered_decision` and the exit code stay those of the registered margin."
        )
    answers = store.answers(run.run_id)
    correct = {(a.arm, a.repeat, a.dataset, a.question_id): a.correct for a in answers}
    report.speeds, report.shared = measure_speeds(answers, store.batches(run.run_id))
    report.judge = _judge_summary(store, run, answers)
    pairs = _pairs(store, run, correct)
    if run.kind == "pilot":
        report.pilot = _pilot(run, pairs, run.margin, run.alpha)
        _warn_incomplete(report, len(pairs), len(store.questions(run.run_id)))
        return report
    gold = run.registered.gold
    if gold is None and run.registered.judge is not None:
        report.warnings.append(
            "THIS JUDGED RUN WAS REGISTERED BEFORE GOLD LABELS: its decision follows the old rule (pairs the "
            "judge could not decide count against the claim), which a judge that cannot tell the answers "
            "apart can push to PASS a harmful candidate when few answers differ (docs/gate.md, 'Open-ended "
            "answers: the judge'). Rerun it as a judged run with gold labels (--gold-rate) before acting on "
            "it."
        )
    if gold is not None and gold.defective:
        report.warnings.append(DEFECTIVE_DRAW_WARNING)
    if gold is not None:
        _judged_run(report, store, correct, gold)
    elif run.registered.sequential is not None:
        _sequential(report, store, correct)
    else:
        _fixed(report, store, correct)
    report.noise = _noise(store, run)
    if run.kind == "gate":
        report.ledger = ledger_summary(store, run, report.comparison)
    pooled = report.pooled
    if pooled is not None and pooled.decision == PASS and pooled.significant_loss:
        notes.append(
            "the candidate loses significantly more questions than it gains (exact McNemar), but the loss is "
            "shown to be smaller than the margin, so it passes; check that the margin is really acceptable"
        )
    report.explanation = explanation(report)
    report.advice = advice(report)
    return report


def _judge_summary(store: GateStore, run: RunRecord, answers: list[AnswerRecord]) -> JudgeSummary | None:
    """The judge's rulings on the judged questions whose two answers are stored (the verdicts on exactly
    those two outputs)."""
    judge = run.registered.judge
    if judge is None:
        return None
    first, second = run.registered.lanes
    labels = (lane_label(first), lane_label(second))
    outputs = {(a.arm, a.repeat, a.dataset, a.question_id): a.output for a in answers}
    verdicts: dict[tuple[str, str, str, str], str | None] = {}
    for j in store.judgements(run.run_id):
        if (j.first_lane, j.second_lane) == labels:
            verdicts[(j.dataset, j.question_id, j.position, j.pair_sha256)] = j.verdict
    counts = {"first": 0, "second": 0, "tie": 0, "identical": 0, "disagree": 0, "unreadable": 0}
    said: list[str | None] = []
    for q in store.questions(run.run_id):
        if not model_graded(q.grader):
            continue
        a = outputs.get((*first, q.dataset, q.question_id))
        b = outputs.get((*second, q.dataset, q.question_id))
        if a is None or b is None:
            continue
        if a == b:
            counts["identical"] += 1
            continue
        digest = pair_hash(a, b)
        keys = [(q.dataset, q.question_id, position, digest) for position in ("AB", "BA")]
        if any(key not in verdicts for key in keys):
            continue
        ab, ba = (verdicts[key] for key in keys)
        counts[outcome(preferred("AB", ab), preferred("BA", ba))] += 1
        said += [ab, ba]
    chose_a = sum(v == "A" for v in said)
    chose_b = sum(v == "B" for v in said)
    undecided = sum(counts[k] for k in UNDECIDED)
    asked = sum(counts.values()) - counts["identical"]
    return JudgeSummary(
        model=str(judge.model),
        template=f"{judge.template} (sha256 {str(judge.template_sha256)[:12]})",
        questions=sum(counts.values()),
        baseline_better=counts["first"],
        candidate_better=counts["second"],
        disagree=counts["disagree"],
        ties=counts["tie"],
        verdicts=len(said),
        unreadable=sum(v is None for v in said),
        chose_a=chose_a,
        chose_b=chose_b,
        position_p=mcnemar(chose_a, chose_b).exact_p,
        identical=counts["identical"],
        unreadable_pairs=counts["unreadable"],
        undecided=undecided,
        disagreement_rate=undecided / asked if asked else None,
    )


def _warn_incomplete(report: Report, complete: int, registered: int) -> None:
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


def _fixed(report: Report, store: GateStore, correct: dict) -> None:
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
    _warn_incomplete(report, len(everything), registered)
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


def _sequential(report: Report, store: GateStore, correct: dict) -> None:
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
    """Minutes of answering (summed over the run's sessions, models' loading excluded) until the pair that
    decided a sequential comparison was stored; None when it has not decided."""
    if stop.reason != "boundary" or stop.stopped_at < 1:
        return None
    times = store.answer_times(run.run_id)
    wanted = {(*lane, *key) for key in order[: stop.stopped_at] for lane in lanes}
    stamps = [times[k] for k in wanted if k in times]
    if len(stamps) < len(wanted):
        return None
    decided = max(stamps)
    sessions: list[tuple[float, float]] = []
    began: float | None = None
    for e in store.events(run.run_id):
        if e.event == "start":
            began = e.created_at
        elif e.event == "stop" and began is not None:
            sessions.append((began, e.created_at))
            began = None
    if began is not None:
        sessions.append((began, decided))
    return sum(max(0.0, min(end, decided) - start) for start, end in sessions) / 60


def _judged_run(report: Report, store: GateStore, correct: dict, gold: Gold) -> None:
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


def _warn_unlabelled(report: Report, answered: int, registered: int, usable: int) -> None:
    """A fixed judged run decides once every registered question has both answers and every drawn pair
    its gold label; say which of the two is missing."""
    if answered < registered:
        _warn_incomplete(report, answered, registered)
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
