"""Code answers and the sandbox that grades them (docs/code-sandbox.md: what it promises, which protections
each machine gets, what it still allows). ``extract_code`` and ``build_run`` turn a model's output and a
``CodeTask`` into a ``CodeRun``; ``run_tests`` runs it in the sandbox process (``_code_exec_child.py``),
which keeps the program (``_code_exec_program.py``) and the tests in separate processes.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import json
import os
import re
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

from flyspec.checks import is_int, is_number
from flyspec.gate.grading import _code_exec_child as child

PROGRAM_UID = 65534  # nobody
HARNESS_UID = 65533  # another unprivileged user, so the program cannot signal or read the harness
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
            if not is_number(value, above=0):
                raise ValueError(f"SandboxLimits.{name}={value!r}: must be a positive number")


@dataclass(frozen=True)
class CodeRun:
    """One program and its tests: ``program`` (untrusted: the prefix followed by the model's code) runs in
    the program's process; ``prefix`` (the dataset's own code, e.g. HumanEval's helpers) and ``tests`` run
    in the harness; ``entry_point`` is the function under test."""

    program: str
    tests: str
    prefix: str = ""
    entry_point: str | None = None

    def __post_init__(self) -> None:
        for name in ("program", "tests", "prefix"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"CodeRun.{name}: must be a str, got {type(getattr(self, name)).__name__}")
        if not self.tests.strip():
            raise ValueError("CodeRun.tests: give the tests (code that raises when the program is wrong)")
        if self.entry_point is not None and not (
            isinstance(self.entry_point, str) and self.entry_point.isidentifier()
        ):
            raise ValueError(f"CodeRun.entry_point={self.entry_point!r}: must be a function name or None")


_PYTHON_TAGS = {"", "python", "py", "python3", "py3"}
# A fence opens at the start of a line (models indent fences inside lists) and closes at a line holding
# only backticks, or at the end of a truncated output.
_FENCE = re.compile(
    r"^[ \t]*```[ \t]*([\w+.#-]*)[^\n]*\n(.*?)(?:^[ \t]*```[ \t]*$|\Z)", re.MULTILINE | re.DOTALL
)
_CODE_START = re.compile(r"^(?:import |from |def |class |@|async def )", re.MULTILINE)


@dataclass(frozen=True)
class CodeTask:
    """The reference of a code question, stored as JSON (``to_answer``): ``tests``, code that raises when
    the program is wrong (HumanEval's ``check`` and ``check(entry_point)``, MBPP's asserts);
    ``entry_point``, the function under test (picks the code block; may be None); ``prefix``, code placed
    before the model's (HumanEval's prompt: imports, helpers and the stub)."""

    tests: str
    entry_point: str | None = None
    prefix: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.tests, str) or not self.tests.strip():
            raise ValueError("code answer: 'tests' must be a non-empty string of Python test code")
        if self.entry_point is not None and (
            not isinstance(self.entry_point, str) or not self.entry_point.isidentifier()
        ):
            raise ValueError(
                f"code answer: 'entry_point'={self.entry_point!r} must be a Python function name or null"
            )
        if not isinstance(self.prefix, str):
            raise ValueError("code answer: 'prefix' must be a string (code placed before the model's)")

    def to_answer(self) -> str:
        """The canonical JSON string stored as the question's reference answer."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_answer(cls, answer: object) -> CodeTask:
        """Parse a reference answer (JSON text or an already-parsed object); ValueError names the problem."""
        if isinstance(answer, str):
            try:
                answer = json.loads(answer)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"code answer: must be a JSON object with 'tests' (and optional 'entry_point', "
                    f"'prefix'); it is not JSON ({exc.msg})"
                ) from None
        if not isinstance(answer, dict):
            raise ValueError(f"a code answer must be an object with 'tests', got {type(answer).__name__}")
        unknown = set(answer) - {"tests", "entry_point", "prefix"}
        if unknown:
            raise ValueError(f"code answer: unknown field(s) {', '.join(sorted(unknown))}")
        if "tests" not in answer:
            raise ValueError("code answer: 'tests' is missing")
        return cls(answer["tests"], answer.get("entry_point"), answer.get("prefix", ""))  # type: ignore[arg-type]


