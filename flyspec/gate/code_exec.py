"""Run an untrusted Python program (a model's code plus its tests) in a separate, limited process.

Every program runs in a fresh interpreter (``sys.executable -S -s -P -B``: no site-packages, no user site,
no script folder on ``sys.path``, no bytecode written) in a new temporary directory, with an environment of
four variables (``PATH``, ``HOME``, ``LANG``, ``PYTHONHASHSEED=0``), stdin closed, stdout discarded and
stderr kept in that directory. Before the program's first line the child (``_code_exec_child.py``):

- sets hard resource limits: address space, CPU seconds, file size, open files, processes, no core dumps;
- when started as root, drops to uid/gid 65534 (``nobody``), because root ignores the process limit;
- seeds ``random`` with 0 and disables destructive or outward calls in-process (``os.system``, ``fork``,
  ``exec*``, ``kill``, file removal and renaming, ``subprocess``, ``socket``, ``shutil.rmtree``,
  ``ctypes``, ``multiprocessing``, ...).

When the ``unshare`` tool can create them here (root, or unprivileged user namespaces), the child also
gets its own network namespace (only a down loopback: no network at all) and its own PID namespace, so
that when it dies the kernel kills everything it started. The parent enforces a wall-clock timeout by
killing the whole process group. The program passes only if it ran to its end and the child printed a
one-time token with ``passed`` as its last line: exiting early (``sys.exit``, ``os._exit``, a signal, a
crash) can never pass. See ``isolation()`` for what this machine provides.

Not protected against: reading files that ``nobody`` (or, without root, the gate's own user) may read;
writing world-writable folders such as /tmp (up to the file-size limit); CPU and memory contention with
the gate while it runs; a program written to find the token in its own interpreter's memory and print
it, or to undo the in-process guard (the kernel limits and namespaces still hold); and, without
namespaces, network access by code that gets around the in-process guard.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

_CHILD = Path(__file__).with_name("_code_exec_child.py")
_NOBODY = 65534
_TAIL_BYTES = 8192
STATUSES = ("passed", "failed", "error", "blocked", "exit", "memory", "timeout", "killed")


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed run; the defaults suit HumanEval/MBPP tests (each well under a second)."""

    timeout_s: float = 20.0
    cpu_s: int = 10
    memory_bytes: int = 1 << 30
    file_bytes: int = 16 << 20
    open_files: int = 64
    processes: int = 64

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"SandboxLimits.{name}={value!r}: must be a positive number")


@dataclass(frozen=True)
class ExecResult:
    """Outcome of one run: ``passed`` only when the program ran to its end without an exception.

    ``status`` is one of ``STATUSES``: ``failed`` (AssertionError), ``error`` (another exception, including
    a SyntaxError), ``blocked`` (a disabled call), ``exit`` (``sys.exit``), ``memory`` (MemoryError),
    ``timeout`` (wall clock), ``killed`` (ended without reporting: a signal such as the CPU or file-size
    limit, ``os._exit``, a crash). ``detail`` is a one-line explanation.
    """

    passed: bool
    status: str
    detail: str
    wall_s: float


@dataclass(frozen=True)
class Isolation:
    """What the kernel adds around the sandbox on this machine (probed once per process).

    ``network_namespace``/``pid_namespace``: the child has its own (no network; its processes die with
    it). ``uid``: the user the program runs as (65534 = nobody when the gate runs as root).
    ``reads_any_file``: the program keeps CAP_DAC_READ_SEARCH, needed when nobody cannot read this
    Python's standard library (e.g. an interpreter under /root); it can then read, not write, any file.
    """

    network_namespace: bool
    pid_namespace: bool
    uid: int
    reads_any_file: bool
    prefix: tuple[str, ...]


def _candidates() -> list[Isolation]:
    """Wrappers to try, strongest first; the first that starts this very interpreter wins."""
    unshare, setpriv = shutil.which("unshare"), shutil.which("setpriv")
    namespaces: list[tuple[str, ...]] = []
    if unshare is not None:
        # Unprivileged, a user namespace is what makes the other two namespaces allowed.
        user = () if os.geteuid() == 0 else ("--user",)
        namespaces.append((unshare, *user, "--net", "--pid", "--fork", "--kill-child", "--"))
    namespaces.append(())
    drops: list[tuple[tuple[str, ...], int, bool]] = []
    if os.geteuid() == 0 and setpriv is not None:
        base = (setpriv, f"--reuid={_NOBODY}", f"--regid={_NOBODY}", "--clear-groups", "--no-new-privs")
        keep = ("--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search")
        drops.append(((*base, "--"), _NOBODY, False))
        drops.append(((*base, *keep, "--bounding-set=-all,+dac_read_search", "--"), _NOBODY, True))
    drops.append(((), os.geteuid(), False))
    return [
        Isolation(bool(ns), bool(ns), uid, reads_any, (*ns, *drop))
        for ns in namespaces
        for drop, uid, reads_any in drops
    ]


