"""The gate store: a real SQLite file; registration before answers, no duplicates, nothing ever lost, and
one writer process at a time (a lock held by a real second process)."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from flyspec.gate.data.spec import Registration, SamplingRecord
from flyspec.gate.data.store import AnswerRecord, GateStore, RegisteredQuestion
from flyspec.gate.data.storefile import StoreBusyError, StoreLock, lock_path, read_holder
from flyspec.gate.report.build import build_report

REGISTRATION = Registration(
    "gate",
    margin=0.02,
    alpha=0.025,
    seed=0,
    arms={"baseline": {"kind": "engine", "model": "m"}, "candidate": {"kind": "engine", "model": "m2"}},
    sampling=SamplingRecord(temperature=0.0),
)
QUESTIONS = [RegisteredQuestion("ds", f"q{i}", i, f"hash{i}", str(i), "gsm8k") for i in range(3)]


def _answer(arm: str, qid: str, correct: bool = True, output: str = "out") -> AnswerRecord:
    return AnswerRecord(arm, 0, "ds", qid, 7, output, "1", correct, "stop", 10, 5, 0.5, 2, 8, 4, 1, "engine")


def test_register_answer_reopen(tmp_path: Path) -> None:
    """A run is registered with its questions, answers are committed one by one, and a new connection
    (as after a crash) sees every committed answer; the journal is WAL."""
    path = tmp_path / "s.sqlite"
    with GateStore(path) as store:
        assert store.register("r", REGISTRATION, QUESTIONS) is True
        assert store.add_answer("r", _answer("baseline", "q0"))
        assert store.add_answer("r", _answer("candidate", "q0", correct=False))
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    with GateStore(path) as store:
        run = store.get_run("r")
        assert run is not None and run.margin == 0.02 and run.registration == REGISTRATION.to_dict()
        assert store.questions("r") == QUESTIONS
        answers = store.answers("r")
        assert [(a.arm, a.correct) for a in answers] == [("baseline", True), ("candidate", False)]
        assert answers[0] == _answer("baseline", "q0")
        assert store.answered_keys("r") == {("baseline", 0, "ds", "q0"), ("candidate", 0, "ds", "q0")}


def test_duplicate_answer_is_ignored_not_overwritten(tmp_path: Path) -> None:
    """The UNIQUE key makes a second answer for the same (run, arm, repeat, question) a no-op: the first
    stored answer stays exactly as it was."""
    with GateStore(tmp_path / "s.sqlite") as store:
        store.register("r", REGISTRATION, QUESTIONS)
        assert store.add_answer("r", _answer("baseline", "q1", output="first"))
        assert not store.add_answer("r", _answer("baseline", "q1", correct=False, output="second"))
        (only,) = store.answers("r")
        assert only.output == "first" and only.correct


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"margin": 0.03}, "margin (registered 0.02, now 0.03)"),
        (
            {"arms": {**REGISTRATION.arms, "candidate": {"kind": "engine", "model": "other"}}},
            "arms.candidate.model",
        ),
        ({"sampling": SamplingRecord(temperature=0.7)}, "sampling.temperature"),
    ],
)
def test_resume_with_different_settings_is_refused(tmp_path: Path, change: dict, named: str) -> None:
    """Resuming a run with another margin, arm or sampling is refused with the changed field named, and
    the stored answers are untouched."""
    with GateStore(tmp_path / "s.sqlite") as store:
        store.register("r", REGISTRATION, QUESTIONS)
        store.add_answer("r", _answer("baseline", "q0"))
        with pytest.raises(ValueError, match="cannot be resumed") as info:
            store.register("r", replace(REGISTRATION, **change), QUESTIONS)
        assert named in str(info.value)
        assert store.get_run("r").registration == REGISTRATION.to_dict()  # type: ignore[union-attr]
        assert len(store.answers("r")) == 1
        assert store.register("r", replace(REGISTRATION), list(QUESTIONS)) is False  # identical: resume


def test_resume_with_different_questions_is_refused(tmp_path: Path) -> None:
    """A changed prompt (hash) or a different question count is refused, naming the question."""
    with GateStore(tmp_path / "s.sqlite") as store:
        store.register("r", REGISTRATION, QUESTIONS)
        store.add_answer("r", _answer("baseline", "q0"))
        changed = [*QUESTIONS[:2], RegisteredQuestion("ds", "q2", 2, "other", "2", "gsm8k")]
        with pytest.raises(ValueError, match=r"question ds/q2 \(prompt_hash changed\)"):
            store.register("r", REGISTRATION, changed)
        with pytest.raises(ValueError, match="questions \\(registered 3, now 2\\)"):
            store.register("r", REGISTRATION, QUESTIONS[:2])


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
        store.register("r", REGISTRATION, QUESTIONS)
        fixed = replace(REGISTRATION, margin=0.03)
        assert store.register("r", fixed, QUESTIONS[:2]) is True
        assert store.get_run("r").margin == 0.03 and len(store.questions("r")) == 2  # type: ignore[union-attr]
        store.add_answer("r", _answer("baseline", "q0"))
        with pytest.raises(ValueError, match="cannot be resumed"):
            store.register("r", REGISTRATION, QUESTIONS)


HOLD_LOCK = (
    "import sys, time; from flyspec.gate.data.storefile import StoreLock; "
    "StoreLock(sys.argv[1], 'holder').acquire(); "
    "print('locked', flush=True); time.sleep(120)"
)


def _holder(store: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(store)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_process_is_refused_and_a_killed_holder_frees_the_store(tmp_path: Path) -> None:
    """While another process holds a store's lock, taking it fails at once with a message naming that
    process (run, PID, command); once the holder is killed with SIGKILL the lock is free again, with no
    stale-lock cleanup."""
    store = tmp_path / "s.sqlite"
    holder = _holder(store)
    try:
        with pytest.raises(StoreBusyError) as info:
            StoreLock(store, "mine").acquire()
        message = str(info.value)
        assert f"store {store} is in use by gate run 'holder' (PID {holder.pid} on" in message
        assert (
            f": -c {store})" in message and "released as soon as that process ends, even if killed" in message
        )
    finally:
        holder.kill()
        holder.wait(timeout=30)
    with StoreLock(store, "mine"):
        assert read_holder(lock_path(store))["run_id"] == "mine"
    assert read_holder(lock_path(store)) == {}


def test_gate_run_refuses_a_busy_store_before_touching_it(tmp_path: Path) -> None:
    """`flyspec gate run` on a store another process holds is one clear error line naming the holder's
    PID (exit 2), and it writes nothing into the store."""
    store = tmp_path / "s.sqlite"
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"id": "q0", "prompt": "hi", "answer": "1", "grader": "exact"}) + "\n")
    arm = json.dumps({"base_url": "http://127.0.0.1:9/v1", "model": "a"})
    holder = _holder(store)
    try:
        command = [sys.executable, "-c", "from flyspec.cli import main; main()", "gate", "run"]
        command += ["--store", str(store), "--dataset", str(data), "--baseline", arm, "--candidate", arm]
        done = subprocess.run([*command, "--margin", "0.05"], capture_output=True, text=True, timeout=120)
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: store ") and f"(PID {holder.pid} on" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    with GateStore(store) as opened:
        assert opened.runs() == []


def test_registrations_of_older_versions_read_as_they_meant(tmp_path: Path) -> None:
    """Layouts older flyspec versions stored read back with their meaning: a gate run without comparisons
    makes one from its margin, alpha and sequential plan; one without a design is sequential when it has a
    sequential plan, else fixed; a sequential plan without a claim is finite; a run without an alpha budget
    has none. The sequential plan is written back as it was stored (no claim), so such a run's resume
    compares equal."""
    sequential = {"margin": 0.03, "alpha": 0.025, "max_questions": 3, "population_size": 3, "order_seed": 0}
    gold = {"rate": 0.2, "seed": 0, "source": "human", "all": False, "draw": 2}
    old = {**REGISTRATION.to_dict(), "sequential": sequential, "gold": gold, "judge": {"model": "j"}}
    with GateStore(tmp_path / "s.sqlite") as store:
        store.register("old", Registration.read("gate", old), QUESTIONS)
        store.register("fixed", REGISTRATION, QUESTIONS)
        run, fixed = store.get_run("old"), store.get_run("fixed")
    assert run is not None and fixed is not None
    reg = run.registered
    (plan,) = reg.comparisons
    assert (plan.name, plan.margin, plan.alpha, plan.role) == ("candidate", 0.02, 0.025, "candidate")
    assert plan.sequential is not None and plan.sequential.population == "finite"
    assert reg.design == "sequential" and fixed.registered.design == "fixed"
    assert reg.judge is not None and reg.judge.model == "j" and reg.alpha_budget is None
    assert reg.lanes == (("baseline", 0), ("candidate", 0))
    written = reg.to_dict()
    assert written["sequential"] == {**sequential, "level": 0.95, "method": written["sequential"]["method"]}
    assert written["gold"] == gold and "alpha_budget" not in written and "comparisons" not in written


@pytest.mark.parametrize(
    ("fixture", "rule"),
    [
        ("store_judged_before_gold.sql", "judged run registered before gold labels"),
        ("store_gold_draw_1.sql", "gold-label draw 1"),
    ],
)
def test_a_store_with_a_run_under_a_retired_judged_rule_is_refused(
    tmp_path: Path, fixture: str, rule: str
) -> None:
    """Stores written by flyspec at git commit 82c2716 (tests/data, dumped as SQL): a judged run registered
    before gold labels, and one registered with gold-label draw 1 (its gold rule has no draw). Opening the
    store, its report (API and command line) and resuming it are refused, naming the rule and the flyspec
    that reads it; nothing in the store is changed."""
    path = tmp_path / "old.sqlite"
    with sqlite3.connect(path) as db:
        db.executescript((Path(__file__).parent / "data" / fixture).read_text())
    message = rf"run '.+' in store {path} was registered under a retired rule, the {rule} .+ commit 82c2716"
    with pytest.raises(ValueError, match=message):
        GateStore(path)
    with pytest.raises(ValueError, match=message):
        build_report(path)
    command = [sys.executable, "-c", "from flyspec.cli import main; main()", "gate", "report", "--store"]
    done = subprocess.run([*command, str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "use flyspec at git commit 82c2716 or earlier to read it" in done.stderr
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == 3


# The runs table as version 3 wrote it (margin, alpha and seed copied beside the registration), with the
# rest of that version's tables left out (opening adds them).
VERSION_3_RUNS = """
CREATE TABLE runs (
    run_id TEXT PRIMARY KEY, kind TEXT NOT NULL, created_at REAL NOT NULL, margin REAL NOT NULL,
    alpha REAL NOT NULL, seed INTEGER NOT NULL, registration TEXT NOT NULL, notes TEXT NOT NULL
);
PRAGMA user_version=3;
"""


def test_a_version_3_store_is_migrated_when_opened(tmp_path: Path) -> None:
    """A store a version-3 flyspec wrote opens: its runs read as registered, the copies of margin, alpha
    and seed in the runs table are dropped (the registration holds them), and a new run registers in it.
    A store from a newer flyspec is refused, naming its version."""
    path = tmp_path / "v3.sqlite"
    with sqlite3.connect(path) as db:
        db.executescript(VERSION_3_RUNS)
        stored = json.dumps(REGISTRATION.to_dict(), sort_keys=True)
        db.execute("INSERT INTO runs VALUES ('old', 'gate', 1.0, 0.02, 0.025, 0, ?, '{}')", (stored,))
    with GateStore(path) as store:
        old = store.get_run("old")
        assert old is not None and (old.margin, old.alpha, old.seed) == (0.02, 0.025, 0)
        assert old.registered == replace(REGISTRATION, design="fixed")
        assert store.register("new", replace(REGISTRATION, margin=0.03), QUESTIONS) is True
        assert store.get_run("new").margin == 0.03  # type: ignore[union-attr]
    with sqlite3.connect(path) as db:
        columns = {row[1] for row in db.execute("PRAGMA table_info(runs)")}
        assert columns == {"run_id", "kind", "created_at", "registration", "notes"}
        assert db.execute("PRAGMA user_version").fetchone()[0] == 4
        db.execute("PRAGMA user_version=5")
    with pytest.raises(ValueError, match="schema version 5, this flyspec reads versions up to 4"):
        GateStore(path)