def _defines(code: str, entry_point: str) -> bool:
    pattern = rf"^[ \t]*(?:async[ \t]+)?def[ \t]+{re.escape(entry_point)}[ \t]*\("
    return re.search(pattern, code, re.MULTILINE) is not None


def _compiles(code: str) -> bool:
    try:
        ast.parse(code)
    except (SyntaxError, ValueError):
        return False
    return True


def extract_code(output: str, entry_point: str | None = None) -> str:
    """The program in a model's output.

    With markdown fences: among the Python (or untagged) blocks, the last one that defines
    ``entry_point``; else the only block; else all of them joined. Without fences: the output itself, or,
    when it does not parse, the text from its first ``import``/``from``/``def``/``class`` line on (prose
    before the code dropped).
    """
    blocks = [(tag.lower(), body) for tag, body in _FENCE.findall(output)]
    if blocks:
        python = [body for tag, body in blocks if tag in _PYTHON_TAGS] or [body for _, body in blocks]
        if entry_point is not None:
            defining = [body for body in python if _defines(body, entry_point)]
            if defining:
                return defining[-1]
        return python[0] if len(python) == 1 else "\n\n".join(python)
    if _compiles(output):
        return output
    start = _CODE_START.search(output)
    return output[start.start() :] if start else output


def build_run(code: str, task: CodeTask) -> CodeRun:
    """What the sandbox runs: the program (``prefix`` then the candidate's code) and the tests. Code that
    defines the entry point is a whole function and goes after the prefix (overriding its stub); anything
    else continues the prefix directly (a completion of the stub's body)."""
    if task.entry_point is not None and not _defines(code, task.entry_point):
        program = task.prefix + code
    else:
        program = f"{task.prefix}\n\n{code}" if task.prefix else code
    return CodeRun(program, task.tests, task.prefix, task.entry_point)


@dataclass(frozen=True)
class ExecResult:
    """Outcome of one run: ``passed`` only when the harness ran the tests to their end.

    ``status`` is one of ``STATUSES``: ``failed`` (AssertionError), ``error`` (another exception, including
    a SyntaxError, or a broken protocol), ``blocked`` (a disabled call), ``exit`` (``sys.exit``), ``memory``
    (MemoryError), ``timeout`` (wall clock or CPU time), ``killed`` (the program's process ended early: a
    signal such as the CPU or file-size limit, ``os._exit``, a crash). ``detail`` is a one-line explanation.
    """

    passed: bool
    status: str
    detail: str
    wall_s: float


@dataclass(frozen=True)
class Isolation:
    """What the kernel adds around the sandbox on this machine (probed once per process).

    ``file_tree``: the minimal read-only file tree in a mount namespace (as root). ``landlock``: the
    Landlock ABI the rules use (0: none). ``pid_namespace``/``network_namespace``: the sandbox has its own
    (its processes are hidden from others and die with it; no network). ``uid``/``harness_uid``: the
    users the program and the harness run as. ``prefix``: the command that creates the namespaces.
    """

    file_tree: bool
    landlock: int
    pid_namespace: bool
    network_namespace: bool
    uid: int
    harness_uid: int
    prefix: tuple[str, ...]

    @property
    def missing(self) -> list[str]:
        """The protections this machine cannot give, in plain words (empty when it gives them all)."""
        out = []
        if not self.file_tree:
            out.append(
                "a minimal read-only file tree (needs root and mount namespaces)"
                + ("; Landlock rules limit what the program reads instead" if self.landlock else "")
            )
        if not self.landlock:
            out.append(
                "Landlock file rules (Linux 5.13+)"
                + ("" if self.file_tree else ": the program can read every file its user can read")
            )
        elif self.landlock < 4 and not self.network_namespace:
            out.append("network isolation (no network namespace and a Landlock ABI before 4)")
        if not self.pid_namespace:
            exposed = [] if self.landlock else ["read other processes' /proc entries"]
            if self.landlock < 6 and self.uid == os.geteuid():
                exposed.append("signal the gate's own processes")
            out.append(
                "a process namespace: the program's processes are not hidden from others nor killed with it"
                + (f", and it can {' and '.join(exposed)}" if exposed else "")
            )
        if not self.network_namespace and self.landlock >= 4:
            out.append("a network namespace (Landlock blocks TCP; UDP and local sockets stay open)")
        if self.uid == os.geteuid() or self.uid == self.harness_uid:
            out.append("separate unprivileged users for the program and the test harness")
        return out


