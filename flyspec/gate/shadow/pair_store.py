"""The record of every ``MirroredPair`` in SQLite (standard library): one row of ``shadow_pairs`` per pair
(the request, both answers with their timings, token counts and acceptance counters), committed as it
arrives, in a file only its owner may read (mode 0600). A shadow run keeps this table in its gate store,
beside the questions and answers the gate reads (flyspec/gate/shadow/run.py); the row id is the pair's
question id there."""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flyspec.gate.shadow.pairs import MirroredPair

_SCHEMA = """
CREATE TABLE IF NOT EXISTS shadow_pairs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    received_at REAL NOT NULL,
    source TEXT NOT NULL,
    route TEXT NOT NULL,
    request TEXT NOT NULL,
    baseline TEXT NOT NULL,
    candidate TEXT NOT NULL,
    candidate_ok INTEGER NOT NULL,
    run_id TEXT NOT NULL DEFAULT ''
)
"""


def create_private(path: Path) -> None:
    """Create ``path`` readable and writable by its owner only; an existing file that others may read or
    write is refused (ValueError naming the mode), since it would expose the traffic stored in it."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            raise ValueError(
                f"--store {path}: mode {mode:o} lets others read stored traffic; run `chmod 600 {path}`"
            ) from None


@dataclass(frozen=True)
class StoredPair:
    """One stored row: its id (the order pairs were stored in), the request, and the two answers as
    ``ArmAnswer.to_dict`` wrote them."""

    id: int
    source: str
    route: str
    request: dict[str, Any]
    baseline: dict[str, Any]
    candidate: dict[str, Any]


class SqlitePairStore:
    """A sink for the mirror (``store(pair)``) keeping the pairs of run ``run_id``; safe to call from any
    one thread at a time or several."""

    def __init__(self, path: str | Path, run_id: str = "") -> None:
        self.path = Path(path)
        self.run_id = run_id
        create_private(self.path)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, timeout=30.0)
        self._db.execute(_SCHEMA)
        self._db.commit()

    def __call__(self, pair: MirroredPair) -> int:
        """Store one pair and commit it before returning; returns its row id."""
        row = pair.to_dict()
        with self._lock:
            cursor = self._db.execute(
                "INSERT INTO shadow_pairs (received_at, source, route, request, baseline, candidate, "
                "candidate_ok, run_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    pair.received_at,
                    pair.source,
                    pair.route,
                    json.dumps(row["request"]),
                    json.dumps(row["baseline"]),
                    json.dumps(row["candidate"]),
                    int(pair.candidate.ok),
                    self.run_id,
                ),
            )
            self._db.commit()
        assert cursor.lastrowid is not None
        return cursor.lastrowid

    def count(self) -> int:
        """Pairs of this run stored so far."""
        with self._lock:
            sql = "SELECT COUNT(*) FROM shadow_pairs WHERE run_id = ?"
            return self._db.execute(sql, (self.run_id,)).fetchone()[0]

    def pairs(self, after: int = 0) -> list[StoredPair]:
        """This run's stored pairs with an id above ``after``, in the order they were stored."""
        with self._lock:
            rows = self._db.execute(
                "SELECT id, source, route, request, baseline, candidate FROM shadow_pairs "
                "WHERE run_id = ? AND id > ? ORDER BY id",
                (self.run_id, after),
            ).fetchall()
        return [StoredPair(i, s, r, json.loads(q), json.loads(b), json.loads(c)) for i, s, r, q, b, c in rows]

    def close(self) -> None:
        """Close the database."""
        with self._lock:
            self._db.close()
