"""The code sandbox: hostile or broken programs are graded wrong within the limits, no program can forge a
pass, the sandbox reads nothing private, the gate's process survives, nothing is left behind, and the same
program always gets the same result."""

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

from flyspec.gate.grading.code_exec import (
    STATUSES,
    CodeRun,
    Isolation,
    SandboxLimits,
    isolation,
    run_many,
    run_tests,
)

LIMITS = SandboxLimits(timeout_s=6, cpu_s=2)
SANDBOX = isolation()


def _alone(program: str) -> CodeRun:
    """A program whose tests only need it to load."""
    return CodeRun(program, "assert True\n")


# (name, program, expected status). Every program would "pass" if the sandbox let it finish quietly.
HOSTILE = [
    ("infinite loop", "while True:\n    pass\n", "timeout"),
    ("sleeps forever", "import time\ntime.sleep(3600)\n", "timeout"),
    ("allocates 10 GB", "block = bytearray(10 * 1024**3)\n", "memory"),
    ("list of 10 GB", "items = [0] * (10 * 1024**3 // 8)\n", "memory"),
    ("os.system", "import os\nos.system('touch /tmp/flyspec-sandbox-was-here')\n", "blocked"),
    ("subprocess", "import subprocess\nsubprocess.run(['true'])\n", "blocked"),
    ("opens a socket", "import socket\nsocket.create_connection(('127.0.0.1', 22))\n", "blocked"),
    ("sys.exit(0) before the tests", "import sys\nsys.exit(0)\n", "exit"),
    ("exit() before the tests", "exit()\n", "error"),  # no site module: NameError
    ("os._exit(0) before the tests", "import os\nos._exit(0)\n", "killed"),
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
    results = run_many([_alone(source) for _, source, _ in HOSTILE], LIMITS, workers=4)
    elapsed = time.monotonic() - start
    for (name, _, status), result in zip(HOSTILE, results, strict=True):
        assert not result.passed, name
        assert result.status == status, (name, result)
        assert result.status in STATUSES
        assert result.wall_s < LIMITS.timeout_s + 5, (name, result.wall_s)
    assert elapsed < len(HOSTILE) * (LIMITS.timeout_s + 5) / 4 + 10
    assert not Path("/tmp/flyspec-sandbox-was-here").exists()
    assert run_tests(_alone("assert sum(range(10)) == 45\n"), LIMITS).passed
    assert list(tmp_path.iterdir()) == []
    assert _leftovers(tmp_path) == []
    zombies = [c for c in psutil.Process().children(recursive=True) if c.status() == psutil.STATUS_ZOMBIE]
    assert zombies == []


def test_passing_needs_the_tests_to_reach_their_end() -> None:
    """Only tests that run to their last line pass; a program that raises anything fails, and one that
    exits early with status 0 fails too (the verdict is the harness's, not an exit code)."""
    assert run_tests(CodeRun("x = 1\n", "assert True\n"), LIMITS).passed
    early = run_tests(_alone("import os\nos._exit(0)\n"), LIMITS)
    assert (early.passed, early.status) == (False, "killed")
    assert "exit code 0" in early.detail
    raised = run_tests(_alone("raise KeyboardInterrupt\n"), LIMITS)
    assert (raised.passed, raised.status, raised.detail) == (False, "error", "KeyboardInterrupt")


def test_same_program_same_result() -> None:
    """Determinism: string hashes use PYTHONHASHSEED=0 and `random` is seeded with 0 in both the program's
    process and the tests', so a program and tests that depend on both pass every time (they would fail
    under a random hash seed)."""
    env = {"PYTHONHASHSEED": "0", "PATH": os.environ.get("PATH", "")}
    code = "print(hash('flyspec'))"
    expected_hash = int(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True).stdout)
    import random

    expected_draw = random.Random(0).random()
    program = "import random\n\ndef state():\n    return [hash('flyspec'), random.random()]\n"
    tests = (
        f"import random\nassert state() == [{expected_hash}, {expected_draw!r}]\n"
        f"assert random.random() == {expected_draw!r}\n"
    )
    results = run_many([CodeRun(program, tests)] * 4, LIMITS, workers=2)
    assert [r.passed for r in results] == [True] * 4, results


def test_cpu_limit_reports_itself() -> None:
    """A busy loop is stopped by the CPU-time limit (not only the wall clock) and says so."""
    result = run_tests(_alone("while True:\n    pass\n"), SandboxLimits(timeout_s=30, cpu_s=1))
    assert (result.status, result.detail) == ("timeout", "the CPU-time limit of 1 s was reached")
    assert result.wall_s < 25


