"""The gate's SQLite store: the registered run, its questions, and one row per answer, judge call, label
and session event, each committed the moment it exists and never rewritten (a UNIQUE key makes a resume
skip what is stored). docs/architecture.md, "The gate's store"; the file itself is storefile.py."""

from __future__ import annotations

import json
import re
import time
import typing
from collections.abc import Callable
from dataclasses import asdict, astuple, dataclass, fields, replace
from functools import cached_property
from pathlib import Path
from typing import TypedDict, TypeVar

from flyspec.gate.data.spec import Extension, Registration
from flyspec.gate.data.storefile import connect
from flyspec.gate.stats.monitor import SequentialPlan

Row = TypeVar("Row")
# What continuing a sequential run past its maximum may change (paths ``_differences`` gives): the run's,
# its plan's and each comparison's max_questions, the datasets' question counts, and its extensions.
_GROWN = re.compile(
    r"max_questions|extensions(\..+)?|sequential\.max_questions|comparisons\.\d+\.sequential\.max_questions"
    r"|datasets\..+\.questions"
)
_MISSING = object()
# How a stored column reads back where SQLite keeps it as another type.
_READ: dict[str, Callable[..., object]] = {"correct": bool} | dict.fromkeys(
    ("detail", "registration", "notes"), json.loads
)


def _same(value: object) -> object:
    return value


def _shown(value: object) -> str:
    return repr(None if value is _MISSING else value)


@dataclass(frozen=True)
class AnswerRecord:
    """One graded answer of one arm to one question (one row of the ``answers`` table)."""

    arm: str
    repeat: int
    dataset: str
    question_id: str
    seed: int
    output: str
    extracted: str | None
    correct: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    latency_s: float
    num_drafts: int | None = None
    num_draft_tokens: int | None = None
    num_accepted_tokens: int | None = None
    num_forgiven_tokens: int | None = None
    source: str = ""


@dataclass(frozen=True)
class JudgementRecord:
    """One call of the judge on one question's pair of answers (``pair_sha256``: the two outputs), in one
    ``position`` (``AB``: the first lane's answer shown as A, or ``BA``): its ``verdict`` (``A``, ``B``,
    ``tie`` or None, unreadable) and what it means for the lanes (``preferred``: ``first``, ``second``,
    ``tie``)."""

    dataset: str
    question_id: str
    first_lane: str
    second_lane: str
    position: str
    pair_sha256: str
    verdict: str | None
    preferred: str
    output: str
    latency_s: float
    source: str


@dataclass(frozen=True)
class LabelRecord:
    """A gold label of one judged pair: ``value`` +1 (the candidate's answer is better), -1 (the
    baseline's) or 0; ``source`` ``exact`` (the question's grader on both answers) or ``human``;
    ``pair_sha256`` names the two outputs labelled; ``detail`` what was shown and answered."""

    dataset: str
    question_id: str
    pair_sha256: str
    value: int
    source: str
    detail: dict[str, object]


@dataclass(frozen=True)
class RegisteredQuestion:
    """A question as registered before the first answer (the ``questions`` table's columns)."""

    dataset: str
    question_id: str
    position: int
    prompt_hash: str
    answer: str
    grader: str


@dataclass(frozen=True)
class RunEvent:
    """One session event of a run: ``start``, ``extend``, or ``stop`` with its reason and (sequential runs)
    the number of questions in the in-order sequence at that moment."""

    event: str
    reason: str | None
    stopped_at: int | None
    detail: dict[str, object]
    created_at: float


def _columns(record: type) -> dict[str, object]:
    hints = typing.get_type_hints(record)
    return {f.name: hints[f.name] for f in fields(record)}  # type: ignore[arg-type]


_WRITTEN = {"created_at": float}
_BATCH = dict(arm=str, repeat=int, num_answers=int, completion_tokens=int, wall_s=float)
# The tables of a run's rows besides ``runs``: their columns after ``run_id`` (a record's fields, and when
# the row was written) and their key. second_labels (a second person's label of a labelled pair, which
# the decision never reads) was added within version 4: a flyspec that does not know it ignores it.
_TABLES: dict[str, tuple[dict[str, object], str]] = {
    "questions": (_columns(RegisteredQuestion), "PRIMARY KEY (run_id, dataset, question_id)"),
    "answers": (_columns(AnswerRecord) | _WRITTEN, "UNIQUE (run_id, arm, repeat, dataset, question_id)"),
    "events": (_columns(RunEvent), ""),
    "judgements": (
        _columns(JudgementRecord) | _WRITTEN,
        "UNIQUE (run_id, dataset, question_id, first_lane, second_lane, position, pair_sha256)",
    ),
    "labels": (_columns(LabelRecord) | _WRITTEN, "UNIQUE (run_id, dataset, question_id)"),
    "second_labels": (
        dict(dataset=str, question_id=str, labeller=str, pair_sha256=str, value=int, detail=dict) | _WRITTEN,
        "UNIQUE (run_id, dataset, question_id, labeller)",
    ),
    "batches": (_BATCH | _WRITTEN, ""),
}


