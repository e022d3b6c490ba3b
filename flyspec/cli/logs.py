"""How the command line shows the package's log: one line per event on stderr, with the seconds since
the command started, so a long load, quantization, kernel check or warm-up shows life from its first
second (stdout stays for results and --json)."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

_STARTED = time.monotonic()


class _Elapsed(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        level = "" if record.levelno < logging.WARNING else f"{record.levelname.lower()}: "
        return f"[{time.monotonic() - _STARTED:7.1f}s] {level}{record.getMessage()}"


class _CurrentStderr(logging.StreamHandler):
    """A handler writing to ``sys.stderr`` as it is when a record is emitted, not as it was when logging
    was configured: a stream swapped in later (a test's capture, a redirect) may be closed by then."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass


def configure_logging(level: int = logging.INFO) -> None:
    """Show flyspec's own log (the `flyspec` logger and its children) at `level` on stderr; other
    libraries' logs are left alone. Calling it again only changes the level."""
    root = logging.getLogger("flyspec")
    root.setLevel(level)
    if not any(getattr(h, "_flyspec", False) for h in root.handlers):
        handler = _CurrentStderr()
        handler.setFormatter(_Elapsed())
        handler._flyspec = True  # type: ignore[attr-defined]
        root.addHandler(handler)
        root.propagate = False