def _candidates() -> list[Isolation]:
    """Sandbox modes to try, strongest first; the first that grades a probe right wins."""
    unshare, euid = shutil.which("unshare"), os.geteuid()
    abi = child.landlock_abi()
    rules = [abi, 0] if abi else [0]
    out: list[Isolation] = []
    if unshare is not None:
        if euid == 0:
            ns = (unshare, "--mount", "--net", "--pid", "--fork", "--kill-child", "--")
            out += [Isolation(True, r, True, True, PROGRAM_UID, HARNESS_UID, ns) for r in rules]
        # Unprivileged, a user namespace is what makes the other two namespaces allowed.
        ns = (unshare, *(() if euid == 0 else ("--user",)), "--net", "--pid", "--fork", "--kill-child", "--")
        users = [(PROGRAM_UID, HARNESS_UID)] if euid == 0 else [(euid, euid)]
        out += [Isolation(False, r, True, True, p, h, ns) for p, h in users for r in rules]
    # As root the program never runs as root: without namespaces it runs as nobody, or not at all.
    users = [(PROGRAM_UID, HARNESS_UID)] if euid == 0 else [(euid, euid)]
    out += [Isolation(False, r, False, False, p, h, ()) for p, h in users for r in rules]
    return out


def _probe_job() -> tuple[CodeRun, CodeRun]:
    """A run that must pass (the program's interpreter and standard library are the gate's own) and one
    that must fail."""
    stdlib = os.path.dirname(os.__file__)
    program = "import os, sys\n\ndef where():\n    return [sys.version, os.path.dirname(os.__file__)]\n"
    good = CodeRun(program, f"import sys\nassert where() == [sys.version, {stdlib!r}]\n")
    return good, CodeRun(program, "assert where() == []\n")


@functools.cache
def isolation() -> Isolation:
    """The strongest sandbox that grades a probe right on this machine (RuntimeError when none does)."""
    good, bad = _probe_job()
    limits = SandboxLimits(timeout_s=30)
    failures = []
    for candidate in _candidates():
        passed = _run(good, limits, candidate)
        if passed.passed and not _run(bad, limits, candidate).passed:
            return candidate
        failures.append(f"{' '.join(candidate.prefix[1:-1]) or 'no namespaces'}: {passed.detail}")
    unprivileged = (
        " As root, the program runs only as an unprivileged user: give the sandbox mount namespaces "
        "(util-linux `unshare`), or an interpreter that user can read."
        if os.geteuid() == 0
        else ""
    )
    raise RuntimeError(
        f"the code sandbox cannot run {sys.executable} here ({'; '.join(failures)[:2000]}).{unprivileged}"
    )


def _read_tail(path: Path) -> str:
    with open(path, "rb") as handle:
        handle.seek(0, os.SEEK_END)
        handle.seek(max(0, handle.tell() - _TAIL_BYTES))
        return handle.read().decode("utf-8", errors="replace")