class RunNotes(TypedDict, total=False):
    """What a run notes while it runs, beside its registration: facts learned, not choices made (settings
    never hold a secret; ``ledger``: what the alpha ledger said when the run was registered)."""

    arm_settings: dict[str, dict[str, object]]
    judge_settings: dict[str, object]
    dataset_sources: dict[str, str]
    executors: list[dict[str, object]]
    code_sandbox: dict[str, object]
    shared_engine: list[list[str]]
    shared_engine_note: str
    system_fingerprints: dict[str, dict[str, list[str]]]
    prefix_cache: dict[str, int]
    ledger: dict[str, object]


@dataclass(frozen=True)
class RunRecord:
    """A registered run: its kind (``gate``, ``pilot``, ``tune`` or ``calibration``), its registration as
    stored (what a resume is compared with, what a report's JSON shows) and typed (``registered``: read
    it, not the JSON), and its notes."""

    run_id: str
    kind: str
    created_at: float
    registration: dict[str, object]
    notes: RunNotes

    @cached_property
    def registered(self) -> Registration:
        return Registration.read(self.kind, self.registration)

    @property
    def margin(self) -> float:
        return self.registered.margin

    @property
    def alpha(self) -> float:
        return self.registered.alpha

    @property
    def seed(self) -> int:
        return self.registered.seed


def keeping_bets(registration: Registration, stored: Registration | None) -> Registration:
    """``registration`` with the version of the interval's bets that ``stored`` (the run it resumes, if
    any) registered: a judged run keeps the bets its first pairs were registered with, so the same
    command resumes a run registered before the current version."""
    if stored is None or stored.gold is None or registration.gold is None:
        return registration
    bet = stored.gold.bet

    def plan(sequential: SequentialPlan | None) -> SequentialPlan | None:
        if sequential is None or sequential.label_bet is None:
            return sequential
        return replace(sequential, label_bet=bet)

    return replace(
        registration,
        gold=replace(registration.gold, bet=bet),
        sequential=plan(registration.sequential),
        listed=tuple(replace(c, sequential=plan(c.sequential)) for c in registration.listed),
    )


