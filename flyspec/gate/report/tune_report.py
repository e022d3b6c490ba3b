"""The report of a ``gate tune``: every setting in its registered order with its speed and its test
(recomputed from the stored answers by flyspec/gate/data/results.py), the fixed-sequence answer in plain
words, and the chosen ``speculative_config`` to paste."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from flyspec.gate.data.results import SettingStatus, lane_speeds, setting_status
from flyspec.gate.data.spec import SamplingRecord, SettingRecord, TuneRecord, titled, to_json
from flyspec.gate.data.store import GateStore, RunRecord
from flyspec.gate.report.build import ledger_summary, opened
from flyspec.gate.report.model import LedgerSummary, num, pct, points
from flyspec.gate.stats.decide import INCONCLUSIVE, NOT_TESTED, PASS, fixed_sequence

Speed = dict[str, float | None]
"""A lane's speed as ``lane_speeds`` gives it: tokens/s, mean acceptance length, forgiven share, answers."""


@dataclass
class TuneRow:
    """One setting in test order (``position`` 1-based): its speed and, once tested, its test (None where
    it was not tested). Its JSON is the fields in order."""

    position: int
    id: str
    label: str
    policy: str
    speculative_config: dict[str, object]
    decision: str
    final: bool | None
    tokens_per_s: float | None
    speedup: float | None
    mean_acceptance_length: float | None
    forgiven_share: float | None
    n: int | None
    lost: int | None
    gained: int | None
    low: float | None
    high: float | None
    loss_detected: bool | None
    stop_reason: str | None
    test_mean_acceptance_length: float | None
    test_forgiven_share: float | None
    test_answers: int | None

    @property
    def title(self) -> str:
        """The label with its policy's name, e.g. ``FLy W=2, theta=0.3``."""
        return titled(self.speculative_config, self.label)


def _row(
    position: int,
    setting: SettingRecord,
    decision: str,
    tested: SettingStatus | None,
    speeds: tuple[Speed, Speed, float | None],
) -> TuneRow:
    """A setting's row: ``speeds`` are its speed, its speed on its test questions, and the baseline's
    tokens/s (for the speedup)."""
    speed, test_speed, base_tps = speeds
    tps = speed.get("tokens_per_s")
    config = dict(setting.speculative_config)
    return TuneRow(
        position=position,
        id=setting.id,
        label=setting.label,
        policy=config.get("rejection_sample_method", "standard"),
        speculative_config=config,
        decision=decision,
        final=bool(tested.final) if tested else None,
        tokens_per_s=tps,
        speedup=tps / base_tps if tps and base_tps else None,
        mean_acceptance_length=speed.get("mean_acceptance_length"),
        forgiven_share=speed.get("forgiven_share"),
        n=tested.n if tested else None,
        lost=tested.lost if tested else None,
        gained=tested.gained if tested else None,
        low=tested.low if tested else None,
        high=tested.high if tested else None,
        loss_detected=tested.loss_detected if tested else None,
        stop_reason=tested.reason if tested else None,
        test_mean_acceptance_length=test_speed.get("mean_acceptance_length"),
        test_forgiven_share=test_speed.get("forgiven_share"),
        test_answers=test_speed.get("answers"),
    )


