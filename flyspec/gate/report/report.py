"""The gate report: paired counts, exact tests, the interval against the margin, the decision, and speed.

The decision (docs/gate.md) is taken on the registered margin, on the pooled complete pairs:

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
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from flyspec.gate.data.store import AnswerRecord, GateStore, RunRecord
from flyspec.gate.stats.decision import FAIL, INCONCLUSIVE, PASS
from flyspec.gate.stats.monitor import CS_METHOD, SequentialPlan, SequentialStop, sequential_stop
from flyspec.gate.stats.paired import (
    decide_with_undecided,
    mcnemar,
    noninferiority,
    plan_noninferiority,
    wilson_interval,
)

POWER = 0.80
Lane = tuple[str, int]
__all__ = ["FAIL", "INCONCLUSIVE", "PASS", "Comparison", "Report", "build_report", "compare_pairs"]


@dataclass
class Comparison:
    """Baseline vs candidate on one dataset (or pooled over all of them).

    ``decision`` is None for a dataset row of a sequential run: only the pooled sequence decides.
    ``lost``/``gained`` count decided pairs; ``undecided`` the judged pairs the judge could not decide, which
    the decision counts as lost when testing for PASS (``ci_low``) and as gained when testing for FAIL
    (``ci_high``).
    """

    scope: str
    n: int
    registered: int
    baseline_accuracy: float | None
    candidate_accuracy: float | None
    lost: int
    gained: int
    net: int
    net_difference: float | None
    flip_rate: float | None
    exact_p: float
    mid_p: float
    ci_low: float | None
    ci_high: float | None
    noninferiority_p: float | None
    significant_loss: bool
    decision: str | None
    loss_detected: bool = False
    questions_needed: int | None = None
    questions_needed_at_observed: int | None = None
    flip_rate_upper: float | None = None
    more_questions: int | None = None
    interim_decision: str | None = None
    undecided: int = 0


@dataclass
class ArmSpeed:
    """Speed of one arm (one repeat) measured in this run.

    ``tokens_per_s``: the arm's tokens over its executor's busy time (None when the arm shared its engine
    with another arm: see ``Report.shared``). ``request_tokens_per_s``: tokens over the summed request
    latencies, comparable between arms that ran side by side in the same batches. Acceptance fields are
    None when the source did not report them (``acceptance_reported``), never zero.
    """

    arm: str
    repeat: int
    answers: int
    completion_tokens: int
    wall_s: float
    tokens_per_s: float | None
    request_tokens_per_s: float | None
    mean_latency_s: float | None
    mean_acceptance_length: float | None
    acceptance_rate: float | None
    forgiven_share: float | None
    acceptance_reported: bool = True
    forgiven_reported: bool = True


@dataclass
class SharedThroughput:
    """Tokens/s of an engine that answered several arms' requests in the same batches."""

    lanes: str
    answers: int
    completion_tokens: int
    wall_s: float
    tokens_per_s: float | None


@dataclass
class PilotSummary:
    """A pilot's flips between its two lanes (the baseline twice, or baseline and candidate) and the
    sample size they imply; planned from the flip rate's upper confidence bound."""

    mode: str
    n: int
    flips: int
    lost: int
    gained: int
    flip_rate: float
    flip_rate_low: float
    flip_rate_high: float
    flip_rate_upper: float
    accuracy_first: float
    accuracy_second: float
    exact_p: float
    questions_needed: int | None
    questions_needed_upper: int


@dataclass
class NoiseReference:
    """The baseline's own run-to-run flips, measured by a noise pilot on the same data."""

    run_id: str
    n: int
    flips: int
    flip_rate: float
    low: float
    high: float


@dataclass
class JudgeSummary:
    """How the judge ruled on the judged questions with both answers stored, and its position bias.

    ``baseline_better`` (both orders preferred the baseline: lost), ``candidate_better`` (gained),
    ``ties`` (both orders said tie), ``identical`` (the same answer twice: a tie, the judge not asked),
    ``disagree`` (the orders said different things) and ``unreadable_pairs`` (a verdict could not be read)
    add up to ``questions``. The last two are ``undecided``: counted as lost when testing for PASS and as
    gained when testing for FAIL. ``disagreement_rate`` is ``undecided`` over the questions the judge was
    asked about. ``unreadable`` counts the verdicts that could not be read; ``chose_a``/``chose_b`` count
    the decisive verdicts by the position of the answer chosen.
    """

    model: str
    template: str
    questions: int
    baseline_better: int
    candidate_better: int
    disagree: int
    ties: int
    verdicts: int
    unreadable: int
    chose_a: int
    chose_b: int
    position_p: float
    identical: int = 0
    unreadable_pairs: int = 0
    undecided: int = 0
    disagreement_rate: float | None = None


