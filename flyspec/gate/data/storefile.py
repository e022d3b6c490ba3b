"""The gate store's file: opening it (the one migration to the current schema version; a run
under a retired judged rule refused), and its one-writer lock (docs/architecture.md, "The gate's store")."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sqlite3
import sys
import time
import typing
from collections.abc import Mapping
from pathlib import Path

SCHEMA_VERSION = 4
# Version 2 added the judgements table, version 3 the labels table (an older store gains them, empty, when
# opened); version 4 keeps a run's margin, alpha and seed in its registration only (an older store's
# copies in the runs table are dropped when opened: they were written from the registration).
_DROPPED_COLUMNS = ("margin", "alpha", "seed")
# The judged rules this flyspec no longer decides, with what each did, and the last flyspec (0.1.0, by its
# git commit) that reads runs registered under them.
RETIRED_RULES = {
    "judged run registered before gold labels": "the judge's undecided pairs counted against the claim",
    "gold-label draw 1": "the pairs drawn for a gold label were the start of the question order",
}
LAST_READER = "82c2716"

_RUNS = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    created_at REAL NOT NULL,
    registration TEXT NOT NULL,
    notes TEXT NOT NULL
);
"""


_SQL_TYPES = {str: "TEXT", int: "INTEGER", float: "REAL", bool: "INTEGER", dict: "TEXT"}


def _create(table: str, columns: Mapping[str, object], key: str) -> str:
    """The table's CREATE statement: a column per type, NOT NULL unless the type admits None."""
    lines = ["run_id TEXT NOT NULL REFERENCES runs(run_id)"]
    for name, hint in columns.items():
        optional = type(None) in typing.get_args(hint)
        (kind,) = [a for a in typing.get_args(hint) if a is not type(None)] if optional else [hint]
        lines.append(f"{name} {_SQL_TYPES[typing.get_origin(kind) or kind]}{'' if optional else ' NOT NULL'}")
    return f"CREATE TABLE IF NOT EXISTS {table} ({', '.join([*lines, key] if key else lines)});\n"


def connect(path: Path, tables: Mapping[str, tuple[Mapping[str, object], str]]) -> sqlite3.Connection:
    """The store at ``path``, opened and brought to ``SCHEMA_VERSION``: the ``runs`` table and ``tables``
    (name -> columns after ``run_id`` by type, and key) created where missing. ValueError: not a gate
    store, one a newer flyspec wrote, or one holding a run under a retired judged rule."""
    try:
        db = sqlite3.connect(path, timeout=30.0)
        # Before anything is written, so a refused store stays as it was, for the flyspec that reads it.
        if db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'runs'").fetchone():
            for run_id, kind, stored in db.execute("SELECT run_id, kind, registration FROM runs").fetchall():
                refuse_retired(kind, json.loads(stored), f"run {run_id!r} in store {path}")
        db.execute("PRAGMA journal_mode=WAL")
        # FULL: a committed answer survives a power cut, not only a process kill; one fsync per answer is
        # negligible next to generating it.
        db.execute("PRAGMA synchronous=FULL")
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if not 0 <= version <= SCHEMA_VERSION:
            raise ValueError(
                f"store {path}: schema version {version}, this flyspec reads versions up to {SCHEMA_VERSION}"
            )
        with db:
            db.executescript(_RUNS + "".join(_create(name, *spec) for name, spec in tables.items()))
            columns = {row[1] for row in db.execute("PRAGMA table_info(runs)")}
            for column in set(_DROPPED_COLUMNS) & columns:
                db.execute(f"ALTER TABLE runs DROP COLUMN {column}")
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
    except sqlite3.DatabaseError as exc:
        raise ValueError(f"store {path} is not a gate store (SQLite says: {exc})") from None
    return db


def refuse_retired(kind: str, stored: Mapping[str, object], where: str) -> None:
    """ValueError naming the rule and the flyspec that reads it, for a run (``where``) registered under a
    retired judged rule: its decision would not be a valid test."""
    judge, gold = stored.get("judge"), stored.get("gold")
    if kind not in ("gate", "pilot"):
        return
    if isinstance(gold, Mapping) and "draw" not in gold:
        rule = "gold-label draw 1"
    elif isinstance(judge, Mapping) and not isinstance(gold, Mapping):
        rule = "judged run registered before gold labels"
    else:
        return
    raise ValueError(
        f"{where} was registered under a retired rule, the {rule} ({RETIRED_RULES[rule]}), so its decision "
        f"would not be a valid test and this flyspec does not read it: use flyspec at git commit "
        f"{LAST_READER} or earlier to read it (flyspec 0.1.0 as of that commit), and start a new judged run"
    )


# ----------------------------------------------------------------------------------- one writer
# An flock on STORE.lock, not a lock row in SQLite or the filelock package: the kernel releases it when
# its process ends, however it ends (kill -9 too), so no lock goes stale, and the holder writes who it is
# into the same file for a refused process to read (filelock truncates the file on every attempt).


class StoreBusyError(OSError):
    """Another process holds the store's lock (the message names it)."""


def lock_path(store: str | Path) -> Path:
    """The lock file of a store: ``STORE.lock`` beside it."""
    store = Path(store)
    return store.with_name(store.name + ".lock")


class StoreLock:
    """Exclusive lock of one store for one process while it answers questions (a second process on the
    store would redo every answer for nothing); use as a context manager. Released on exit, and by the
    kernel if the process dies; ``gate report`` only reads and never takes it."""

    def __init__(self, store: str | Path, run_id: str) -> None:
        self.store = Path(store)
        self.path = lock_path(store)
        self.run_id = run_id
        self._fd: int | None = None

    def acquire(self) -> StoreLock:
        """Take the lock now or raise StoreBusyError naming the holder; never waits."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = read_holder(self.path)
            os.close(fd)
            raise StoreBusyError(
                f"store {self.store} is in use by {_describe(holder)}; wait for it to finish "
                "or stop it, then rerun (the lock is released as soon as that process ends, even if killed)"
            ) from None
        holder = {
            "run_id": self.run_id,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started_at": time.time(),
            "command": " ".join(sys.argv) or sys.executable,
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Give the lock back (the file stays; an unlocked file means a free store)."""
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> StoreLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def read_holder(path: str | Path) -> dict[str, object]:
    """What the holder wrote into a lock file ({} when empty or unreadable)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8") or "{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _describe(holder: dict[str, object]) -> str:
    if not holder:
        return "another process (it has not written its details yet)"
    started = holder.get("started_at")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if started else "?"
    alive = ""
    if holder.get("host") == socket.gethostname() and isinstance(pid := holder.get("pid"), int):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            alive = " (that PID is gone; its lock is being released)"
        except PermissionError:  # it exists, under another user
            pass
    return (
        f"gate run {holder.get('run_id')!r} (PID {holder.get('pid')}{alive} on {holder.get('host')}, "
        f"started {when}: {holder.get('command')})"
    )