@dataclass
class TuneReport:
    """Everything ``gate tune`` shows; ``to_markdown`` and ``to_dict`` render it."""

    store: str
    run: RunRecord
    rows: list[TuneRow]
    baseline_speed: Speed
    chosen: int | None
    complete: bool
    speed_source: str
    ledger: list[LedgerSummary] = field(default_factory=list)

    @property
    def tune(self) -> TuneRecord:
        """The tune's registration (a tune run always has one)."""
        tune = self.run.registered.tune
        assert tune is not None
        return tune

    @property
    def baseline_arm(self) -> Mapping[str, object]:
        return self.run.registered.arms.get("baseline", {})

    @property
    def margin_points(self) -> str:
        return f"{100 * self.run.margin:g}"

    @property
    def chosen_row(self) -> TuneRow | None:
        return self.rows[self.chosen] if self.chosen is not None else None

    @property
    def answer(self) -> str:
        """The answer in plain words, from the numbers."""
        chosen = self.chosen_row
        stop = next((r for r in self.rows if r.final is not None and r.decision != PASS), None)
        after = ""
        if stop is not None:
            later = sum(r.decision == NOT_TESTED for r in self.rows)
            rest = f"; the {later} setting(s) after it were not tested" if later and stop.final else ""
            after = f" The sequence stopped there: {_why_stopped(self, stop)}{rest}."
        if chosen is None:
            if self.rows[0].final is False:
                return f"No setting is chosen yet: {_why_stopped(self, self.rows[0])}."
            return (
                "No setting passed, so keep standard verification: the first setting in the registered "
                f"order did not pass.{after}"
            )
        length = chosen.mean_acceptance_length
        speed = f"mean acceptance length {length:.2f}" if length else "speed not measured"
        if chosen.speedup:
            speed = f"{chosen.speedup:.2f}x standard speed"
        last = " It is the most aggressive setting in the order." if chosen is self.rows[-1] else ""
        return (
            f"{chosen.title}: {speed}, non-inferior within {self.margin_points} points on {chosen.n:,} "
            f"questions.{last}{after}"
        )

    def to_dict(self) -> dict[str, object]:
        """JSON-ready report; ``settings`` (in test order) and ``chosen`` close it."""
        reg, chosen = self.run.registered, self.chosen_row
        return {
            "store": self.store,
            "run_id": self.run.run_id,
            "kind": "tune",
            "margin": self.run.margin,
            "alpha": self.run.alpha,
            "level": 1 - 2 * self.run.alpha,
            "design": reg.design,
            "method": reg.sequential.description
            if reg.design == "sequential" and reg.sequential
            else "tango",
            "procedure": self.tune.procedure,
            "order": to_json(self.tune.order),
            "calibration": to_json(self.tune)["calibration"],
            "speed_source": self.speed_source,
            "registration": self.run.registration,
            "baseline": {
                "speculative_config": self.baseline_arm.get("speculative_config"),
                **self.baseline_speed,
            },
            "complete": self.complete,
            "answer": self.answer,
            "notes": [],  # the key every report has; a tune's report writes no note
            "ledger": [asdict(summary) for summary in self.ledger],
            "chosen_label": chosen.label if chosen else None,
            "chosen_policy": chosen.policy if chosen else None,
            "settings": [asdict(row) for row in self.rows],
            "chosen": chosen.speculative_config if chosen else None,
        }

    def to_markdown(self) -> str:
        """The report as markdown (what ``gate tune`` prints)."""
        lines = [f"# flyspec gate tune: run `{self.run.run_id}`", ""]
        if not self.complete:
            lines += ["> **NOT FINISHED:** rerun the same `gate tune` command to continue.", ""]
        lines += ["## Answer", "", self.answer, ""]
        for section in (_paste_lines, _table, _procedure_lines, _registration_lines):
            lines += section(self)
        return "\n".join(lines) + "\n"


def build_tune_report(store: str | Path | GateStore, run_id: str | None = None) -> TuneReport:
    """The report of a tune run (the latest one when ``run_id`` is None). Speeds come from the calibration
    questions (each setting alone in its own engine), else from the test questions."""
    with opened(store) as gate_store:
        tunes = [r for r in gate_store.runs() if r.kind == "tune"]
        found = [r for r in tunes if run_id in (None, r.run_id)]
        if not found:
            wanted = "" if run_id is None else f" {run_id!r}"
            names = ", ".join(r.run_id for r in tunes) or "none"
            raise ValueError(f"no tune run{wanted} in {gate_store.path} (tune runs: {names})")
        return _build(gate_store, found[-1])


def _build(store: GateStore, run: RunRecord) -> TuneReport:
    reg = run.registered
    assert reg.tune is not None
    order = reg.tune.order.settings
    calibration = lane_speeds(store, reg.tune.calibration_run) if reg.tune.calibration_run else {}
    tested = lane_speeds(store, run.run_id)
    speeds = calibration or tested
    statuses: list[SettingStatus] = []
    for setting_id in order:
        statuses.append(setting_status(store, run, setting_id))
        if not statuses[-1].final or statuses[-1].decision != PASS:
            break
    result = fixed_sequence([s.decision for s in statuses] + [None] * (len(order) - len(statuses)))
    base_tps = speeds.get("baseline", {}).get("tokens_per_s")
    rows = [
        _row(
            i + 1,
            reg.setting(setting_id),
            result.labels[i],
            statuses[i] if i < len(statuses) else None,
            (speeds.get(setting_id, {}), tested.get(setting_id, {}), base_tps),
        )
        for i, setting_id in enumerate(order)
    ]
    return TuneReport(
        store=str(store.path),
        run=run,
        rows=rows,
        baseline_speed=speeds.get("baseline", {}),
        chosen=result.chosen,
        complete=all(s.final for s in statuses),
        speed_source="calibration" if calibration else "test",
        ledger=[summary for sid in order if (summary := ledger_summary(store, run, sid)) is not None],
    )