@dataclass
class Exploratory:
    """A decision at a margin other than the registered one: for exploration only."""

    margin: float
    decision: str
    low: float | None
    high: float | None
    n: int
    loss_detected: bool


@dataclass
class Report:
    """Everything ``gate report`` shows; ``to_markdown``, ``to_dict`` and ``to_html`` render it."""

    store: str
    run: RunRecord
    margin: float
    margin_overridden: bool
    alpha: float
    level: float
    comparisons: list[Comparison] = field(default_factory=list)
    speeds: list[ArmSpeed] = field(default_factory=list)
    shared: list[SharedThroughput] = field(default_factory=list)
    pilot: PilotSummary | None = None
    sequential: SequentialStop | None = None
    sequential_plan: SequentialPlan | None = None
    exploratory: Exploratory | None = None
    noise: NoiseReference | None = None
    judge: JudgeSummary | None = None
    explanation: list[str] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def registered_margin(self) -> float:
        return self.run.margin

    @property
    def pooled(self) -> Comparison | None:
        """The pooled comparison (None for a pilot)."""
        return next((c for c in self.comparisons if c.scope == "pooled"), None)

    @property
    def decision(self) -> str | None:
        """The registered pooled decision of a gate run (None for a pilot)."""
        pooled = self.pooled
        return pooled.decision if pooled is not None else None

    @property
    def design(self) -> str:
        return "sequential" if self.sequential_plan is not None else "fixed"

    def rule(self) -> str:
        """The decision rule in plain words."""
        from flyspec.gate.report.render import rule

        return rule(self)

    def decision_object(self) -> dict[str, Any]:
        """The decision object (the last key of ``to_dict``): registered margin, pooled pairs."""
        pooled = self.pooled
        assert pooled is not None
        return {
            "decision": pooled.decision,
            "registered_decision": pooled.decision,
            "pre_registered": self.run.kind != "compare",
            "design": self.design,
            "method": CS_METHOD if self.sequential_plan is not None else "tango",
            "scope": "pooled",
            "margin": self.run.margin,
            "alpha": self.alpha,
            "level": self.level,
            "n": pooled.n,
            "lost": pooled.lost,
            "gained": pooled.gained,
            "undecided": pooled.undecided,
            "counts_for_pass": {"lost": pooled.lost + pooled.undecided, "gained": pooled.gained},
            "counts_for_fail": {"lost": pooled.lost, "gained": pooled.gained + pooled.undecided},
            "disagreement_rate": self.judge.disagreement_rate if self.judge is not None else None,
            "net_difference": pooled.net_difference,
            "low": pooled.ci_low,
            "high": pooled.ci_high,
            "ci": [pooled.ci_low, pooled.ci_high],
            "loss_detected": pooled.loss_detected,
            "exact_p": pooled.exact_p,
            "mid_p": pooled.mid_p,
            "significant_loss": pooled.significant_loss,
            "noninferiority_p": pooled.noninferiority_p,
            "questions_needed": pooled.questions_needed,
            "questions_needed_at_observed": pooled.questions_needed_at_observed,
            "flip_rate_upper": pooled.flip_rate_upper,
            "more_questions": pooled.more_questions,
            "interim_decision": pooled.interim_decision,
            "explanation": self.explanation,
            "advice": self.advice,
            "rule": self.rule(),
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready report; for a gate run the last key is ``decision``."""
        out: dict[str, Any] = {
            "store": self.store,
            "run_id": self.run.run_id,
            "kind": self.run.kind,
            "design": self.design,
            "registered_margin": self.run.margin,
            "margin": self.margin,
            "margin_overridden": self.margin_overridden,
            "alpha": self.alpha,
            "level": self.level,
            "warnings": self.warnings,
            "registration": self.run.registration,
            "run_notes": self.run.notes,
            "comparisons": [asdict(c) for c in self.comparisons],
            "speeds": [asdict(s) for s in self.speeds],
            "shared_engine_speeds": [asdict(s) for s in self.shared],
            "noise": asdict(self.noise) if self.noise is not None else None,
            "judge": asdict(self.judge) if self.judge is not None else None,
            "notes": self.notes,
        }
        if self.run.kind == "pilot":
            out["pilot"] = asdict(self.pilot) if self.pilot is not None else None
            return out
        out["registered_decision"] = self.decision
        out["exploratory"] = asdict(self.exploratory) if self.exploratory is not None else None
        if self.sequential is not None and self.sequential_plan is not None:
            out["sequential"] = {
                **asdict(self.sequential),
                "max_questions": self.sequential_plan.max_questions,
                "population_size": self.sequential_plan.population_size,
                "order_seed": self.sequential_plan.order_seed,
                "method": CS_METHOD,
            }
        out["decision"] = self.decision_object()
        return out

    def to_markdown(self) -> str:
        """The report as markdown (what ``gate report`` prints)."""
        from flyspec.gate.report.render import markdown

        return markdown(self)

    def to_html(self) -> str:
        """A self-contained HTML page: the markdown report plus the interval-vs-margin plot."""
        from flyspec.gate.report.render import html_page

        return html_page(self)


# ------------------------------------------------------------------------------------ comparisons


def _plan_fields(n: int, flips: int, margin: float, alpha: float) -> dict[str, Any]:
    plan = plan_noninferiority(flips, n, margin, alpha, POWER)
    return {
        "questions_needed": plan.questions,
        "questions_needed_at_observed": plan.questions_at_observed,
        "flip_rate_upper": plan.flip_rate_upper,
        "more_questions": max(0, plan.questions - n),
    }


def _counts(pairs: list[tuple[bool, bool]]) -> tuple[int, int, int]:
    lost = sum(1 for b, c in pairs if b and not c)
    gained = sum(1 for b, c in pairs if c and not b)
    return len(pairs), lost, gained


def _counted(
    scope: str, pairs: list[tuple[bool, bool]], registered: int, alpha: float, undecided: int = 0
) -> Comparison:
    """Counts, accuracies and the exact McNemar test of the pairs; no interval and no decision.
    ``undecided`` of the pairs (each graded wrong on both sides) are judged pairs the judge could not
    decide; McNemar, reported beside the decision, uses the decided pairs only."""
    n, lost, gained = _counts(pairs)
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
    comparison = _counted(scope, pairs, registered, alpha, undecided)
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


def _sequential_row(
    stop: SequentialStop, pairs: list[tuple[bool, bool]], registered: int, alpha: float
) -> Comparison:
    """The pooled row of a sequential run: the pairs up to the stop and the sequence's bounds there."""
    row = _counted("pooled", pairs, registered, alpha, stop.undecided)
    if not pairs:
        return replace(row, decision=INCONCLUSIVE)
    return replace(
        row, ci_low=stop.low, ci_high=stop.high, decision=stop.decision, loss_detected=stop.loss_detected
    )


# -------------------------------------------------------------------------------------- speeds


def measure_speeds(
    answers: list[AnswerRecord], batches: list[tuple[str, int, int, int, float]]
) -> tuple[list[ArmSpeed], list[SharedThroughput]]:
    """Each lane's speed from its stored answers (counters, latencies) and recorded batches (busy time),
    and the throughput of engines that several lanes shared."""
    wall: dict[tuple[str, int], float] = defaultdict(float)
    tokens: dict[tuple[str, int], int] = defaultdict(int)
    shared: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0])
    for arm, repeat, answered, batch_tokens, wall_s in batches:
        if "+" in arm:
            row = shared[arm]
            row[0] += answered
            row[1] += batch_tokens
            row[2] += wall_s
            continue
        wall[(arm, repeat)] += wall_s
        tokens[(arm, repeat)] += batch_tokens
    grouped: dict[tuple[str, int], list[AnswerRecord]] = defaultdict(list)
    for a in answers:
        grouped[(a.arm, a.repeat)].append(a)
    speeds = [_arm_speed(arm, repeat, rows, wall, tokens) for (arm, repeat), rows in sorted(grouped.items())]
    throughput = [
        SharedThroughput(label, int(n), int(t), w, t / w if w > 0 else None)
        for label, (n, t, w) in shared.items()
    ]
    return speeds, throughput


