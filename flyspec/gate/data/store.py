"""The gate's SQLite store: the registered run, its questions, one committed row per answer, and events.

Durability is the point: every answer is committed the moment it is graded (WAL journal, full sync), the
UNIQUE key (run, arm, repeat, dataset, question) makes a resumed run skip what is stored instead of
duplicating it, and nothing in this module ever deletes or rewrites a stored answer. The ``events``
table is append-only too (but for a run that never stored an answer, whose registration may be
replaced): each session of a run records when it started and why it stopped; a sequential run's report
reads its stopping point from there when the stop was a time budget or Ctrl-C rather than the data. A
sequential run may be continued past its registered maximum (``extend_sequential``): its registration's
maximum is raised, the change kept in the registration and as an event.
One process writes a store at a time (``GateStore.lock``, see flyspec/gate/data/lock.py).
"""

from __future__ import annotations

import json
import sqlite3
import time
from contextlib import closing
from dataclasses import asdict, astuple, replace
from pathlib import Path

from flyspec.gate.data.judged_rows import JudgedRows
from flyspec.gate.data.lock import StoreLock
from flyspec.gate.data.records import AnswerRecord, RegisteredQuestion, RunEvent, RunNotes, RunRecord
from flyspec.gate.data.records import JudgementRecord as JudgementRecord  # re-exported with the store
from flyspec.gate.data.records import LabelRecord as LabelRecord  # re-exported with the store
from flyspec.gate.data.schema import connect
from flyspec.gate.data.spec import Extension, Registration, only_the_maximum_grew, refuse_retired