class GateStore:
    """A gate store file. Use as a context manager or call ``close()``."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.parent.exists():
            raise FileNotFoundError(f"store {self.path}: folder {self.path.parent} does not exist")
        self._db = connect(self.path, _TABLES)

    def __enter__(self) -> GateStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection (every row is already committed)."""
        self._db.close()

    # ------------------------------------------------------------------------------ registering

    def keeping_bets(self, run_id: str, registration: Registration) -> Registration:
        """``keeping_bets`` with the run ``run_id`` as stored, if it is."""
        stored = self.get_run(run_id)
        return keeping_bets(registration, stored.registered if stored is not None else None)

    def register(
        self,
        run_id: str,
        registration: Registration,
        questions: list[RegisteredQuestion],
        notes: RunNotes | None = None,
    ) -> bool:
        """Record a run before its first answer; True if (re)registered, False if an identical run resumes.
        A changed run is refused (``check_resumable``), unless it holds no answer: then it is replaced."""
        existing = self.get_run(run_id)
        if existing is not None and not self.check_resumable(run_id, registration, questions):
            return False
        with self._db:  # one transaction: an empty run's old registration is replaced atomically
            if existing is not None:
                for table in (*_TABLES, "runs"):
                    self._db.execute(f"DELETE FROM {table} WHERE run_id = ?", (run_id,))
            self._insert("runs", run_id, registration.kind, time.time(), registration.to_dict(), notes or {})
            for question in questions:
                self._insert("questions", run_id, *astuple(question))
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
        old = {"kind": existing.kind, **existing.registration}
        new = {"kind": registration.kind, **registration.to_dict()}
        changes = [f"{p} (registered {_shown(o)}, now {_shown(n)})" for p, o, n in _differences(old, new)]
        stored = self.questions(run_id)
        if stored != questions:
            changes.append(_question_difference(stored, questions))
        answered = self._db.execute("SELECT 1 FROM answers WHERE run_id = ? LIMIT 1", (run_id,)).fetchone()
        if changes and (holds_data or answered is not None):
            raise ValueError(
                f"run {run_id!r} in {self.path} was registered with different settings, so it cannot be "
                f"resumed: {'; '.join(changes)}. Start a new run with another --run name (stored answers "
                "are kept)."
            )
        return bool(changes)

    def extend_sequential(
        self, run_id: str, registration: Registration, questions: list[RegisteredQuestion]
    ) -> bool:
        """Continue a sequential run past its registered maximum (valid: the confidence sequence holds at
        every number of questions). True when ``run_id`` is registered as ``registration`` but for a smaller
        maximum and its questions start ``questions``: the new ones are appended, the maximum raised and
        the change kept in ``extensions`` and as an ``extend`` event; False (nothing written) otherwise."""
        existing = self.get_run(run_id)
        wanted = registration.to_dict()
        if existing is None or "sequential" not in existing.registration or "sequential" not in wanted:
            return False
        if not all(_GROWN.fullmatch(where) for where, _, _ in _differences(existing.registration, wanted)):
            return False
        stored = self.questions(run_id)
        if len(questions) <= len(stored) or questions[: len(stored)] != stored:
            return False
        grown = Extension(len(stored), len(questions), time.time())
        extended = replace(registration, extensions=(*existing.registered.extensions, grown)).to_dict()
        with self._db:
            self._db.execute(
                "UPDATE runs SET registration = ? WHERE run_id = ?",
                (json.dumps(extended, sort_keys=True), run_id),
            )
            for question in questions[len(stored) :]:
                self._insert("questions", run_id, *astuple(question))
            detail = {"from": grown.start, "to": grown.to}
            self._insert("events", run_id, "extend", None, None, detail, time.time())
        return True

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

    # ------------------------------------------------------------------------------ adding rows

    def _insert(self, table: str, *row: object) -> bool:
        """Insert ``row`` (a dict as its JSON) in the caller's transaction unless its key is stored."""
        values = [json.dumps(v, sort_keys=True) if isinstance(v, dict) else v for v in row]
        sql = f"INSERT INTO {table} VALUES ({', '.join('?' * len(values))}) ON CONFLICT DO NOTHING"
        return self._db.execute(sql, values).rowcount == 1

    def add_question(self, run_id: str, question: RegisteredQuestion) -> bool:
        """Register the next question of a run fed by live traffic; False (nothing written) if stored."""
        with self._db:
            return self._insert("questions", run_id, *astuple(question))

    def add_answer(self, run_id: str, record: AnswerRecord) -> bool:
        """Commit one answer now; False (and nothing written) if that key is already stored."""
        return self.add_answers(run_id, [record]) == 1

    def add_answers(self, run_id: str, records: list[AnswerRecord]) -> int:
        """Commit answers in one transaction (a judged pair's two together or not at all), skipping keys
        already stored; how many were written."""
        with self._db:
            return sum(self._insert("answers", run_id, *astuple(r), time.time()) for r in records)

    def add_batch(
        self, run_id: str, arm: str, repeat: int, num_answers: int, completion_tokens: int, wall_s: float
    ) -> None:
        """Record the wall time of one batch of answers of one arm (the basis of its tokens/s)."""
        with self._db:
            self._insert("batches", run_id, arm, repeat, num_answers, completion_tokens, wall_s, time.time())

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
            self._insert("events", run_id, event, reason, stopped_at, detail or {}, time.time())

    def add_judgement(self, run_id: str, record: JudgementRecord) -> bool:
        """Commit one judge call now; False (and nothing written) if that judgement is already stored."""
        with self._db:
            return self._insert("judgements", run_id, *astuple(record), time.time())

    def add_label(self, run_id: str, record: LabelRecord) -> bool:
        """Commit a gold label; False (nothing written) when the question has one (never replaced)."""
        with self._db:
            return self._insert("labels", run_id, *astuple(record), time.time())

    def add_second_label(self, run_id: str, labeller: str, record: LabelRecord) -> bool:
        """Commit a second person's label of a labelled pair; False (nothing written) if they labelled it."""
        r = record
        row = (r.dataset, r.question_id, labeller, r.pair_sha256, r.value, r.detail, time.time())
        with self._db:
            return self._insert("second_labels", run_id, *row)

    # ------------------------------------------------------------------------------ reading rows

    def _records(
        self, cls: type[Row], table: str, run_id: str, order: str = "created_at, rowid"
    ) -> list[Row]:
        """The rows of ``run_id`` in ``table`` as ``cls`` records (its fields are the columns read)."""
        names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
        query = f"SELECT {', '.join(names)} FROM {table} WHERE run_id = ? ORDER BY {order}"
        rows = self._db.execute(query, (run_id,))
        return [cls(*(_READ.get(n, _same)(v) for n, v in zip(names, row, strict=True))) for row in rows]

    def get_run(self, run_id: str) -> RunRecord | None:
        """The registered run, or None."""
        return next(iter(self._records(RunRecord, "runs", run_id)), None)

    def runs(self) -> list[RunRecord]:
        """Every run in the store, oldest first."""
        ids = [r[0] for r in self._db.execute("SELECT run_id FROM runs ORDER BY created_at, run_id")]
        return [run for run_id in ids if (run := self.get_run(run_id)) is not None]

    def revision(self, run_id: str) -> tuple[object, ...]:
        """A cheap fingerprint of everything a report of ``run_id`` reads: rows are only added, so the row
        counts, and the run's registration and notes, change whenever the report could."""
        counts = " UNION ALL ".join(f"SELECT count(*) FROM {t} WHERE run_id = :run" for t in _TABLES)
        rows = self._db.execute(counts, {"run": run_id}).fetchall()
        run = self._db.execute("SELECT registration, notes FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        return (*(n for (n,) in rows), run)

    def questions(self, run_id: str) -> list[RegisteredQuestion]:
        """The registered questions of a run, in registration order."""
        return self._records(RegisteredQuestion, "questions", run_id, "position")

    def answers(self, run_id: str) -> list[AnswerRecord]:
        """Every stored answer of a run."""
        return self._records(AnswerRecord, "answers", run_id, "arm, repeat, dataset, question_id")

    def events(self, run_id: str) -> list[RunEvent]:
        """The run's session events, oldest first."""
        return self._records(RunEvent, "events", run_id)

    def judgements(self, run_id: str) -> list[JudgementRecord]:
        """Every stored judge call of a run, oldest first."""
        return self._records(JudgementRecord, "judgements", run_id)

    def labels(self, run_id: str) -> dict[tuple[str, str], LabelRecord]:
        """Every gold label of a run, by ``(dataset, question_id)``."""
        return {(r.dataset, r.question_id): r for r in self._records(LabelRecord, "labels", run_id)}

    def second_labels(self, run_id: str) -> list[LabelRecord]:
        """Every second label of a run, oldest first (the labeller is in each record's ``detail``)."""
        rows = self._db.execute(
            "SELECT dataset, question_id, pair_sha256, value, detail FROM second_labels WHERE run_id = ? "
            "ORDER BY created_at, rowid",
            (run_id,),
        )
        return [LabelRecord(d, q, h, v, "human", json.loads(t)) for d, q, h, v, t in rows]

    def answer_times(self, run_id: str) -> dict[tuple[str, int, str, str], float]:
        """When each answer was stored (epoch seconds), by ``(arm, repeat, dataset, question_id)``."""
        rows = self._db.execute(
            "SELECT arm, repeat, dataset, question_id, created_at FROM answers WHERE run_id = ?", (run_id,)
        )
        return {(a, r, d, q): t for a, r, d, q, t in rows}

    def answered_keys(self, run_id: str) -> set[tuple[str, int, str, str]]:
        """``(arm, repeat, dataset, question_id)`` of every stored answer (what a resume skips)."""
        return set(self.answer_times(run_id))

    def batches(self, run_id: str) -> list[tuple[str, int, int, int, float]]:
        """``(arm, repeat, num_answers, completion_tokens, wall_s)`` of every recorded batch."""
        rows = self._db.execute(f"SELECT {', '.join(_BATCH)} FROM batches WHERE run_id = ?", (run_id,))
        return [tuple(r) for r in rows]  # type: ignore[misc]


def _differences(old: object, new: object, path: str = "") -> list[tuple[str, object, object]]:
    """Where two JSON-like values differ, as ``(path, old, new)``, through objects and lists of one length
    (``_MISSING``: a key one side lacks)."""
    if isinstance(old, dict) and isinstance(new, dict):
        keys = sorted(set(old) | set(new), key=str)
        paths = [
            (f"{path}.{k}" if path else str(k), old.get(k, _MISSING), new.get(k, _MISSING)) for k in keys
        ]
    elif isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        paths = [(f"{path}.{i}", o, n) for i, (o, n) in enumerate(zip(old, new, strict=True))]
    else:
        return [] if old == new else [(path or "value", old, new)]
    return [d for where, o, n in paths for d in _differences(o, n, where)]


def _question_difference(stored: list[RegisteredQuestion], new: list[RegisteredQuestion]) -> str:
    if len(stored) != len(new):
        return f"questions (registered {len(stored)}, now {len(new)})"
    for old, cur in zip(stored, new, strict=True):
        if old != cur:
            changed = [k for k, v in asdict(old).items() if asdict(cur)[k] != v]
            return f"question {old.dataset}/{old.question_id} ({', '.join(changed)} changed)"
    return "questions"
