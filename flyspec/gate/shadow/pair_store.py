"""A pair sink that keeps every ``MirroredPair`` in SQLite (standard library): one row per pair,
committed as it arrives, in a file only its owner may read (mode 0600)."""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import threading
from pathlib import Path

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
    candidate_ok INTEGER NOT NULL
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


class SqlitePairStore:
    """A sink for the mirror (``store(pair)``); safe to call from any one thread at a time or several."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        create_private(self.path)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False)
        self._db.execute(_SCHEMA)
        self._db.commit()

    def __call__(self, pair: MirroredPair) -> None:
        """Store one pair and commit it before returning."""
        row = pair.to_dict()
        with self._lock:
            self._db.execute(
                "INSERT INTO shadow_pairs (received_at, source, route, request, baseline, candidate, "
                "candidate_ok) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    pair.received_at,
                    pair.source,
                    pair.route,
                    json.dumps(row["request"]),
                    json.dumps(row["baseline"]),
                    json.dumps(row["candidate"]),
                    int(pair.candidate.ok),
                ),
            )
            self._db.commit()

    def count(self) -> int:
        """Pairs stored so far."""
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM shadow_pairs").fetchone()[0]

    def close(self) -> None:
        """Close the database."""
        with self._lock:
            self._db.close()
