"""One writer per gate store: a lock file beside the store, held while a run answers questions.

Two `gate run` processes on one store would both answer every question (the store keeps the first answer
and drops the second, so all the second's work is wasted). The lock refuses the second process with a
message naming the holder.

Why an ``flock`` on ``STORE.lock`` rather than a lock row in SQLite or the ``filelock`` package: the kernel
releases an ``flock`` when its process ends, however it ends (``kill -9`` included), so a dead holder never
leaves a stale lock and no PID-liveness guess is needed; and the holder can write who it is into the same
file, which a refused process reads back (``filelock`` truncates the file on every attempt, and its soft
fallback can leave stale locks). ``gate report`` only reads the store and never takes the lock.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path


class StoreBusyError(OSError):
    """Another process holds the store's lock (the message names it)."""


def lock_path(store: str | Path) -> Path:
    """The lock file of a store: ``STORE.lock`` beside it."""
    store = Path(store)
    return store.with_name(store.name + ".lock")


def _describe(holder: dict[str, object]) -> str:
    if not holder:
        return "another process (it has not written its details yet)"
    started = holder.get("started_at")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if started else "?"
    alive = ""
    if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
        alive = "" if _pid_alive(holder["pid"]) else " (that PID is gone; its lock is being released)"
    return (
        f"gate run {holder.get('run_id')!r} (PID {holder.get('pid')}{alive} on {holder.get('host')}, "
        f"started {when}: {holder.get('command')})"
    )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True


class StoreLock:
    """Exclusive lock of one store for one process; use as a context manager.

    ``acquire`` raises StoreBusyError naming the holder (run, PID, host, start time, command) when another
    process holds it. Released on exit, and by the kernel if the process dies.
    """

    def __init__(self, store: str | Path, run_id: str) -> None:
        self.store = Path(store)
        self.path = lock_path(store)
        self.run_id = run_id
        self._fd: int | None = None

    def acquire(self) -> StoreLock:
        """Take the lock now or raise StoreBusyError; never waits."""
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