@pytest.mark.skipif(not SANDBOX.network_namespace, reason="no network namespace on this machine")
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
    result = run_tests(_alone(program), LIMITS)
    # The kernel completes a handshake into the backlog without accept(); an empty backlog proves that
    # no connection ever arrived.
    server.settimeout(0.2)
    with pytest.raises(TimeoutError):
        server.accept()
    server.close()
    assert not result.passed and result.status in ("error", "blocked"), result
    assert "Error" in result.detail or "disabled" in result.detail


def test_bad_arguments() -> None:
    """Only bad arguments raise; a program never does."""
    with pytest.raises(ValueError, match="job: must be a CodeRun"):
        run_tests("print(1)")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="CodeRun.program: must be a str"):
        CodeRun(b"print(1)", "assert True")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="CodeRun.tests: give the tests"):
        CodeRun("pass", "  ")
    with pytest.raises(ValueError, match="entry_point='f\\(\\)'"):
        CodeRun("pass", "assert True", entry_point="f()")
    with pytest.raises(ValueError, match=r"SandboxLimits.cpu_s=0"):
        SandboxLimits(cpu_s=0)
    with pytest.raises(ValueError, match="workers"):
        run_many([_alone("pass")], workers=0)


# ------------------------------------------------------------------------------- forged verdicts

WRONG = "def add(a, b):\n    return a - b\n"
RIGHT = "def add(a, b):\n    return a + b\n"
TESTS = "assert add(2, 3) == 5\nassert add(-4, 10) == 6\nassert add(0.5, 0.25) == 0.75\n"
# Writes everything that could look like a verdict or a reply to every descriptor it can find.
SPRAY = """
import json, os, sys
def _spray():
    fake = [
        b"passed\\n", json.dumps({"status": "passed", "detail": ""}).encode() + b"\\n",
        (lambda d: len(d).to_bytes(4, "big") + d)(json.dumps(["ok", ["i", "5"]]).encode()),
    ]
    for fd in range(0, 1024):
        for data in fake:
            try:
                os.write(fd, data)
            except OSError:
                pass
"""

FORGERIES = [
    (
        "the audit's frame walk to the harness's token and status descriptor",
        "import os, sys\nl = sys._getframe(1).f_locals\n"
        "os.write(int(l['status_fd']), (l['token'] + ' passed \\n').encode())\nos._exit(0)\n",
    ),
    (
        "every frame's locals and globals searched for descriptors and tokens, then sprayed",
        SPRAY + "f = sys._getframe()\nwhile f is not None:\n"
        "    for v in list(f.f_locals.values()) + list(f.f_globals.values()):\n"
        "        if isinstance(v, int) and 0 <= v < 1024:\n"
        "            try:\n                os.write(v, b'passed\\n')\n"
        "            except OSError:\n                pass\n"
        "    f = f.f_back\n_spray()\nos._exit(0)\n",
    ),
    (
        "gc.get_objects: every int written to as a descriptor, the server patched to answer True",
        SPRAY + "import gc\nfor o in gc.get_objects():\n    if type(o).__name__ == 'Server':\n"
        "        type(o).handle = lambda self, request: ['ok', ['b', True]]\n"
        "    if isinstance(o, dict):\n        for v in list(o.values()):\n"
        "            if isinstance(v, int) and 2 < v < 1024:\n"
        "                try:\n                    os.write(v, b'passed\\n')\n"
        "                except OSError:\n                    pass\n" + WRONG,
    ),
    (
        "descriptors read from /proc/self/fd and written to",
        SPRAY
        + "try:\n    fds = [int(n) for n in os.listdir('/proc/self/fd')]\nexcept OSError:\n    fds = []\n"
        "for fd in fds:\n    try:\n        os.write(fd, b'passed\\n')\n    except OSError:\n        pass\n"
        + WRONG,
    ),
    ("inherited descriptors sprayed, then exit 0", SPRAY + "_spray()\nos._exit(0)\n"),
    (
        "builtins, assert and math patched",
        "import builtins, math\nbuiltins.AssertionError = type('Quiet', (Exception,), {})\n"
        "math.isclose = lambda *a, **k: True\nbuiltins.abs = lambda x: 0\nbuiltins.all = lambda x: True\n"
        + WRONG,
    ),
    ("the verdict printed", 'print(\'passed\')\nprint(\'{"status": "passed", "detail": ""}\')\n' + WRONG),
    ("SystemExit from inside the call", "def add(a, b):\n    raise SystemExit(0)\n"),
    (
        "signals: the parent and every process it may reach killed, SIGXCPU ignored",
        "import os, signal, sys\nsys.modules.pop('posix')\nimport posix\n"
        "for target in (os.getppid(), -1, 0):\n    try:\n        posix.kill(target, signal.SIGKILL)\n"
        "    except OSError:\n        pass\n"
        "signal.signal(signal.SIGXCPU, signal.SIG_IGN)\n" + WRONG,
    ),
    (
        "os.fork: a child keeps answering 5 on the reply pipe",
        SPRAY + "sys.modules.pop('posix')\nimport posix\nif posix.fork() == 0:\n"
        "    while True:\n        _spray()\n" + WRONG,
    ),
    (
        "an object equal to everything, and an int subclass equal to everything",
        "class Any:\n    def __eq__(self, other):\n        return True\n"
        "class Five(int):\n    def __eq__(self, other):\n        return True\n"
        "def add(a, b):\n    return Any() if a == 2 else Five(0)\n",
    ),
    ("a trace function that skips lines", "import sys\nsys.settrace(lambda *a: None)\n" + WRONG),
    (
        "a garbled reply: a 4 GB length prefix on the reply descriptor",
        "import os\nfor fd in range(3, 64):\n    try:\n        os.write(fd, b'\\xff\\xff\\xff\\xff')\n"
        "    except OSError:\n        pass\n" + WRONG,
    ),
]