def _describe_difference(old: object, new: object, path: str = "") -> list[str]:
    """Human-readable paths where two JSON-like values differ (for refusing a changed resume)."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for key in sorted(set(old) | set(new), key=str):
            where = f"{path}.{key}" if path else str(key)
            if key not in old or key not in new:
                out.append(f"{where} (registered {old.get(key)!r}, now {new.get(key)!r})")
            else:
                out.extend(_describe_difference(old[key], new[key], where))
        return out
    return [] if old == new else [f"{path or 'value'} (registered {old!r}, now {new!r})"]


def _refuse_retired_runs(path: Path) -> None:
    """A store holding a run registered under a retired judged rule is refused before it is opened (and
    so left as it was, for the flyspec that reads it), naming the rule and that flyspec
    (``spec.refuse_retired``)."""
    if not path.is_file():
        return
    try:
        with closing(sqlite3.connect(path, timeout=30.0)) as db:
            rows = db.execute("SELECT run_id, kind, registration FROM runs").fetchall()
    except sqlite3.DatabaseError:
        return  # not a store yet, or not a store at all: opening it says which
    for run_id, kind, stored in rows:
        refuse_retired(kind, json.loads(stored), f"run {run_id!r} in store {path}")


class GateStore(JudgedRows):
    """A gate store file. Use as a context manager or call ``close()``. Its records are in
    flyspec/gate/data/records.py (imported here too), its judge calls and labels in judged_rows.py."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.parent.exists():
            raise FileNotFoundError(f"store {self.path}: folder {self.path.parent} does not exist")
        _refuse_retired_runs(self.path)
        self._db = connect(self.path)

    def __enter__(self) -> GateStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection (every answer is already committed)."""
        self._db.close()

    def lock(self, run_id: str) -> StoreLock:
        """The store's writer lock for ``run_id`` (a context manager; StoreBusyError names the holder)."""
        return StoreLock(self.path, run_id)

    def register(
        self,
        run_id: str,
        registration: Registration,
        questions: list[RegisteredQuestion],
        notes: RunNotes | None = None,
    ) -> bool:
        """Record a run before its first answer; True if (re)registered, False if an identical run resumes.

        A run id that exists with a different registration or question list is refused with ValueError
        listing what changed, and nothing stored is touched. The one exception is a run with no answer at
        all (e.g. its model failed to load): nothing has been seen yet, so its registration is replaced.
        """
        existing = self.get_run(run_id)
        if existing is not None and not self.check_resumable(run_id, registration, questions):
            return False
        row = (run_id, registration.kind, time.time(), json.dumps(registration.to_dict(), sort_keys=True))
        with self._db:  # one transaction: an empty run's old registration is replaced atomically
            if existing is not None:
                for table in (
                    "questions",
                    "batches",
                    "events",
                    "judgements",
                    "labels",
                    "second_labels",
                    "runs",
                ):
                    self._db.execute(f"DELETE FROM {table} WHERE run_id = ?", (run_id,))
            notes_json = json.dumps(notes or {}, sort_keys=True)
            self._db.execute(
                "INSERT INTO runs (run_id, kind, created_at, registration, notes) VALUES (?, ?, ?, ?, ?)",
                (*row, notes_json),
            )
            self._add_questions(run_id, questions)
        return True

    def check_resumable(
        self,
        run_id: str,
        registration: Registration,
        questions: list[RegisteredQuestion],
        holds_data: bool = False,
    ) -> bool:
        """True when ``run_id`` is registered with other settings but holds no answer (it may be replaced),
        False when it is registered identically (or not at all); ValueError listing what changed when it
        differs and answers exist (or ``holds_data``: the caller keeps other evidence of the run)."""
        existing = self.get_run(run_id)
        if existing is None:
            return False
        changes = _describe_difference(
            {"kind": existing.kind, **existing.registration},
            {"kind": registration.kind, **registration.to_dict()},
        )
        stored = self.questions(run_id)
        if [asdict(q) for q in stored] != [asdict(q) for q in questions]:
            changes.append(self._question_difference(stored, questions))
        if changes and (holds_data or self._has_answers(run_id)):
            raise ValueError(
                f"run {run_id!r} in {self.path} was registered with different settings, so it cannot be "
                f"resumed: {'; '.join(changes)}. Start a new run with another --run name (stored answers "
                "are kept)."
            )
        return bool(changes)

    def extend_sequential(
        self, run_id: str, registration: Registration, questions: list[RegisteredQuestion]
    ) -> bool:
        """Continue a sequential run past its registered maximum: True when ``run_id`` is a sequential run
        registered as ``registration`` except for a smaller maximum, and its questions are the start of
        ``questions``; the new questions are appended, the registration's maximum raised and the change
        kept in its ``extensions`` list (from, to, when) and as an ``extend`` event. False (nothing
        written) otherwise. Valid because the confidence sequence holds at every number of questions."""
        existing = self.get_run(run_id)
        wanted = registration.to_dict()
        if existing is None or not only_the_maximum_grew(existing.registration, wanted):
            return False
        stored = self.questions(run_id)
        if len(questions) <= len(stored) or [asdict(q) for q in questions[: len(stored)]] != [
            asdict(q) for q in stored
        ]:
            return False
        grown = Extension(len(stored), len(questions), time.time())
        extended = replace(registration, extensions=(*existing.registered.extensions, grown)).to_dict()
        with self._db:
            self._db.execute(
                "UPDATE runs SET registration = ? WHERE run_id = ?",
                (json.dumps(extended, sort_keys=True), run_id),
            )
            self._add_questions(run_id, questions[len(stored) :])
            detail = json.dumps({"from": grown.start, "to": grown.to})
            self._db.execute(
                "INSERT INTO events VALUES (?, ?, ?, ?, ?, ?)",
                (run_id, "extend", None, None, detail, time.time()),
            )
        return True

    def add_question(self, run_id: str, question: RegisteredQuestion) -> bool:
        """Register one more question of a run whose questions arrive while it runs (live traffic, ``flyspec
        gate shadow``: each mirrored request is the next question in the order); False (nothing written)
        when it is registered already."""
        with self._db:
            cursor = self._db.execute(
                "INSERT INTO questions VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                (run_id, *astuple(question)),
            )
        return cursor.rowcount == 1

    def _add_questions(self, run_id: str, questions: list[RegisteredQuestion]) -> None:
        self._db.executemany(
            "INSERT INTO questions VALUES (?, ?, ?, ?, ?, ?, ?)",
            [(run_id, *astuple(q)) for q in questions],
        )

    def _has_answers(self, run_id: str) -> bool:
        row = self._db.execute("SELECT 1 FROM answers WHERE run_id = ? LIMIT 1", (run_id,)).fetchone()
        return row is not None

    @staticmethod
    def _question_difference(stored: list[RegisteredQuestion], new: list[RegisteredQuestion]) -> str:
        if len(stored) != len(new):
            return f"questions (registered {len(stored)}, now {len(new)})"
        for old, cur in zip(stored, new, strict=True):
            if old != cur:
                fields = [k for k, v in asdict(old).items() if asdict(cur)[k] != v]
                return f"question {old.dataset}/{old.question_id} ({', '.join(fields)} changed)"
        return "questions"

    def add_answer(self, run_id: str, record: AnswerRecord) -> bool:
        """Commit one answer now; False (and nothing written) if that key is already stored."""
        return self.add_answers(run_id, [record]) == 1

    def add_answers(self, run_id: str, records: list[AnswerRecord]) -> int:
        """Commit several answers in one transaction (both answers of a judged pair are stored together or
        not at all); keys already stored are skipped. Returns how many rows were written."""
        written = 0
        with self._db:
            for record in records:
                row = asdict(record)
                columns = ["run_id", *row.keys(), "created_at"]
                values = [run_id, *row.values(), time.time()]
                values[columns.index("correct")] = int(record.correct)
                cursor = self._db.execute(
                    f"INSERT INTO answers ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))}) "
                    "ON CONFLICT (run_id, arm, repeat, dataset, question_id) DO NOTHING",
                    values,
                )
                written += cursor.rowcount
        return written

    def add_batch(
        self, run_id: str, arm: str, repeat: int, num_answers: int, completion_tokens: int, wall_s: float
    ) -> None:
        """Record the wall time of one batch of answers of one arm (the basis of its tokens/s)."""
        with self._db:
            self._db.execute(
                "INSERT INTO batches VALUES (?, ?, ?, ?, ?, ?, ?)",
                (run_id, arm, repeat, num_answers, completion_tokens, wall_s, time.time()),
            )

    def add_event(
        self,
        run_id: str,
        event: str,
        reason: str | None = None,
        stopped_at: int | None = None,
        detail: dict[str, object] | None = None,
    ) -> None:
        """Append a session event (``start`` or ``stop``) to the run's history."""
        with self._db:
            self._db.execute(
                "INSERT INTO events VALUES (?, ?, ?, ?, ?, ?)",
                (run_id, event, reason, stopped_at, json.dumps(detail or {}, sort_keys=True), time.time()),
            )

    def events(self, run_id: str) -> list[RunEvent]:
        """The run's session events, oldest first."""
        rows = self._db.execute(
            "SELECT event, reason, stopped_at, detail, created_at FROM events WHERE run_id = ? "
            "ORDER BY created_at, rowid",
            (run_id,),
        )
        return [RunEvent(e, r, s, json.loads(d), t) for e, r, s, d, t in rows]

    def update_notes(self, run_id: str, notes: RunNotes) -> None:
        """Merge ``notes`` (facts learned while running, e.g. a shared engine) into the run's notes."""
        run = self.get_run(run_id)
        if run is None:
            raise ValueError(f"run {run_id!r} is not in {self.path}")
        with self._db:
            self._db.execute(
                "UPDATE runs SET notes = ? WHERE run_id = ?",
                (json.dumps({**run.notes, **notes}, sort_keys=True), run_id),
            )

    def get_run(self, run_id: str) -> RunRecord | None:
        """The registered run, or None."""
        row = self._db.execute(
            "SELECT kind, created_at, registration, notes FROM runs WHERE run_id = ?", (run_id,)
        ).fetchone()
        if row is None:
            return None
        kind, created_at, stored, notes = row[0], row[1], json.loads(row[2]), json.loads(row[3])
        r = Registration.read(kind, stored)
        return RunRecord(run_id, kind, created_at, r.margin, r.alpha, r.seed, stored, notes, r)

    def revision(self, run_id: str) -> tuple[object, ...]:
        """A cheap fingerprint of everything a report of ``run_id`` reads: rows are only added (a label or
        an answer is never replaced), so the row counts, and the run's registration and notes, change
        whenever the report could."""
        tables = ("questions", "answers", "judgements", "labels", "second_labels", "events", "batches")
        counts = " UNION ALL ".join(f"SELECT count(*) FROM {t} WHERE run_id = :run" for t in tables)
        rows = self._db.execute(counts, {"run": run_id}).fetchall()
        run = self._db.execute("SELECT registration, notes FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        return (*(n for (n,) in rows), run)

    def runs(self) -> list[RunRecord]:
        """Every run in the store, oldest first."""
        ids = [r[0] for r in self._db.execute("SELECT run_id FROM runs ORDER BY created_at, run_id")]
        return [run for run_id in ids if (run := self.get_run(run_id)) is not None]

    def questions(self, run_id: str) -> list[RegisteredQuestion]:
        """The registered questions of a run, in registration order."""
        rows = self._db.execute(
            "SELECT dataset, question_id, position, prompt_hash, answer, grader FROM questions "
            "WHERE run_id = ? ORDER BY position",
            (run_id,),
        )
        return [RegisteredQuestion(*row) for row in rows]

    def answers(self, run_id: str) -> list[AnswerRecord]:
        """Every stored answer of a run."""
        names = [f for f in AnswerRecord.__dataclass_fields__]
        rows = self._db.execute(
            f"SELECT {', '.join(names)} FROM answers WHERE run_id = ? "
            "ORDER BY arm, repeat, dataset, question_id",
            (run_id,),
        )
        out = []
        for row in rows:
            values = dict(zip(names, row, strict=True))
            values["correct"] = bool(values["correct"])
            out.append(AnswerRecord(**values))
        return out

    def answer_times(self, run_id: str) -> dict[tuple[str, int, str, str], float]:
        """When each answer of a run was stored (seconds since the epoch), by ``(arm, repeat, dataset,
        question_id)``."""
        rows = self._db.execute(
            "SELECT arm, repeat, dataset, question_id, created_at FROM answers WHERE run_id = ?", (run_id,)
        )
        return {(a, r, d, q): t for a, r, d, q, t in rows}

    def answered_keys(self, run_id: str) -> set[tuple[str, int, str, str]]:
        """``(arm, repeat, dataset, question_id)`` of every stored answer (what a resume skips)."""
        rows = self._db.execute(
            "SELECT arm, repeat, dataset, question_id FROM answers WHERE run_id = ?", (run_id,)
        )
        return {tuple(r) for r in rows}  # type: ignore[misc]

    def batches(self, run_id: str) -> list[tuple[str, int, int, int, float]]:
        """``(arm, repeat, num_answers, completion_tokens, wall_s)`` of every recorded batch."""
        rows = self._db.execute(
            "SELECT arm, repeat, num_answers, completion_tokens, wall_s FROM batches WHERE run_id = ?",
            (run_id,),
        )
        return [tuple(r) for r in rows]  # type: ignore[misc]