def _arm_speed(
    arm: str,
    repeat: int,
    rows: list[AnswerRecord],
    wall: dict[tuple[str, int], float],
    tokens: dict[tuple[str, int], int],
) -> ArmSpeed:
    counted = [r for r in rows if r.num_drafts is not None]
    num_drafts = sum(r.num_drafts or 0 for r in counted)
    draft_tokens = sum(r.num_draft_tokens or 0 for r in counted)
    accepted = sum(r.num_accepted_tokens or 0 for r in counted)
    forgiven_rows = [r for r in counted if r.num_forgiven_tokens is not None]
    forgiven = sum(r.num_forgiven_tokens or 0 for r in forgiven_rows)
    w = wall.get((arm, repeat), 0.0)
    latency = sum(r.latency_s for r in rows)
    generated = sum(r.completion_tokens for r in rows)
    forgiven_ok = bool(counted) and len(forgiven_rows) == len(counted)
    return ArmSpeed(
        arm=arm,
        repeat=repeat,
        answers=len(rows),
        completion_tokens=generated,
        wall_s=w,
        tokens_per_s=tokens[(arm, repeat)] / w if w > 0 else None,
        request_tokens_per_s=generated / latency if latency > 0 else None,
        mean_latency_s=latency / len(rows),
        mean_acceptance_length=1 + accepted / num_drafts if num_drafts else None,
        acceptance_rate=accepted / draft_tokens if draft_tokens else None,
        forgiven_share=forgiven / accepted if accepted and forgiven_ok else None,
        acceptance_reported=bool(counted),
        forgiven_reported=forgiven_ok,
    )


