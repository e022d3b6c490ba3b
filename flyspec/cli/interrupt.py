"""Ctrl-C ends a command within 2 s, also while one long operation holds the main thread.

Python runs its SIGINT handler only between bytecodes, so one long C++ operation delays
KeyboardInterrupt until it returns: a bf16 matmul over a 2,000-token prefill chunk, emulated on an AVX2
CPU, takes several seconds. The C-level handler still writes the signal number to the wakeup fd at
once. A daemon thread waits on that fd; when the Python handler has not run within a grace period (the
main thread is stuck in one operation), it prints the usual line and leaves. When the handler did run,
the command's own Ctrl-C handling (a gate pausing and saying how to resume) goes on undisturbed.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType
from typing import NoReturn

__all__ = ["GRACE_S", "arm", "leave"]

# Leaves room within the 2 s promise for printing and os._exit.
GRACE_S = 1.2

_leaving = threading.Lock()
_handled = threading.Event()
_armed = False


def leave(code: int, line: str | None = None) -> NoReturn:
    """Print `line` on stderr, flush and exit without the interpreter's teardown, which takes 1-3 s once
    torch and transformers are imported. Nothing is lost: results are printed, and the gate commits
    every answer as it arrives."""
    _leaving.acquire()  # when the watchdog is leaving already, wait here for its os._exit
    if line is not None:
        print(line, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    _handled.set()
    raise KeyboardInterrupt


def _watch(read_fd: int) -> None:
    while data := os.read(read_fd, 512):
        if signal.SIGINT not in data:
            continue
        if _handled.wait(GRACE_S) or signal.getsignal(signal.SIGINT) is not _on_sigint:
            _handled.clear()  # handled, or a command that installed its own handler (the server) owns it
            continue
        if _leaving.acquire(blocking=False):  # else the main thread is leaving already
            print("interrupted", file=sys.stderr)
            sys.stderr.flush()
            os._exit(130)


def arm() -> None:
    """Install the watchdog (once, from the main thread). A process that ignores SIGINT (started in the
    background) keeps ignoring it, and a command that installs its own handler later (the server's
    uvicorn) handles Ctrl-C itself."""
    global _armed
    if _armed or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    signal.signal(signal.SIGINT, _on_sigint)
    threading.Thread(target=_watch, args=(read_fd,), name="ctrl-c-watchdog", daemon=True).start()
    _armed = True
