"""Where one setting's test of a ``gate tune`` stands, recomputed from the stored answers and its session
events: ``gate tune`` reads it to know whether to test a setting and whether to go on to the next
(flyspec/gate/runs/tune.py), and the tune's report shows it (flyspec/gate/report/tune_report.py).

A sequential test stops where its confidence sequence first crossed (or where a pause was recorded); a
fixed test is decided, on Tango's interval, once every test question has both answers.
"""

from __future__ import annotations

from dataclasses import dataclass

from flyspec.gate.data.spec import BASELINE
from flyspec.gate.data.store import GateStore, RunRecord
from flyspec.gate.stats.decide import INCONCLUSIVE, decide
from flyspec.gate.stats.monitor import sequential_stop


@dataclass(frozen=True)
class SettingStatus:
    """Where one setting's test stands: its decision, whether it is final (a rerun would not change it),
    why it stopped, and the pairs and interval it used."""

    setting_id: str
    decision: str
    final: bool
    reason: str
    n: int
    lost: int
    gained: int
    low: float | None
    high: float | None
    loss_detected: bool


def setting_status(store: GateStore, run: RunRecord, setting_id: str) -> SettingStatus:
    """One setting's test, recomputed from the stored answers and its session events."""
    reg = run.registered
    lane = (setting_id, 0)
    correct = {(a.arm, a.repeat, a.dataset, a.question_id): a.correct for a in store.answers(run.run_id)}
    questions = store.questions(run.run_id)
    if reg.design == "sequential" and reg.sequential is not None:
        order = [(q.dataset, q.question_id) for q in questions]
        events = [e for e in store.events(run.run_id) if e.detail.get("setting") == setting_id]
        stop = sequential_stop(order, correct, reg.sequential, events, (BASELINE, lane))
        low, high = (stop.low, stop.high) if stop.stopped_at else (None, None)
        return SettingStatus(
            setting_id,
            stop.decision,
            stop.final,
            stop.reason,
            stop.stopped_at,
            stop.lost,
            stop.gained,
            low,
            high,
            stop.loss_detected,
        )
    pairs = []
    for q in questions:
        base = correct.get((*BASELINE, q.dataset, q.question_id))
        cand = correct.get((*lane, q.dataset, q.question_id))
        if base is not None and cand is not None:
            pairs.append((base, cand))
    lost = sum(b and not c for b, c in pairs)
    gained = sum(c and not b for b, c in pairs)
    final = len(pairs) == len(questions)
    reason = "complete" if final else "in_progress"
    if not pairs:
        return SettingStatus(setting_id, INCONCLUSIVE, final, reason, 0, 0, 0, None, None, False)
    tested = decide(len(pairs), lost, gained, run.margin, run.alpha)
    decision = tested.decision if final else INCONCLUSIVE
    return SettingStatus(
        setting_id,
        decision,
        final,
        reason,
        len(pairs),
        lost,
        gained,
        tested.low,
        tested.high,
        tested.loss_detected,
    )