def _kill(proc: subprocess.Popen[bytes], sandbox: Isolation) -> None:
    """Kill the sandbox and everything in its process group, and reap it."""
    if proc.poll() is None and sandbox.pid_namespace:
        # Kill unshare's child first so that unshare reaps it; killing both at once would leave the
        # child to whatever reaps orphans on this machine.
        with contextlib.suppress(psutil.Error):
            for process in psutil.Process(proc.pid).children():
                process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _config(sandbox: Isolation, work: str) -> dict[str, object]:
    python = os.path.realpath(sys.executable)
    same = sandbox.uid == os.geteuid()
    return {
        "tree": sandbox.file_tree,
        "root": f"{work}/root",
        "landlock": sandbox.landlock,
        "program_uid": None if same else sandbox.uid,
        "harness_uid": None if same else sandbox.harness_uid,
        "python": python,
        # The interpreter and the folder of its standard library and shared library (prefix/lib).
        "read": [python, os.path.dirname(os.path.dirname(os.__file__))],
        "program_dir": f"{work}/program",
    }


def _outcome(line: bytes, stderr: str, returncode: int) -> tuple[str, str]:
    try:
        verdict = json.loads(line)
        status, detail = str(verdict["status"]), str(verdict["detail"])
    except (ValueError, KeyError, TypeError):
        last = (stderr.strip().splitlines() or ["no output"])[-1]
        return "killed", f"the sandbox ended without a verdict (exit code {returncode}; {last[:300]})"
    if status not in STATUSES:
        return "killed", f"unrecognised result {status!r}"
    return status, detail


def _run(job: CodeRun, limits: SandboxLimits, sandbox: Isolation) -> ExecResult:
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="flyspec-code-") as tmp:
        # Traversable (not readable) by the program's and the harness's users, to reach their folders.
        os.chmod(tmp, 0o711)
        os.mkdir(f"{tmp}/program", 0o700)
        config = _config(sandbox, tmp)
        request = {
            **asdict(job),
            "limits": {k: int(v) for k, v in asdict(limits).items() if k != "timeout_s"},
        }
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
        status_read, status_write = os.pipe()
        command = [
            *sandbox.prefix,
            *(sys.executable, *child.PYTHON_FLAGS, child.__file__, json.dumps(config), str(status_write)),
        ]
        with open(status_read, "rb", buffering=0) as status, open(f"{tmp}/stderr", "wb") as err:
            try:
                proc = subprocess.Popen(
                    command,
                    cwd=tmp,
                    env=env,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                    pass_fds=(status_write,),
                    start_new_session=True,
                )
            finally:
                os.close(status_write)
            timed_out = False
            try:
                proc.communicate(json.dumps(request).encode(), timeout=limits.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            # Kill the group even after a normal exit: anything left behind goes with it.
            _kill(proc, sandbox)
            # What is in the pipe now, without waiting for EOF (a straggler may still hold the write end):
            # the sandbox wrote its one line, far below a pipe's capacity, before it ended.
            os.set_blocking(status_read, False)
            line = status.read(1 << 16) or b""
        wall = time.monotonic() - start
        if timed_out:
            return ExecResult(False, "timeout", f"no result within {limits.timeout_s:g} s (wall clock)", wall)
        status, detail = _outcome(line, _read_tail(Path(tmp) / "stderr"), proc.returncode)
    return ExecResult(status == "passed", status, detail, wall)


def run_tests(job: CodeRun, limits: SandboxLimits | None = None) -> ExecResult:
    """Run ``job``'s tests against its program once in the sandbox; never raises for the program's sake
    (only for a bad ``job`` or if no sandbox can start here). Safe to call from any thread and many
    times: every process is killed and reaped and the temporary directory removed."""
    if not isinstance(job, CodeRun):
        raise ValueError(f"job: must be a CodeRun, got {type(job).__name__}")
    return _run(job, limits or SandboxLimits(), isolation())


def run_many(
    jobs: Sequence[CodeRun], limits: SandboxLimits | None = None, workers: int | None = None
) -> list[ExecResult]:
    """``run_tests`` for many jobs, ``workers`` at a time (default: the CPU count), results in order."""
    if workers is None:
        workers = os.cpu_count() or 1
    if not is_int(workers, 1):
        raise ValueError(f"workers={workers!r}: must be a positive integer")
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda job: run_tests(job, limits), jobs))
