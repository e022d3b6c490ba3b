"""The code sandbox: hostile or broken programs are graded wrong within the limits, the gate's process
survives, nothing is left behind, and the same program always gets the same result."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from flyspec.gate.code_exec import STATUSES, SandboxLimits, isolation, run_program, run_programs

LIMITS = SandboxLimits(timeout_s=6, cpu_s=2)

# (name, program, expected status). Every program would "pass" if the sandbox let it finish quietly.
HOSTILE = [
    ("infinite loop", "while True:\n    pass\n", "timeout"),
    ("sleeps forever", "import time\ntime.sleep(3600)\n", "timeout"),
    ("allocates 10 GB", "block = bytearray(10 * 1024**3)\n", "memory"),
    ("list of 10 GB", "items = [0] * (10 * 1024**3 // 8)\n", "memory"),
    ("os.system", "import os\nos.system('touch /tmp/flyspec-sandbox-was-here')\n", "blocked"),
    ("subprocess", "import subprocess\nsubprocess.run(['true'])\n", "blocked"),
    ("opens a socket", "import socket\nsocket.create_connection(('127.0.0.1', 22))\n", "blocked"),
    ("sys.exit(0) before the tests", "import sys\nsys.exit(0)\nassert False\n", "exit"),
    ("exit() before the tests", "exit()\nassert False\n", "error"),  # no site module: NameError
    ("os._exit(0) before the tests", "import os\nos._exit(0)\nassert False\n", "killed"),
    ("fork bomb", "import os\nwhile True:\n    os.fork()\n", "blocked"),
    # Gets around the in-process guard: re-importing posix restores fork; the process limit stops it.
    (
        "fork bomb past the guard",
        "import sys\nsys.modules.pop('posix')\nimport posix\nwhile True:\n    posix.fork()\n",
        "error",
    ),
    (
        "thread bomb",
        "import threading, time\nwhile True:\n    threading.Thread(target=time.sleep, args=(60,)).start()\n",
        "error",
    ),
    ("removes files", "import os, shutil\nos.mkdir('victim')\nshutil.rmtree('victim')\n", "blocked"),
    ("loads ctypes", "import ctypes\n", "error"),
    ("floods stdout", "while True:\n    print('x' * 10000)\n", "timeout"),
    ("syntax error", "def f(:\n    pass\n", "error"),
    ("failed assert", "assert 1 + 1 == 3, 'arithmetic'\n", "failed"),
    ("deep recursion", "def f(n):\n    return f(n + 1)\nf(0)\n", "error"),
]


def _leftovers(root: Path) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.cwd().startswith(str(root)):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def test_hostile_programs_are_wrong_within_the_limits_and_leave_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each hostile program (endless loop, sleep, 10 GB allocations, os.system, subprocess, sockets,
    sys.exit/exit()/os._exit before the tests, fork and thread bombs, one that gets around the in-process
    guard, file removal, ctypes, a stdout flood) is graded wrong with the expected status within its
    time limit; afterwards this process still runs programs, no process of theirs is alive, no zombie
    child remains and every temporary directory is gone."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    start = time.monotonic()
    results = run_programs([source for _, source, _ in HOSTILE], LIMITS, workers=4)
    elapsed = time.monotonic() - start
    for (name, _, status), result in zip(HOSTILE, results, strict=True):
        assert not result.passed, name
        assert result.status == status, (name, result)
        assert result.status in STATUSES
        assert result.wall_s < LIMITS.timeout_s + 5, (name, result.wall_s)
    assert elapsed < len(HOSTILE) * (LIMITS.timeout_s + 5) / 4 + 10
    assert not Path("/tmp/flyspec-sandbox-was-here").exists()
    assert run_program("assert sum(range(10)) == 45\n", LIMITS).passed
    assert list(tmp_path.iterdir()) == []
    assert _leftovers(tmp_path) == []
    zombies = [c for c in psutil.Process().children(recursive=True) if c.status() == psutil.STATUS_ZOMBIE]
    assert zombies == []


def test_passing_needs_the_program_to_reach_its_end() -> None:
    """Only a program that runs to its last line passes; one that raises anything at all fails, and one
    that exits early with status 0 fails too (the parent waits for the one-time token, not exit 0)."""
    assert run_program("x = 1\nassert x == 1\n", LIMITS).passed
    early = run_program("import os\nos._exit(0)\n", LIMITS)
    assert (early.passed, early.status) == (False, "killed")
    raised = run_program("raise KeyboardInterrupt\n", LIMITS)
    assert (raised.passed, raised.status, raised.detail) == (False, "error", "KeyboardInterrupt")


def test_same_program_same_result() -> None:
    """Determinism: string hashes use PYTHONHASHSEED=0 and `random` is seeded with 0, so a program whose
    tests depend on both passes every time (it would fail under a random hash seed)."""
    env = {"PYTHONHASHSEED": "0", "PATH": os.environ.get("PATH", "")}
    code = "print(hash('flyspec'))"
    expected_hash = int(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True).stdout)
    import random

    expected_draw = random.Random(0).random()
    program = (
        f"import random\nassert hash('flyspec') == {expected_hash}\n"
        f"assert random.random() == {expected_draw!r}\n"
    )
    results = run_programs([program] * 4, LIMITS, workers=2)
    assert [r.passed for r in results] == [True] * 4


def test_cpu_limit_reports_itself() -> None:
    """A busy loop is stopped by the CPU-time limit (not only the wall clock) and says so."""
    result = run_program("while True:\n    pass\n", SandboxLimits(timeout_s=30, cpu_s=1))
    assert (result.status, result.detail) == ("timeout", "the CPU-time limit of 1 s was reached")
    assert result.wall_s < 25


@pytest.mark.skipif(not isolation().network_namespace, reason="no network namespace on this machine")
def test_network_namespace_blocks_code_that_gets_around_the_guard() -> None:
    """A program that bypasses the in-process socket guard (socket.SocketType is the raw class) still
    cannot reach a server listening on this machine's loopback: it runs in its own network namespace."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    program = (
        "import socket\n"
        "s = socket.SocketType(socket.AF_INET, socket.SOCK_STREAM)\n"
        "s.settimeout(3)\n"
        f"s.connect(('127.0.0.1', {port}))\n"
    )
    result = run_program(program, LIMITS)
    # The kernel completes a handshake into the backlog without accept(); an empty backlog proves that
    # no connection ever arrived.
    server.settimeout(0.2)
    with pytest.raises(TimeoutError):
        server.accept()
    server.close()
    assert not result.passed and result.status == "error" and "OSError" in result.detail


@pytest.mark.skipif(isolation().uid == os.geteuid(), reason="the gate does not run as root here")
def test_program_runs_as_nobody_and_cannot_write_outside(tmp_path: Path) -> None:
    """Started as root, the program runs as uid 65534: it may write its own working directory but not
    a root-owned folder, and cannot raise its limits back."""
    target = tmp_path / "written-by-the-program"
    assert run_program("import os\nassert os.getuid() == 65534\nopen('mine.txt', 'w').write('ok')\n").passed
    result = run_program(f"open({str(target)!r}, 'w').write('x')\n", LIMITS)
    assert result.status == "error" and "PermissionError" in result.detail and not target.exists()
    raised = run_program("import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))\n", LIMITS)
    assert raised.status == "blocked"


def test_bad_arguments() -> None:
    """Only bad arguments raise; a program never does."""
    with pytest.raises(ValueError, match="source"):
        run_program(b"print(1)")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"SandboxLimits.cpu_s=0"):
        SandboxLimits(cpu_s=0)
    with pytest.raises(ValueError, match="workers"):
        run_programs(["pass"], workers=0)
