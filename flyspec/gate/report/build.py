"""``build_report``: a run's report from its store. It picks the run, reads its answers and decides by the
route its design registered (decisions.py; the rule is flyspec/gate/stats/decide.py's). ``margin=`` other
than the registered one adds an exploratory decision and changes nothing else (docs/statistics.md, "The
decision rule"). Also the alpha ledger's view of a comparison and the labelling page's reading."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from flyspec.checks import is_number
from flyspec.gate.data.ledger import run_entries, store_entries
from flyspec.gate.data.results import evidence, grades, measure_speeds
from flyspec.gate.data.spec import Registration
from flyspec.gate.data.store import AnswerRecord, GateStore, RunRecord
from flyspec.gate.grading.graders import UNDECIDED, lane_label, model_graded, outcome, pair_hash, preferred
from flyspec.gate.report.advice import advice, explanation
from flyspec.gate.report.decisions import (
    POWER,
    Pair,
    by_dataset,
    paired_counts,
    pooled_pairs,
    report_fixed,
    report_judged,
    report_sequential,
    warn_incomplete,
)
from flyspec.gate.report.markdown import html_page, markdown
from flyspec.gate.report.model import (
    Comparison,
    JudgeSummary,
    LedgerSummary,
    NoiseReference,
    PilotSummary,
    ReportData,
)
from flyspec.gate.stats.decide import FAIL, INCONCLUSIVE, PASS
from flyspec.gate.stats.paired import mcnemar, wilson_interval
from flyspec.gate.stats.sizing import plan_noninferiority
from flyspec.gate.stats.spending import alpha_left, budget_of, counted

__all__ = ["FAIL", "INCONCLUSIVE", "PASS", "Comparison", "Report", "build_report"]


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


def _pilot(reg: Registration, pairs: list[Pair]) -> PilotSummary | None:
    """A pilot's flips between its two lanes and the sample size they imply for its registered margin."""
    n, lost, gained = paired_counts(pairs)
    if n == 0:
        return None
    flips = lost + gained
    low, high = wilson_interval(flips, n)
    plan = plan_noninferiority(flips, n, reg.margin, reg.alpha, POWER)
    return PilotSummary(
        mode=reg.pilot_mode or "noise",
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
        correct = grades(store.answers(other.run_id))
        pairs = pooled_pairs(by_dataset(store, other.run_id, other.registered.lanes, correct))
        n, lost, gained = paired_counts(pairs)
        if n:
            low, high = wilson_interval(lost + gained, n)
            return NoiseReference(other.run_id, n, lost + gained, (lost + gained) / n, low, high)
    return None


def _margin_conflicts(store: GateStore, run: RunRecord, margin: float) -> str | None:
    same = [r for r in store.runs() if r.kind == "gate" and _data_key(r) == _data_key(run)]
    margins = {r.margin for r in same}
    if len(margins) < 2:
        return None
    listing = ", ".join(f"{r.run_id!r} (margin {100 * r.margin:g} points)" for r in same)
    return (
        f"THIS STORE HOLDS {len(same)} GATE RUNS ON THE SAME DATA WITH DIFFERENT MARGINS: {listing}. "
        "Picking the run whose margin gives the answer you want is choosing the margin after the data; "
        f"this report is for {run.run_id!r}, registered with {100 * margin:g} points."
    )


# ----------------------------------------------------------------------------------------- build


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
    with opened(store) as gate_store:
        notes: list[str] = []
        run = _pick_run(gate_store, run_id, notes)
        plans = list(run.registered.comparisons) if run.kind == "gate" else []
        if comparison is not None and comparison not in {p.name for p in plans}:
            names = ", ".join(p.name for p in plans) or "none"
            raise ValueError(f"run {run.run_id!r} has no comparison {comparison!r} (comparisons: {names})")
        if len(plans) < 2:
            return _build(gate_store, run, run.registered, margin, notes)
        chosen = next(p for p in plans if p.name == (comparison or plans[0].name))
        report = _build(gate_store, run, run.registered.for_comparison(chosen), margin, notes)
        family = run.registered.family
        report.family_alpha = family.alpha if family is not None else run.alpha
        if comparison is None:
            report.family = [
                _build(gate_store, run, run.registered.for_comparison(p), None, []) for p in plans[1:]
            ]
            for member in report.family:
                member.family_alpha = report.family_alpha
        return report


@contextmanager
def opened(store: str | Path | GateStore) -> Iterator[GateStore]:
    """``store`` open for a block: an open store as it is, a path opened for the block (and closed after
    it); FileNotFoundError when there is no store at the path."""
    if isinstance(store, GateStore):
        yield store
        return
    path = Path(store)
    if not path.is_file():
        raise FileNotFoundError(f"store {path} does not exist")
    with GateStore(path) as store_at_path:
        yield store_at_path


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


def _build(
    store: GateStore, run: RunRecord, reg: Registration, margin: float | None, notes: list[str]
) -> Report:
    """The report of ``run`` as registration ``reg`` (the run's own, or one comparison's view) reads it:
    its answers, speeds and judge, then the decision by the design it registered."""
    report = _report_of(store, run, reg, margin, notes)
    answers = store.answers(run.run_id)
    correct = grades(answers)
    report.speeds, report.shared = measure_speeds(answers, store.batches(run.run_id))
    report.judge = _judge_summary(store, run.run_id, reg, answers)
    if run.kind == "pilot":
        pairs = pooled_pairs(by_dataset(store, run.run_id, reg.lanes, correct))
        report.pilot = _pilot(reg, pairs)
        warn_incomplete(report, len(pairs), len(store.questions(run.run_id)))
        return report
    rule, data = evidence(store, run, reg, correct)
    decided = (rule, data, rule.decide(data))
    if reg.gold is not None:
        report_judged(report, store, correct, decided)
    elif reg.sequential is not None:
        report_sequential(report, store, correct, decided)
    else:
        report_fixed(report, store, correct, decided)
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


def _report_of(
    store: GateStore, run: RunRecord, reg: Registration, margin: float | None, notes: list[str]
) -> Report:
    """An empty report of ``run`` as ``reg`` reads it, at ``margin`` (the registered one unless another is
    given), with the warnings of the store and the margin; a tune's runs are refused, naming its report."""
    if run.kind in ("tune", "calibration"):
        tune = reg.tune_name or run.run_id
        raise ValueError(
            f"run {run.run_id!r} is part of a gate tune: its report is `flyspec gate report --store "
            f"{store.path} --run {tune}` (a calibration run measures speed only and is never graded)"
        )
    overridden = margin is not None and margin != reg.margin
    if overridden and not is_number(margin, above=0, below=1):
        raise ValueError(f"margin={margin!r}: must lie in (0, 1)")
    report = Report(
        store=str(store.path),
        run=run,
        registered=reg,
        margin=float(margin) if overridden else reg.margin,  # type: ignore[arg-type]
        margin_overridden=overridden,
        alpha=reg.alpha,
        level=1 - 2 * reg.alpha,
        notes=notes,
    )
    conflict = _margin_conflicts(store, run, reg.margin)
    if conflict is not None:
        report.warnings.append(conflict)
    if overridden:
        report.warnings.append(
            f"USING MARGIN {margin:g} INSTEAD OF THE REGISTERED {reg.margin:g} FOR AN EXPLORATORY DECISION. "
            "A margin chosen after seeing results invalidates the test; the registered decision, the JSON's "
            "`registered_decision` and the exit code stay those of the registered margin."
        )
    return report


def _judge_summary(
    store: GateStore, run_id: str, reg: Registration, answers: list[AnswerRecord]
) -> JudgeSummary | None:
    """The judge's rulings on the judged questions whose two answers are stored (the verdicts on exactly
    those two outputs)."""
    judge = reg.judge
    if judge is None:
        return None
    first, second = reg.lanes
    labels = (lane_label(first), lane_label(second))
    outputs = {(a.arm, a.repeat, a.dataset, a.question_id): a.output for a in answers}
    verdicts: dict[tuple[str, str, str, str], str | None] = {}
    for j in store.judgements(run_id):
        if (j.first_lane, j.second_lane) == labels:
            verdicts[(j.dataset, j.question_id, j.position, j.pair_sha256)] = j.verdict
    counts = {"first": 0, "second": 0, "tie": 0, "identical": 0, "disagree": 0, "unreadable": 0}
    said: list[str | None] = []
    for q in store.questions(run_id):
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


def ledger_summary(store: GateStore, run: RunRecord, comparison: str) -> LedgerSummary | None:
    """The ledger's view of one comparison of ``run`` (None when the run is no look)."""
    snapshot = run.notes.get("ledger")
    if isinstance(snapshot, dict):
        data = snapshot.get("comparisons", {}).get(comparison)
        if isinstance(data, dict):
            return LedgerSummary(
                comparison,
                str(snapshot.get("path")),
                data.get("claim"),
                float(data["alpha"]),
                float(data["budget"]),
                float(data["spent_before"]),
                [str(e) for e in data.get("earlier", [])],
            )
    mine = next((e for e in run_entries(store, run) if e.comparison == comparison), None)
    if mine is None:
        return None
    before = [e.look for e in store_entries(store) if e.key == mine.key and e.created_at < run.created_at]
    earlier = counted(before, mine.look.questions, mine.look.claim)
    budget = budget_of(earlier) or mine.look.budget or mine.look.alpha
    spent = budget - alpha_left(budget, earlier)
    described = list({look.id: look.describe() for look in earlier}.values())
    return LedgerSummary(comparison, None, mine.look.claim, mine.look.alpha, budget, spent, described, True)


class LabelProgress(TypedDict):
    """What the labelling page shows of a run's report (``label_progress``)."""

    decision: str | None
    interim: str | None
    low: float | None
    high: float | None
    margin: float
    judge_agreement: float | None
    labels_needed: int | None
    advised_rate: float | None
    gold_rate: float | None
    advice: str | None


_readings: dict[tuple[Path, str], tuple[tuple[object, ...], LabelProgress]] = {}


def label_progress(store_path: Path, run_id: str) -> LabelProgress:
    """What the labelling page shows of the run's report: its decision (None while drawn pairs wait), its
    interval and margin, the judge's agreement with gold and the label advice. The page asks after every
    label and a sequential report simulates its advice, so the report is built again only when the run's
    rows changed (``GateStore.revision``)."""
    with GateStore(store_path) as store:
        revision = store.revision(run_id)
    kept = _readings.get((store_path, run_id))
    if kept is not None and kept[0] == revision:
        return kept[1]
    reading = _read(store_path, run_id)
    _readings[(store_path, run_id)] = (revision, reading)
    return reading


def _read(store_path: Path, run_id: str) -> LabelProgress:
    report = build_report(store_path, run_id)
    pooled, gold = report.pooled, report.gold
    interim = pooled.interim_decision if pooled is not None else None
    return {
        "decision": pooled.decision if pooled is not None and interim is None else None,
        "interim": interim,
        "low": pooled.ci_low if pooled is not None else None,
        "high": pooled.ci_high if pooled is not None else None,
        "margin": report.registered.margin,
        "judge_agreement": gold.agreement if gold is not None else None,
        "labels_needed": gold.labels_needed if gold is not None else None,
        "advised_rate": gold.advised_rate if gold is not None else None,
        "gold_rate": gold.rate if gold is not None else None,
        "advice": gold.advice if gold is not None else None,
    }
