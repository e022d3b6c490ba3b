"""The gate store's SQLite tables and opening a store file: the schema version, the one migration that
brings an older store to it when opened, and the journal settings that make each committed answer
durable."""

from __future__ import annotations

import sqlite3
from pathlib import Path

SCHEMA_VERSION = 4
# Version 2 added the judgements table, version 3 the labels table (an older store gains them, empty, when
# opened); version 4 keeps a run's margin, alpha and seed in its registration only (an older store's
# copies in the runs table are dropped when opened: they were written from the registration).
_READABLE_VERSIONS = (0, 1, 2, 3, SCHEMA_VERSION)
_DROPPED_COLUMNS = ("margin", "alpha", "seed")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    created_at REAL NOT NULL,
    registration TEXT NOT NULL,
    notes TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS questions (
    run_id TEXT NOT NULL REFERENCES runs(run_id),
    dataset TEXT NOT NULL,
    question_id TEXT NOT NULL,
    position INTEGER NOT NULL,
    prompt_hash TEXT NOT NULL,
    answer TEXT NOT NULL,
    grader TEXT NOT NULL,
    PRIMARY KEY (run_id, dataset, question_id)
);
CREATE TABLE IF NOT EXISTS answers (
    run_id TEXT NOT NULL REFERENCES runs(run_id),
    arm TEXT NOT NULL,
    repeat INTEGER NOT NULL,
    dataset TEXT NOT NULL,
    question_id TEXT NOT NULL,
    seed INTEGER NOT NULL,
    output TEXT NOT NULL,
    extracted TEXT,
    correct INTEGER NOT NULL,
    finish_reason TEXT,
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    latency_s REAL NOT NULL,
    num_drafts INTEGER,
    num_draft_tokens INTEGER,
    num_accepted_tokens INTEGER,
    num_forgiven_tokens INTEGER,
    source TEXT NOT NULL,
    created_at REAL NOT NULL,
    UNIQUE (run_id, arm, repeat, dataset, question_id)
);
CREATE TABLE IF NOT EXISTS events (
    run_id TEXT NOT NULL REFERENCES runs(run_id),
    event TEXT NOT NULL,
    reason TEXT,
    stopped_at INTEGER,
    detail TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS judgements (
    run_id TEXT NOT NULL REFERENCES runs(run_id),
    dataset TEXT NOT NULL,
    question_id TEXT NOT NULL,
    first_lane TEXT NOT NULL,
    second_lane TEXT NOT NULL,
    position TEXT NOT NULL,
    pair_sha256 TEXT NOT NULL,
    verdict TEXT,
    preferred TEXT NOT NULL,
    output TEXT NOT NULL,
    latency_s REAL NOT NULL,
    source TEXT NOT NULL,
    created_at REAL NOT NULL,
    UNIQUE (run_id, dataset, question_id, first_lane, second_lane, position, pair_sha256)
);
CREATE TABLE IF NOT EXISTS labels (
    run_id TEXT NOT NULL REFERENCES runs(run_id),
    dataset TEXT NOT NULL,
    question_id TEXT NOT NULL,
    pair_sha256 TEXT NOT NULL,
    value INTEGER NOT NULL,
    source TEXT NOT NULL,
    detail TEXT NOT NULL,
    created_at REAL NOT NULL,
    UNIQUE (run_id, dataset, question_id)
);
-- A second person's label of a pair that already has its gold label (the labelling page's agreement
-- between labellers); the decision never reads it. Added within version 4: a store gains it, empty, when
-- opened, and a flyspec that does not know it ignores it.
CREATE TABLE IF NOT EXISTS second_labels (
    run_id TEXT NOT NULL REFERENCES runs(run_id),
    dataset TEXT NOT NULL,
    question_id TEXT NOT NULL,
    labeller TEXT NOT NULL,
    pair_sha256 TEXT NOT NULL,
    value INTEGER NOT NULL,
    detail TEXT NOT NULL,
    created_at REAL NOT NULL,
    UNIQUE (run_id, dataset, question_id, labeller)
);
CREATE TABLE IF NOT EXISTS batches (
    run_id TEXT NOT NULL REFERENCES runs(run_id),
    arm TEXT NOT NULL,
    repeat INTEGER NOT NULL,
    num_answers INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    wall_s REAL NOT NULL,
    created_at REAL NOT NULL
);
"""


def connect(path: Path) -> sqlite3.Connection:
    """The store at ``path``, opened and brought to ``SCHEMA_VERSION`` (ValueError: not a gate store, or one
    a newer flyspec wrote)."""
    try:
        db = sqlite3.connect(path, timeout=30.0)
        db.execute("PRAGMA journal_mode=WAL")
        # FULL: a committed answer survives a power cut, not only a process kill; one fsync per answer is
        # negligible next to generating it.
        db.execute("PRAGMA synchronous=FULL")
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version not in _READABLE_VERSIONS:
            raise ValueError(
                f"store {path}: schema version {version}, this flyspec reads versions up to {SCHEMA_VERSION}"
            )
        with db:
            db.executescript(_SCHEMA)
            _migrate(db)
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
    except sqlite3.DatabaseError as exc:
        raise ValueError(f"store {path} is not a gate store (SQLite says: {exc})") from None
    return db


def _migrate(db: sqlite3.Connection) -> None:
    """Bring a store of any readable version to ``SCHEMA_VERSION`` (the tables it lacks are already made)."""
    columns = {row[1] for row in db.execute("PRAGMA table_info(runs)")}
    for column in _DROPPED_COLUMNS:
        if column in columns:
            db.execute(f"ALTER TABLE runs DROP COLUMN {column}")