# -------------------------------------------------------------------------------------- words


def _why_stopped(report: TuneReport, row: TuneRow) -> str:
    if not row.final:
        return (
            f"{row.title} is still being tested ({row.n} questions so far; the run paused or is still "
            "running: rerun the same command to continue)"
        )
    n, m = f"{row.n:,}", report.margin_points
    interval = f"; interval [{points(row.low)}, {points(row.high)}] points" if row.low is not None else ""
    if row.decision == INCONCLUSIVE:
        what = "shows a loss, of unknown size," if row.loss_detected else "could not be shown non-inferior"
        return f"{row.title} {what} within {m} points (after {n} questions{interval})"
    return f"{row.title} loses more than {m} points (FAIL after {n} questions{interval})"


def _table(report: TuneReport) -> list[str]:
    """The settings in test order, the baseline first, with the legend and what the speeds measure."""
    sequential = report.run.registered.design == "sequential"
    kind = "confidence sequence at the stop" if sequential else "Tango interval"
    base = report.baseline_speed
    lines = [
        "## Settings in the registered test order",
        "",
        "| # | setting | tokens/s | vs standard | mean acceptance length | forgiven share | questions | "
        f"lost | gained | {100 * (1 - 2 * report.run.alpha):g}% {kind} (points) | decision |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
        f"| 0 | standard (baseline) | {num(base.get('tokens_per_s'), 1)} | 1.00x | "
        f"{num(base.get('mean_acceptance_length'), 2)} | {pct(base.get('forgiven_share'))} | | | | | "
        "baseline |",
    ]
    for row in report.rows:
        interval = f"[{points(row.low)}, {points(row.high)}]" if row.low is not None else "-"
        decision = row.decision
        if row.final is False:
            decision += " (in progress)"
        if report.chosen_row is row:
            decision = f"**{decision}, chosen**"
        speedup = f"{row.speedup:.2f}x" if row.speedup else "-"
        counts = [str(row.n), str(row.lost), str(row.gained)] if row.n is not None else ["-", "-", "-"]
        lines.append(
            f"| {row.position} | {row.title} | {num(row.tokens_per_s, 1)} | {speedup} | "
            f"{num(row.mean_acceptance_length, 2)} | {pct(row.forgiven_share)} | {' | '.join(counts)} | "
            f"{interval} | {decision} |"
        )
    return [
        *lines,
        "",
        "lost = baseline right, setting wrong; gained = the reverse. NOT TESTED: after the first setting "
        "that did not pass, no setting is run or looked at.",
        "",
        _speed_note(report),
        "",
    ]


def _speed_note(report: TuneReport) -> str:
    if report.speed_source != "calibration":
        return (
            "Speed columns: measured on the test questions (no calibration ran); tokens/s is per request "
            "where a setting shared its engine with the baseline."
        )
    from flyspec.config import policy_names, verification_policy

    used = {row.policy for row in report.rows}
    policies = [verification_policy(name) for name in policy_names() if name in used]
    forgiven = "; ".join(f"{p.title}: {p.forgives}" for p in policies if p.lossy)
    return (
        f"Speed columns: the {len(report.tune.calibration_questions)} calibration questions (disjoint from "
        "the test questions), answered by the baseline and by each setting alone in its own engine, one "
        "after another, so the numbers compare directly. Tokens/s = output tokens over the engine's busy "
        "time (an endpoint: the wall time of its requests); mean acceptance length = 1 + accepted / drafts; "
        f"forgiven share ({forgiven}). The JSON also has each tested setting's acceptance on its test "
        "questions."
    )