@functools.cache
def isolation() -> Isolation:
    """The strongest isolation that runs this interpreter with its own standard library here."""
    # The child must import the same standard library as the gate; an unreadable one makes Python fall
    # back to another installation (or fail), which would make grades depend on the machine.
    expected = f"{sys.version}|{os.path.dirname(os.__file__)}"
    probe = "import os, sys, random; print(f'{sys.version}|{os.path.dirname(os.__file__)}')"
    for candidate in _candidates():
        try:
            done = subprocess.run(
                [*candidate.prefix, sys.executable, "-S", "-c", probe],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=30,
                cwd="/",
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if done.returncode == 0 and done.stdout.strip() == expected:
            return candidate
    raise RuntimeError(f"the code sandbox cannot start {sys.executable} -S here")


def _read_tail(path: Path) -> str:
    with open(path, "rb") as handle:
        handle.seek(0, os.SEEK_END)
        handle.seek(max(0, handle.tell() - _TAIL_BYTES))
        return handle.read().decode("utf-8", errors="replace")


def _read_available(fd: int) -> str:
    """What is in a pipe now, without waiting for EOF (a straggler may still hold the write end)."""
    os.set_blocking(fd, False)
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode("utf-8", errors="replace")


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """Kill the child and everything in its process group, and reap the child."""
    if proc.poll() is None and isolation().pid_namespace:
        # Kill unshare's child first so that unshare reaps it; killing both at once would leave the
        # child to whatever reaps orphans on this machine.
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(proc.pid).children():
                child.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _outcome(token: str, reported: str, stderr: str, returncode: int) -> tuple[str, str]:
    for line in reported.splitlines():
        if line.startswith(token + " "):
            status, _, detail = line[len(token) + 1 :].partition(" ")
            return status, detail
    if returncode < 0:
        reason = {
            signal.SIGXCPU: "the CPU-time limit",
            signal.SIGXFSZ: "the file-size limit",
            signal.SIGKILL: "SIGKILL",
        }.get(-returncode, signal.Signals(-returncode).name)
        return "killed", f"the program was killed by {reason}"
    last = (stderr.strip().splitlines() or ["no output"])[-1]
    if last.startswith("unshare: "):
        # unshare exits 1 with its own message when its child dies of a signal it cannot re-raise.
        return "killed", "the program was killed by a signal (a resource limit such as file size, or a crash)"
    return "killed", f"the program ended before its tests finished (exit code {returncode}; {last[:300]})"


def run_program(source: str, limits: SandboxLimits | None = None) -> ExecResult:
    """Run ``source`` once in the sandbox and say whether it ran to its end; never raises for the program's
    sake (only for a bad ``source`` type or if the sandbox itself cannot start). Safe to call from any
    thread and many times: the child and its process group are always killed and reaped, and the
    temporary directory is removed."""
    if not isinstance(source, str):
        raise ValueError(f"source: must be a str, got {type(source).__name__}")
    limits = limits or SandboxLimits()
    token = secrets.token_hex(16)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="flyspec-code-") as tmp:
        work = Path(tmp)
        program, child = work / "program.py", work / "runner.py"
        program.write_text(source, encoding="utf-8")
        shutil.copyfile(_CHILD, child)  # the installed package may sit where the program's user cannot read
        sandbox = isolation()
        if sandbox.uid != os.geteuid():
            for path in (work, program, child):
                os.chown(path, sandbox.uid, sandbox.uid)
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
        child_limits = {k: int(v) for k, v in asdict(limits).items() if k != "timeout_s"}
        token_read, token_write = os.pipe()
        os.write(token_write, token.encode())
        os.close(token_write)
        status_read, status_write = os.pipe()
        command = [
            *sandbox.prefix,
            sys.executable,
            "-S",
            "-s",
            "-P",
            "-B",
            # Relative to the working directory: the folders above it may be closed to the program's user.
            child.name,
            str(token_read),
            str(status_write),
            json.dumps(child_limits),
            program.name,
        ]
        try:
            with open(work / "stderr", "wb") as err:
                try:
                    proc = subprocess.Popen(
                        command,
                        cwd=tmp,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.DEVNULL,
                        stderr=err,
                        pass_fds=(token_read, status_write),
                        start_new_session=True,
                    )
                finally:
                    os.close(token_read)
                    os.close(status_write)
                timed_out = False
                try:
                    proc.wait(timeout=limits.timeout_s)
                except subprocess.TimeoutExpired:
                    timed_out = True
                # Kill the group even after a normal exit: anything the program left behind goes with it.
                _kill(proc)
            status_line = _read_available(status_read)
        finally:
            os.close(status_read)
        wall = time.monotonic() - start
        if timed_out:
            return ExecResult(False, "timeout", f"no result within {limits.timeout_s:g} s (wall clock)", wall)
        status, detail = _outcome(token, status_line, _read_tail(work / "stderr"), proc.returncode)
    if status not in STATUSES:
        status, detail = "killed", f"unrecognised result line {status!r}"
    return ExecResult(status == "passed", status, detail, wall)


def run_programs(
    sources: Sequence[str], limits: SandboxLimits | None = None, workers: int | None = None
) -> list[ExecResult]:
    """``run_program`` for many programs, ``workers`` at a time (default: the CPU count), results in order."""
    if workers is None:
        workers = os.cpu_count() or 1
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers={workers!r}: must be a positive integer")
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda s: run_program(s, limits), sources))