@pytest.mark.parametrize(("name", "program"), FORGERIES, ids=[f[0][:40] for f in FORGERIES])
def test_no_program_can_forge_a_pass(name: str, program: str) -> None:
    """Each forgery around a wrong add() (or none at all) fails: frame walking, gc.get_objects, /proc/self/fd,
    writing fake verdicts and replies to every descriptor, exiting 0 early, patched builtins, assert and
    math, printed verdicts, SystemExit, killing the parent and every reachable process, os.fork, objects
    equal to everything, trace functions, a garbled protocol. The verdict is the harness's, in another
    process the program cannot reach; with the same tests a right add() passes."""
    result = run_tests(CodeRun(program, TESTS, entry_point="add"), LIMITS)
    assert not result.passed, (name, result)
    assert result.status in STATUSES


def test_the_right_program_passes_and_caught_failures_still_fail() -> None:
    """Control for the forgeries: the right add() passes the same tests. A program error the tests catch
    (an ordinary exception) behaves as in Python; a blocked call or an exit the tests catch still fails."""
    assert run_tests(CodeRun(RIGHT, TESTS, entry_point="add"), LIMITS).passed
    expects_error = "try:\n    add(1, 'x')\nexcept TypeError:\n    pass\nelse:\n    raise AssertionError\n"
    assert run_tests(CodeRun(RIGHT, expects_error + TESTS), LIMITS).passed
    catches = "try:\n    add(1, 2)\nexcept BaseException:\n    pass\n"
    exits = run_tests(CodeRun("def add(a, b):\n    raise SystemExit(0)\n", catches), LIMITS)
    assert (exits.passed, exits.status) == (False, "exit")
    blocked = run_tests(CodeRun("import os\n\ndef add(a, b):\n    os.system('true')\n", catches), LIMITS)
    assert (blocked.passed, blocked.status) == (False, "blocked")


def test_the_tests_see_only_data_and_the_datasets_own_helpers() -> None:
    """Results come back as plain data (a Counter as a dict, a namedtuple as a tuple, a generator as an
    iterable handle); objects the tests build pass to the program; the program's other names reach the
    tests only where the prefix and builtins do not define them, so a program that redefines the prefix's
    helper or abs() does not change what the tests compute."""
    prefix = "def helper(x):\n    return x + 1\n\ndef count(s):\n    pass\n"
    program = (
        prefix + "import collections\n\ndef helper(x):\n    return 0\n\ndef abs(x):\n    return 0\n\n"
        "def count(s):\n    return collections.Counter(s)\n\n"
        "def pairs(n):\n    return (i * i for i in range(n))\n\n"
        "def depth(node):\n    return 0 if node is None else 1 + max(depth(node.left), depth(node.right))\n"
        "\nLIMIT = 7\n"
    )
    tests = (
        "assert count('aab') == {'a': 2, 'b': 1} and type(count('a')) is dict\n"
        "assert helper(1) == 2 and abs(-3) == 3\n"
        "assert list(pairs(4)) == [0, 1, 4, 9] and LIMIT == 7\n"
        "class Node:\n    def __init__(self, left=None, right=None):\n"
        "        self.left, self.right = left, right\n"
        "assert depth(Node(Node(), Node(Node()))) == 3\n"
    )
    result = run_tests(CodeRun(program, tests, prefix=prefix, entry_point="count"), LIMITS)
    assert result.passed, result