# ----------------------------------------------------------------------------------------- pilot


def _lanes(run: RunRecord) -> tuple[Lane, Lane]:
    """The two lanes being paired: two passes of the baseline in a noise pilot, baseline vs candidate
    otherwise."""
    mode = run.registration.get("pilot", {}).get("mode", "noise") if run.kind == "pilot" else None
    return (("baseline", 0), ("baseline", 1)) if mode == "noise" else (("baseline", 0), ("candidate", 0))


def _pilot(
    run: RunRecord, pairs: list[tuple[bool, bool]], margin: float, alpha: float
) -> PilotSummary | None:
    n, lost, gained = _counts(pairs)
    if n == 0:
        return None
    flips = lost + gained
    low, high = wilson_interval(flips, n)
    plan = plan_noninferiority(flips, n, margin, alpha, POWER)
    return PilotSummary(
        mode=run.registration.get("pilot", {}).get("mode", "noise"),
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
    datasets = run.registration.get("datasets", {})
    return json.dumps({name: info.get("sha256") for name, info in datasets.items()}, sort_keys=True)


def _noise(store: GateStore, run: RunRecord) -> NoiseReference | None:
    """The latest noise pilot on the same data with the same sampling, if any."""
    for other in reversed(store.runs()):
        if other.kind != "pilot" or _lanes(other)[1] != ("baseline", 1):
            continue
        same_data = _data_key(other) == _data_key(run)
        if not same_data or other.registration.get("sampling") != run.registration.get("sampling"):
            continue
        correct = {
            (a.arm, a.repeat, a.dataset, a.question_id): a.correct for a in store.answers(other.run_id)
        }
        pairs = _pairs(store, other, correct)
        n, lost, gained = _counts(pairs)
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
    first, second = _lanes(run)
    out = []
    for q in store.questions(run.run_id):
        a = correct.get((*first, q.dataset, q.question_id))
        b = correct.get((*second, q.dataset, q.question_id))
        if a is not None and b is not None:
            out.append((a, b))
    return out


def build_report(
    store: str | Path | GateStore, run_id: str | None = None, margin: float | None = None
) -> Report:
    """Build the report of a run (the latest one when ``run_id`` is None) from the stored answers.

    ``margin`` other than the registered one adds an exploratory decision at that margin (with a loud
    warning); the registered decision, and everything that depends on it, stays as registered.
    """
    if isinstance(store, GateStore):
        return _build(store, run_id, margin)
    path = Path(store)
    if not path.is_file():
        raise FileNotFoundError(f"store {path} does not exist")
    with GateStore(path) as opened:
        return _build(opened, run_id, margin)


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


def _build(store: GateStore, run_id: str | None, margin: float | None) -> Report:
    notes: list[str] = []
    run = _pick_run(store, run_id, notes)
    if run.kind in ("tune", "calibration"):
        tune = run.registration.get("calibration", {}).get("tune") or run.run_id
        raise ValueError(
            f"run {run.run_id!r} is part of a gate tune: its report is `flyspec gate report --store "
            f"{store.path} --run {tune}` (a calibration run measures speed only and is never graded)"
        )
    overridden = margin is not None and margin != run.margin
    if overridden and (isinstance(margin, bool) or not isinstance(margin, int | float) or not 0 < margin < 1):
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
    if "sequential" in run.registration:
        _sequential(report, store, correct)
    else:
        _fixed(report, store, correct)
    report.noise = _noise(store, run)
    pooled = report.pooled
    if pooled is not None and pooled.decision == PASS and pooled.significant_loss:
        notes.append(
            "the candidate loses significantly more questions than it gains (exact McNemar), but the loss is "
            "shown to be smaller than the margin, so it passes; check that the margin is really acceptable"
        )
    from flyspec.gate.report.render import advice, explanation

    report.explanation = explanation(report)
    report.advice = advice(report)
    return report


def _judge_summary(store: GateStore, run: RunRecord, answers: list[AnswerRecord]) -> JudgeSummary | None:
    """The judge's rulings on the judged questions whose two answers are stored (the verdicts on exactly
    those two outputs)."""
    from flyspec.gate.grading.judge import UNDECIDED, outcome, pair_hash, preferred
    from flyspec.gate.run.judging import lane_label

    judge = run.registration.get("judge")
    if not isinstance(judge, dict):
        return None
    first, second = _lanes(run)
    labels = (lane_label(first), lane_label(second))
    outputs = {(a.arm, a.repeat, a.dataset, a.question_id): a.output for a in answers}
    verdicts: dict[tuple[str, str, str, str], str | None] = {}
    for j in store.judgements(run.run_id):
        if (j.first_lane, j.second_lane) == labels:
            verdicts[(j.dataset, j.question_id, j.position, j.pair_sha256)] = j.verdict
    counts = {"first": 0, "second": 0, "tie": 0, "identical": 0, "disagree": 0, "unreadable": 0}
    said: list[str | None] = []
    for q in store.questions(run.run_id):
        if q.grader != "judge":
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
        model=str(judge.get("model")),
        template=f"{judge.get('template')} (sha256 {str(judge.get('template_sha256'))[:12]})",
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
    return {(q.dataset, q.question_id) for q in store.questions(run.run_id) if q.grader == "judge"}


def _by_dataset(store: GateStore, run: RunRecord, correct: dict, limit: int | None = None) -> dict[str, Any]:
    """Per dataset: (registered count, complete pairs, undecided pairs among them), over the first
    ``limit`` registered questions."""
    first, second = _lanes(run)
    registered: dict[str, int] = defaultdict(int)
    pairs: dict[str, list[tuple[bool, bool]]] = defaultdict(list)
    undecided: dict[str, int] = defaultdict(int)
    for i, q in enumerate(store.questions(run.run_id)):
        registered[q.dataset] += 1
        a = correct.get((*first, q.dataset, q.question_id))
        b = correct.get((*second, q.dataset, q.question_id))
        if a is not None and b is not None and (limit is None or i < limit):
            pairs[q.dataset].append((a, b))
            undecided[q.dataset] += q.grader == "judge" and not a and not b
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
    plan = SequentialPlan.from_registration(run.registration["sequential"])
    order = [(q.dataset, q.question_id) for q in store.questions(run.run_id)]
    events = store.events(run.run_id)
    judged = _judged(store, run)
    stop = sequential_stop(order, correct, plan, events, judged=judged)
    report.sequential, report.sequential_plan = stop, plan
    per = _by_dataset(store, run, correct, limit=stop.stopped_at)
    # Dataset rows count the pairs the decision used; a fixed-n interval at a stop the data chose would not
    # be valid, and only the pooled sequence decides.
    report.comparisons = [_counted(ds, p, reg, run.alpha, u) for ds, (reg, p, u) in per.items()]
    used = [pair for _, p, _ in per.values() for pair in p]
    report.comparisons.append(_sequential_row(stop, used, plan.max_questions, run.alpha))
    if report.margin_overridden:
        other = sequential_stop(order, correct, replace(plan, margin=report.margin), events, judged=judged)
        report.exploratory = Exploratory(
            report.margin, other.decision, other.low, other.high, other.stopped_at, other.loss_detected
        )
