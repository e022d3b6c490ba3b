"""Controls in one shared executor: every comparison's pairs advance together (the lanes of a question side
by side), and once a control has decided, its arm gets no more jobs.

An arm kind defined in this file ("canned", registered through the public `register_arm_kind`) answers
every question with a fixed text, and all its arms share one executor that answers their jobs in the
order the session hands them over, one at a time and each after a short while, as an engine shared by
several arms pulls them. So the stored answers' order is the order the session chose.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flyspec.gate import build_report, run_gate
from flyspec.gate.arms import register_arm_kind
from flyspec.gate.arms.base import Completion, Job, Sampling
from flyspec.gate.data.store import GateStore


@dataclass(frozen=True)
class CannedArm:
    name: str
    text: str
    kind = "canned-shared"
    greedy_repeats = True
    settings_visible = True
    speculative_config = None

    def identity(self, served: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.public_dict()

    def public_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "text": self.text}

    def variant(self, name: str, speculative_config: dict[str, Any]) -> CannedArm:
        raise ValueError("a canned arm has no speculative config")


class SharedCanned:
    """One executor for every canned arm: the jobs of all of them in the session's order."""

    drive = "in_turns"
    max_in_flight = 1

    def __init__(self, arms: list[CannedArm]) -> None:
        self.arms = {a.name: a for a in arms}
        self.shared = len(arms) > 1

    def describe(self) -> str:
        return f"canned answers for {', '.join(self.arms)}"

    def served_models(self) -> dict[str, dict[str, Any] | None]:
        return {}

    def start(self) -> None:
        pass

    def facts(self) -> dict[str, Any]:
        return {"kind": "canned", "arms": sorted(self.arms)}

    def take_prefix_cache(self) -> None:
        return None

    def answers(self, jobs: Iterable[Job], sampling: Sampling) -> Iterator[tuple[Job, Completion]]:
        for job in jobs:
            # An answer takes a little while, as a real one does: the session sees each in time to reorder.
            time.sleep(0.01)
            yield job, Completion(self.arms[job.arm].text, "stop", 1, 1, 0.0, source="canned")


def _parse(name: str, data: dict[str, Any]) -> CannedArm:
    return CannedArm(name, str(data["text"]))


register_arm_kind("canned-shared", _parse, lambda arms: [SharedCanned(arms)] if arms else [])


def test_a_control_and_the_candidate_advance_together_and_a_decided_control_stops(tmp_path: Path) -> None:
    """Baseline and candidate always right, the control always wrong: the three lanes of each question are
    answered side by side, so when the control FAILs the candidate has as many pairs in order as the
    control (it was not held back behind it); after the control's stop its arm gets no new job (at most
    the one in flight finishes), and the candidate then PASSes."""
    rows = [{"id": f"q{i}", "prompt": f"Q{i}", "answer": "yes", "grader": "exact"} for i in range(80)]
    data = tmp_path / "yes.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    arm = lambda text: {"kind": "canned-shared", "text": text}  # noqa: E731
    run_id = run_gate(
        tmp_path / "g.db", str(data), arm("yes"), arm("yes"), 0.3, sequential=True, population="finite",
        controls={"control": arm("no")}, progress=False,
    )  # fmt: skip
    report = build_report(tmp_path / "g.db", run_id)
    (control,) = report.family
    assert control.decision == "FAIL" and report.decision == "PASS"
    stop = control.sequential.stopped_at  # type: ignore[union-attr]
    with GateStore(tmp_path / "g.db") as store:
        order = {q.question_id: q.position for q in store.questions(run_id)}
        rows_ = store._db.execute(  # noqa: SLF001 - the insertion order is what the test reads
            "SELECT arm, question_id FROM answers WHERE run_id = ? ORDER BY rowid", (run_id,)
        ).fetchall()
    sequence = [(arm_, order[q]) for arm_, q in rows_]
    until_stop = sequence[: 3 * stop]
    assert [p for _, p in until_stop] == [p for p in range(stop) for _ in range(3)]
    assert all(
        {a for a, p in until_stop if p == q} == {"baseline", "control", "candidate"} for q in range(stop)
    )
    later_control = [p for a, p in sequence[3 * stop :] if a == "control"]
    assert len(later_control) <= 1