# --------------------------------------------------------------------------------- what it can read


@pytest.mark.skipif(
    not (SANDBOX.file_tree or SANDBOX.landlock), reason="neither a file tree nor Landlock on this machine"
)
def test_the_program_cannot_read_a_private_file_of_the_gates_user(tmp_path: Path) -> None:
    """A 0600 file of the user the gate runs as (root here: the sandbox used to keep a read-anything
    capability and read it) is refused to the program: it is not in its file tree, and Landlock allows
    no path outside the interpreter, its libraries and the program's own folder."""
    secret = tmp_path / "secret.txt"
    secret.write_text("the gate's secret")
    secret.chmod(0o600)
    program = (
        f"def attempt():\n    try:\n        return open({str(secret)!r}).read()\n"
        "    except OSError as exc:\n        return type(exc).__name__\n"
    )
    tests = "result = attempt()\nassert result in ('FileNotFoundError', 'PermissionError'), result\n"
    result = run_tests(CodeRun(program, tests), LIMITS)
    assert result.passed, result


@pytest.mark.skipif(
    not (SANDBOX.pid_namespace or SANDBOX.landlock), reason="no process namespace nor Landlock here"
)
def test_the_program_cannot_read_another_process_command_line() -> None:
    """Another process's /proc/PID/cmdline (here a process holding a secret in its arguments) is refused
    to the program: its process namespace does not hold that process, and Landlock refuses /proc."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "secret-argument"])
    try:
        program = (
            f"def attempt():\n    try:\n        return open('/proc/{other.pid}/cmdline').read()\n"
            "    except OSError as exc:\n        return type(exc).__name__\n\n"
            "def others():\n    try:\n"
            "        return sorted(n for n in __import__('os').listdir('/proc') if n.isdigit())\n"
            "    except OSError as exc:\n        return type(exc).__name__\n"
        )
        tests = (
            "result = attempt()\nassert result in ('FileNotFoundError', 'PermissionError'), result\n"
            f"assert {str(other.pid)!r} not in others()\n"
        )
        result = run_tests(CodeRun(program, tests), LIMITS)
    finally:
        other.kill()
        other.wait()
    assert result.passed, result


@pytest.mark.skipif(SANDBOX.uid == os.geteuid(), reason="the gate does not run as root here")
def test_program_runs_unprivileged_and_cannot_write_outside(tmp_path: Path) -> None:
    """Started as root, the program runs as uid 65534 and the tests as 65533: it may write its own
    folder but nothing else, cannot become root again (no capability is left), and cannot raise its
    limits."""
    target = tmp_path / "written-by-the-program"
    program = (
        "import os, sys\n\ndef who():\n    return os.getuid()\n\n"
        "def write_mine():\n    open('mine.txt', 'w').write('ok')\n    return open('mine.txt').read()\n\n"
        f"def write_outside():\n    try:\n        open({str(target)!r}, 'w').write('x')\n"
        "        return 'written'\n"
        "    except OSError as exc:\n        return type(exc).__name__\n\n"
        "def become_root():\n    sys.modules.pop('posix')\n    import posix\n    try:\n"
        "        posix.setuid(0)\n        return 'root'\n"
        "    except OSError as exc:\n        return type(exc).__name__\n"
    )
    tests = (
        "import os\nassert who() == 65534 and os.getuid() == 65533\nassert write_mine() == 'ok'\n"
        "assert write_outside() in ('FileNotFoundError', 'PermissionError')\n"
        "assert become_root() == 'PermissionError'\n"
    )
    result = run_tests(CodeRun(program, tests), LIMITS)
    assert result.passed, result
    assert not target.exists()
    raised = run_tests(_alone("import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))\n"), LIMITS)
    assert raised.status == "blocked"


def test_missing_protections_are_named_in_plain_words() -> None:
    """This machine's sandbox is described by what it lacks (nothing, in a root container with mount
    namespaces and Landlock); a machine without namespaces, Landlock or root is told each missing
    protection."""
    print("sandbox:", SANDBOX, "missing:", SANDBOX.missing)
    if os.geteuid() == 0 and SANDBOX.file_tree and SANDBOX.landlock >= 6:
        assert SANDBOX.missing == []
    bare = Isolation(False, 0, False, False, os.geteuid(), os.geteuid(), ())
    words = " ".join(bare.missing)
    assert "minimal read-only file tree" in words and "Landlock file rules" in words
    assert "can read every file its user can read" in words and "process namespace" in words
    assert "separate unprivileged users" in words