def _paste_lines(report: TuneReport) -> list[str]:
    chosen = report.chosen_row
    if chosen is None:
        return []
    model = report.baseline_arm.get("model", "MODEL")
    config = json.dumps(chosen.speculative_config, sort_keys=True)
    return [
        "## The chosen speculative_config",
        "",
        "```json",
        json.dumps(chosen.speculative_config, indent=2, sort_keys=True),
        "```",
        "",
        f"    flyspec serve {model} --speculative-config '{config}'",
        "",
        "For vLLM, pass the same JSON as --speculative-config where that vLLM knows the keys (FLy's fields "
        "carry its names, typical acceptance's two fields are vLLM 0.x's names, lossless_prefix_tokens is "
        "flyspec's own), with the draft model named as that server knows it.",
        "",
    ]


def _procedure_lines(report: TuneReport) -> list[str]:
    """The fixed-sequence procedure, the test order and design, and each setting's error budget."""
    m, tune, reg = report.margin_points, report.tune, report.run.registered
    if tune.order.method == "given":
        order = "Test order: as given, registered before the first test answer."
    else:
        order = (
            f"Test order: by {str(tune.order.by).replace('_', ' ')} on the calibration questions, slowest "
            "(least aggressive) first, fixed and registered before any answer was graded (calibration "
            "answers are never graded)."
        )
    design = (
        f"Each test is a fixed-size Tango test on all {tune.test_questions} test questions, decided once "
        "every one has both answers."
    )
    if reg.design == "sequential" and reg.sequential is not None:
        seq = reg.sequential
        design = (
            f"Each test is sequential: a {100 * (1 - 2 * seq.alpha):g}% betting confidence sequence along "
            f"the registered question order, stopped at its first crossing of -{m} points or at "
            f"{seq.max_questions} questions. Each sequential test keeps its own error at most alpha "
            "however it stops, which is all the fixed-sequence argument needs; the baseline's answers are "
            "shared, and the argument holds whatever the dependence between the tests."
        )
    labels = {row.id: row.label for row in report.rows}
    return [
        "## Procedure",
        "",
        "Fixed-sequence testing (Maurer, Hothorn and Lehmacher 1995; Westfall and Krishen 2001): the "
        f"settings are tested in the registered order, each against the margin of {m} points at the full "
        f"one-sided alpha {report.run.alpha:g}, and testing stops at the first setting that does not PASS; "
        "the answer is the last setting that passed. Choosing a setting that is truly worse than the margin "
        "needs the first such setting in the order to PASS, which happens with probability at most alpha, "
        "so the chance of choosing any harmful setting stays at most alpha with no splitting of alpha "
        "(docs/statistics.md, 'Choosing among settings: fixed-sequence testing'; the simulation is "
        "test_fixed_sequence_controls_choosing_a_harmful_setting in tests/test_gate_stats_validity.py).",
        "",
        order,
        "",
        design,
        "",
        *(
            line
            for summary in report.ledger
            for line in (f"{labels.get(summary.comparison, summary.comparison)}: {summary.describe()}", "")
        ),
    ]


def _registration_lines(report: TuneReport) -> list[str]:
    run, reg, tune = report.run, report.run.registered, report.tune
    sampling, qo = reg.sampling or SamplingRecord(), reg.order
    lines = [
        "## Registration",
        "",
        f"- margin {run.margin:g} ({report.margin_points} points), alpha {run.alpha:g} (one-sided), seed "
        f"{run.seed}, registered before the first test answer",
        f"- sampling: temperature {sampling.temperature}, top_p {sampling.top_p}, max_tokens "
        f"{sampling.max_tokens}; per-question seeds shared by the baseline and every setting",
        f"- questions: {qo.rule if qo else None} with seed {qo.seed if qo else None} over "
        f"{qo.pool if qo else None}; the first {len(tune.calibration_questions)} calibrate, the next "
        f"{tune.test_questions} are test questions",
    ]
    lines += [f"- dataset `{name}`: sha256 {str(info.sha256)[:16]}..." for name, info in reg.datasets.items()]
    return [*lines, f"- baseline: `{json.dumps(reg.arms.get('baseline'), sort_keys=True)}`"]


__all__ = ["TuneReport", "TuneRow", "build_tune_report"]
