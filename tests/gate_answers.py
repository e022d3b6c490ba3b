"""Watching a `flyspec gate run` in another process through its store: how many answers it has
committed, and waiting for the first few (to kill or interrupt it mid-run)."""

from __future__ import annotations

import sqlite3
import subprocess
import time
from pathlib import Path


def stored_answers(store: Path) -> int:
    """Answers committed to the gate store so far; 0 before the file or its schema exists."""
    if not store.exists():
        return 0
    try:
        with sqlite3.connect(f"file:{store}?mode=ro", uri=True, timeout=5) as db:
            return db.execute("SELECT COUNT(*) FROM answers").fetchone()[0]
    except sqlite3.OperationalError:  # the schema is not created yet
        return 0


def wait_for_answers(proc: subprocess.Popen, store: Path, at_least: int = 1, timeout_s: float = 300) -> None:
    """Poll until `store` holds `at_least` answers; AssertionError, with the run's output, when `proc`
    ends first, or when `timeout_s` pass."""
    deadline = time.monotonic() + timeout_s
    while stored_answers(store) < at_least:
        assert proc.poll() is None, f"gate run ended before {at_least} answers: {proc.communicate()}"
        assert time.monotonic() < deadline, f"fewer than {at_least} answers stored within {timeout_s:.0f} s"
        time.sleep(0.02)
