"""The gate store: a real SQLite file; registration before answers, no duplicates, nothing ever lost."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from flyspec.gate.store import AnswerRecord, GateStore, RegisteredQuestion

REGISTRATION = {
    "margin": 0.02,
    "alpha": 0.025,
    "seed": 0,
    "arms": {"baseline": {"kind": "engine", "model": "m"}, "candidate": {"kind": "engine", "model": "m2"}},
    "sampling": {"temperature": 0.0},
}
QUESTIONS = [RegisteredQuestion("ds", f"q{i}", i, f"hash{i}", str(i), "gsm8k") for i in range(3)]


def _answer(arm: str, qid: str, correct: bool = True, output: str = "out") -> AnswerRecord:
    return AnswerRecord(arm, 0, "ds", qid, 7, output, "1", correct, "stop", 10, 5, 0.5, 2, 8, 4, 1, "engine")


def test_register_answer_reopen(tmp_path: Path) -> None:
    """A run is registered with its questions, answers are committed one by one, and a new connection
    (as after a crash) sees every committed answer; the journal is WAL."""
    path = tmp_path / "s.sqlite"
    with GateStore(path) as store:
        assert store.register("r", "gate", REGISTRATION, QUESTIONS) is True
        assert store.add_answer("r", _answer("baseline", "q0"))
        assert store.add_answer("r", _answer("candidate", "q0", correct=False))
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    with GateStore(path) as store:
        run = store.get_run("r")
        assert run is not None and run.margin == 0.02 and run.registration == REGISTRATION
        assert store.questions("r") == QUESTIONS
        answers = store.answers("r")
        assert [(a.arm, a.correct) for a in answers] == [("baseline", True), ("candidate", False)]
        assert answers[0] == _answer("baseline", "q0")
        assert store.answered_keys("r") == {("baseline", 0, "ds", "q0"), ("candidate", 0, "ds", "q0")}


def test_duplicate_answer_is_ignored_not_overwritten(tmp_path: Path) -> None:
    """The UNIQUE key makes a second answer for the same (run, arm, repeat, question) a no-op: the first
    stored answer stays exactly as it was."""
    with GateStore(tmp_path / "s.sqlite") as store:
        store.register("r", "gate", REGISTRATION, QUESTIONS)
        assert store.add_answer("r", _answer("baseline", "q1", output="first"))
        assert not store.add_answer("r", _answer("baseline", "q1", correct=False, output="second"))
        (only,) = store.answers("r")
        assert only.output == "first" and only.correct


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"margin": 0.03}, "margin (registered 0.02, now 0.03)"),
        (
            {"arms": {**REGISTRATION["arms"], "candidate": {"kind": "engine", "model": "other"}}},
            "arms.candidate.model",
        ),
        ({"sampling": {"temperature": 0.7}}, "sampling.temperature"),
    ],
)
def test_resume_with_different_settings_is_refused(tmp_path: Path, change: dict, named: str) -> None:
    """Resuming a run with another margin, arm or sampling is refused with the changed field named, and
    the stored answers are untouched."""
    with GateStore(tmp_path / "s.sqlite") as store:
        store.register("r", "gate", REGISTRATION, QUESTIONS)
        store.add_answer("r", _answer("baseline", "q0"))
        with pytest.raises(ValueError, match="cannot be resumed") as info:
            store.register("r", "gate", {**REGISTRATION, **change}, QUESTIONS)
        assert named in str(info.value)
        assert store.get_run("r").registration == REGISTRATION  # type: ignore[union-attr]
        assert len(store.answers("r")) == 1
        assert store.register("r", "gate", dict(REGISTRATION), list(QUESTIONS)) is False  # identical: resume


def test_resume_with_different_questions_is_refused(tmp_path: Path) -> None:
    """A changed prompt (hash) or a different question count is refused, naming the question."""
    with GateStore(tmp_path / "s.sqlite") as store:
        store.register("r", "gate", REGISTRATION, QUESTIONS)
        store.add_answer("r", _answer("baseline", "q0"))
        changed = [*QUESTIONS[:2], RegisteredQuestion("ds", "q2", 2, "other", "2", "gsm8k")]
        with pytest.raises(ValueError, match=r"question ds/q2 \(prompt_hash changed\)"):
            store.register("r", "gate", REGISTRATION, changed)
        with pytest.raises(ValueError, match="questions \\(registered 3, now 2\\)"):
            store.register("r", "gate", REGISTRATION, QUESTIONS[:2])


def test_not_a_store_and_missing_folder(tmp_path: Path) -> None:
    """A file that is not SQLite, or a store in a folder that does not exist, is a clear error, and the
    foreign file is left as it was."""
    junk = tmp_path / "notes.txt"
    junk.write_text("hello " * 1000)
    with pytest.raises(ValueError, match="is not a gate store"):
        GateStore(junk)
    assert junk.read_text() == "hello " * 1000
    with pytest.raises(FileNotFoundError, match="does not exist"):
        GateStore(tmp_path / "no" / "such" / "s.sqlite")


def test_a_run_without_answers_can_be_registered_again(tmp_path: Path) -> None:
    """A run that never stored an answer (e.g. its model failed to load) may be registered again with
    fixed settings, since nothing has been seen; once one answer exists, changes are refused."""
    with GateStore(tmp_path / "s.sqlite") as store:
        store.register("r", "gate", REGISTRATION, QUESTIONS)
        fixed = {**REGISTRATION, "margin": 0.03}
        assert store.register("r", "gate", fixed, QUESTIONS[:2]) is True
        assert store.get_run("r").margin == 0.03 and len(store.questions("r")) == 2  # type: ignore[union-attr]
        store.add_answer("r", _answer("baseline", "q0"))
        with pytest.raises(ValueError, match="cannot be resumed"):
            store.register("r", "gate", REGISTRATION, QUESTIONS)
