"""The sandbox's own process (docs/code-sandbox.md), run as a script by ``code_exec.py``: argv
``CONFIG_JSON STATUS_FD``, the job as JSON on stdin. It builds the file tree the sandbox may see, starts the
program's process (``_code_exec_program.py``) and forks the test harness, which share only two pipes, and
writes the harness's verdict to STATUS_FD, which the program never holds. Standard library only.
"""

import builtins
import ctypes
import ctypes.util
import functools
import importlib.util
import json
import os
import shutil
import signal
import stat
import subprocess
import sys

PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 4, 38
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
# The Landlock system calls have the same numbers on every architecture.
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_RULE_PATH_BENEATH = 1
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1, 2, 4, 8
FS_TRUNCATE, FS_IOCTL_DEV = 1 << 14, 1 << 15
# Every file-system right of each Landlock ABI (1..7): bits 0-12, then REFER, TRUNCATE, IOCTL_DEV.
FS_ALL = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 4: (1 << 15) - 1, 5: (1 << 16) - 1}
FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV
NET_ALL = 3  # bind and connect TCP (ABI 4)
SCOPE_ALL = 3  # abstract unix sockets and signals of processes outside the domain (ABI 6)
# Where the program's interpreter finds shared libraries; bound read-only into the tree when present.
LIBRARIES = ("/lib", "/lib64", "/lib32", "/usr/lib", "/usr/lib64", "/usr/lib32", "/usr/local/lib")
LIBRARIES += ("/etc/ld.so.cache",)  # the loader's index of them
DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")
PYTHON_FLAGS = ("-S", "-s", "-P", "-B")  # no site, no user site, no script folder on the path, no .pyc
PROGRAM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_code_exec_program.py")


@functools.cache
def _libc():
    # Loaded on first use: find_library runs ldconfig, and the gate imports this module for landlock_abi.
    return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def _check(result, what):
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")
    return result


def _prctl(option, value):
    _check(_libc().prctl(option, ctypes.c_ulong(value), 0, 0, 0), "prctl")


def _bytes(value):
    return value.encode() if value is not None else None


def _mount(source, target, fstype, flags, data=None):
    args = (_bytes(source), _bytes(target), _bytes(fstype), ctypes.c_ulong(flags), _bytes(data))
    _check(_libc().mount(*args), f"mount {target}")


# -------------------------------------------------------------------------------- the file tree


def _bind(root, path, writable=False):
    """Bind ``path`` at the same place under ``root``, read-only unless ``writable`` (a symlink is copied)."""
    inside = root + path
    os.makedirs(os.path.dirname(inside), exist_ok=True)
    if os.path.islink(path):
        if not os.path.lexists(inside):
            os.symlink(os.readlink(path), inside)
        return
    if os.path.isdir(path):
        os.makedirs(inside, exist_ok=True)
    elif not os.path.exists(inside):
        open(inside, "w").close()
    _mount(path, inside, None, MS_BIND | MS_REC)
    device = stat.S_ISCHR(os.stat(path).st_mode)
    flags = MS_REMOUNT | MS_BIND | MS_NOSUID | (0 if device else MS_NODEV) | (0 if writable else MS_RDONLY)
    _mount(None, inside, None, flags)


def build_tree(root, config, limits):
    """A minimal tree at ``root``: the interpreter and its standard library, the system's shared
    libraries, a few devices, a private writable /tmp for the program, and a /proc of this process
    namespace that shows each user only its own processes. Everything else of the machine is absent."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    os.makedirs(root, exist_ok=True)
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for path in (*config["read"], *LIBRARIES, *DEVICES):
        if os.path.lexists(path):
            _bind(root, path, writable=path == "/dev/null")
    tmp = root + "/tmp"
    os.makedirs(tmp)
    uid = config["program_uid"]
    size = limits["file_bytes"] + (1 << 20)
    owner = f",uid={uid},gid={uid}" if uid is not None else ""
    _mount("tmpfs", tmp, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode=0700{owner}")
    os.makedirs(root + "/proc")
    try:
        _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=invisible")
    except OSError:
        _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=2")


# -------------------------------------------------------------------------------------- Landlock


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def landlock_abi():
    """The Landlock ABI version of this kernel (0 when it has none)."""
    version = _libc().syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), 1)  # ..._VERSION
    return max(0, int(version))


def landlock(abi, readable, writable):
    """Allow only reading (and executing) ``readable`` paths and reading and writing ``writable`` ones;
    with ABI 4 no TCP at all, with ABI 6 no signal to and no abstract socket of any process outside."""
    fs_all = FS_ALL[min(abi, 5)]
    attr = _RulesetAttr(fs_all, NET_ALL if abi >= 4 else 0, SCOPE_ALL if abi >= 6 else 0)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    syscall = _libc().syscall
    ruleset = _check(
        syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), 0), "landlock"
    )
    read = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
    for paths, rights in ((readable, read), (writable, fs_all)):
        for path in paths:
            if not os.path.exists(path):
                continue
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                allowed = rights if os.path.isdir(path) else rights & FILE_RIGHTS
                rule = _PathBeneath(allowed & fs_all, fd)
                _check(
                    syscall(
                        SYS_LANDLOCK_ADD_RULE, ruleset, LANDLOCK_RULE_PATH_BENEATH, ctypes.byref(rule), 0
                    ),
                    f"landlock rule {path}",
                )
            finally:
                os.close(fd)
    _check(syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0), "landlock restrict")
    os.close(ruleset)


# ------------------------------------------------------------------------------------- processes


def _confine(config, uid, cwd, writable):
    """In a child, before it runs anything: into the tree, to its own user (every capability goes with
    root), no new privileges, the Landlock rules (read the interpreter, its libraries and the devices;
    write only ``writable``)."""
    if config["tree"]:
        os.chroot(config["root"])
    os.chdir(cwd)
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    if config["landlock"]:
        landlock(config["landlock"], [*config["read"], *LIBRARIES, *DEVICES], writable)


def start_program(config, job, fds):
    """The program's process: a fresh interpreter (nothing of this process's memory survives the exec),
    confined before the exec, holding only its two pipes ``fds`` and /dev/null."""
    folder = config["program_dir"]
    argv = [config["python"], *PYTHON_FLAGS, folder + "/runner.py", *map(str, fds), json.dumps(job["limits"])]
    return subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        pass_fds=fds,
        env={**os.environ, "HOME": folder},
        preexec_fn=lambda: _confine(config, config["program_uid"], folder, [folder, "/dev/null"]),
    )


class RemoteAbort(BaseException):
    """The program's part ended in a way that can never pass (killed, blocked, exit, memory, CPU time)."""

    def __init__(self, status, detail):
        super().__init__(detail)
        self.status, self.detail = status, detail


class ProgramError(Exception):
    """An exception the program raised whose type is not one of Python's own."""


class Channel:
    """The harness's end of the pipes to the program. The first failure of the program's part is kept:
    whatever the tests do afterwards (even catch it), the verdict is that failure."""

    def __init__(self, codec, requests, replies):
        self.codec, self.requests, self.replies = codec, requests, replies
        self.failure = None

    def ask(self, *request):
        if self.failure is not None:
            raise self.failure
        try:
            self.codec.send(self.requests, list(request))
            reply = self.codec.receive(self.replies)
        except (EOFError, BrokenPipeError):
            self.failure = RemoteAbort("killed", "the program's process ended before its tests finished")
            raise self.failure from None
        except self.codec.ProtocolError as exc:
            raise self._broken(str(exc)) from None
        return self.answer(reply)

    def _broken(self, what):
        """Keep (and return, to raise) the failure of a program that broke the sandbox protocol."""
        self.failure = RemoteAbort("error", f"the program broke the sandbox protocol ({what})")
        return self.failure

    def answer(self, reply):
        """The value of an ``ok`` reply; the program's exception, the end of an iteration, or its abort
        raised; anything else is a broken protocol."""
        shape = [type(part).__name__ for part in reply] if isinstance(reply, list) else None
        kind = reply[0] if shape else None
        if kind == "ok" and len(reply) == 2:
            return reply[1]
        if kind == "stop" and len(reply) == 1:
            raise StopIteration
        if kind == "exc" and shape == ["str", "list", "str"]:
            raise _exception(reply[1], reply[2])
        if kind == "abort" and shape == ["str", "str", "str"] and reply[1] in ABORTS:
            self.failure = RemoteAbort(reply[1], reply[2])
            raise self.failure
        raise self._broken(f"a reply {str(reply)[:80]}")

    def value(self, tagged):
        try:
            return self.codec.decode(tagged, self._resolve)
        except self.codec.ProtocolError as exc:
            raise self._broken(str(exc)) from None

    def _resolve(self, tag, args):
        if tag != "r" or len(args) != 2 or type(args[0]) is not int or not isinstance(args[1], str):
            raise self.codec.ProtocolError("a malformed handle")
        return Remote(self, args[0], args[1][:100])

    def plain(self, value):
        """The tagged form of an argument the tests pass to the program."""
        return self.codec.encode(value, self._argument)

    def _argument(self, value):
        if isinstance(value, Remote):
            return ["r", value._handle, ""]
        attrs = getattr(value, "__dict__", None)
        if isinstance(attrs, dict) and not callable(value):
            return ["o", type(value).__name__, [[self.plain(k), self.plain(v)] for k, v in attrs.items()]]
        raise TypeError(f"the tests passed a {type(value).__name__} to the program; only data can be passed")


ABORTS = ("blocked", "exit", "memory", "timeout", "killed", "error")  # never "passed"


def _exception(names, message):
    """The exception the tests see for one the program raised: Python's own type of that name (the first
    of its classes that is one), else ProgramError."""
    for name in names:
        found = getattr(builtins, str(name), None)
        if isinstance(found, type) and issubclass(found, Exception):
            try:
                return found(message)
            except Exception:  # noqa: BLE001 - a type that takes other arguments (UnicodeError kinds)
                break
    return ProgramError(f"{names[0] if names else 'Exception'}: {message}")


class Remote:
    """An object that stays in the program's process: the tests can call it, read its public attributes,
    iterate over it, and ask its length, truth, items and membership; it equals only itself."""

    __slots__ = ("_channel", "_handle", "_type")

    def __init__(self, channel, handle, type_name):
        self._channel, self._handle, self._type = channel, handle, type_name

    def _ask(self, kind, *args):
        channel = self._channel
        return channel.value(channel.ask(kind, self._handle, *map(channel.plain, args)))

    def __call__(self, *args, **kwargs):
        return self._ask("call", list(args), kwargs)

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return self._ask("getattr", name)

    def __iter__(self):
        iterator = self._ask("iter")
        while True:
            try:
                yield iterator._ask("next")
            except StopIteration:  # the program's iterator ended (in a generator it must not escape)
                return

    def __len__(self):
        return self._ask("len")

    def __bool__(self):
        return self._ask("bool") is True

    def __getitem__(self, key):
        return self._ask("getitem", key)

    def __contains__(self, item):
        return self._ask("contains", item) is True

    def __repr__(self):
        return f"<{self._type} of the program>"


def _bind_names(namespace, names, channel, entry_point):
    """Bind the program's names for the tests: the entry point always; any other name only where neither
    Python's builtins nor the prefix (the dataset's own code) define it, so the program cannot replace
    what the tests rely on (``abs``, ``all``, a helper such as HumanEval's ``poly``)."""
    if not isinstance(names, dict):
        raise RemoteAbort("error", "the program broke the sandbox protocol (its names)")
    for name, described in names.items():
        if not isinstance(name, str) or not name.isidentifier():
            continue
        if name != entry_point and (name in namespace or hasattr(builtins, name)):
            continue
        if not isinstance(described, list) or len(described) != 2:
            raise RemoteAbort("error", "the program broke the sandbox protocol (its names)")
        kind, value = described
        if kind == "module" and isinstance(value, str) and value.split(".")[0] in sys.stdlib_module_names:
            try:
                namespace[name] = importlib.import_module(value)
            except ImportError:
                continue
        elif kind == "value":
            namespace[name] = channel.value(value)


def harness(job, codec, channel):
    """Run the tests against the program; returns ``(status, detail)``."""
    namespace = {"__name__": "tests", "__builtins__": builtins}
    try:
        names = channel.ask("load", job["program"])
        try:
            prefix = compile(job["prefix"], "prefix.py", "exec")
        except SyntaxError:
            prefix = None  # a prefix that only makes sense followed by the program (a stub's first line)
        if prefix is not None:
            exec(prefix, namespace)
        _bind_names(namespace, names, channel, job["entry_point"])
        exec(compile(job["tests"], "tests.py", "exec"), namespace)
        status, detail = "passed", ""
    except RemoteAbort as exc:
        status, detail = exc.status, exc.detail
    except BaseException as exc:  # noqa: BLE001 - any other failure is a wrong answer
        status, detail = codec.ending(exc, job["limits"]["cpu_s"], "tests")
    if channel.failure is not None:  # even when the tests caught it
        status, detail = channel.failure.status, channel.failure.detail
    return status, codec.one_line(detail)


def start_harness(config, job, codec, fds, verdict_fd, closed):
    """Fork the test harness: its own user, no new privileges, not dumpable (no process of its user can
    read its memory or descriptors), read-only rules and the same limits as the program; it writes its
    verdict to ``verdict_fd``. ``closed``: this process's descriptors the harness must not hold."""
    pid = os.fork()
    if pid:
        return pid
    try:
        for fd in closed:
            os.close(fd)
        _confine(config, config["harness_uid"], "/", [])
        _prctl(PR_SET_DUMPABLE, 0)
        codec.start(job["limits"])
        # The verdict is written inside: closing a pipe to a program that ended raises.
        with open(fds[0], "wb") as requests, open(fds[1], "rb") as replies:
            verdict = harness(job, codec, Channel(codec, requests, replies))
            os.write(verdict_fd, json.dumps(verdict).encode())
    finally:
        os._exit(0)


def _ended(code):
    """How a process ended, from its exit code (a negative one is the signal that killed it)."""
    if code >= 0:
        return f"exit code {code}"
    reason = {
        signal.SIGXCPU: "the CPU-time limit",
        signal.SIGXFSZ: "the file-size limit",
        signal.SIGKILL: "SIGKILL (a hard limit, or the sandbox ending it)",
    }.get(-code, signal.Signals(-code).name)
    return f"killed by {reason}"


def main():
    config = json.loads(sys.argv[1])
    status_fd = int(sys.argv[2])
    job = json.loads(sys.stdin.buffer.read())
    spec = importlib.util.spec_from_file_location("_code_exec_program", PROGRAM)
    codec = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(codec)
    _prctl(PR_SET_DUMPABLE, 0)
    if config["tree"]:
        build_tree(config["root"], config, job["limits"])
        config["program_dir"] = "/tmp"
    program_dir = (config["root"] if config["tree"] else "") + config["program_dir"]
    shutil.copyfile(PROGRAM, program_dir + "/runner.py")
    if config["program_uid"] is not None and not config["tree"]:
        os.chown(program_dir, config["program_uid"], config["program_uid"])
    request_r, request_w = os.pipe()
    reply_r, reply_w = os.pipe()
    program = start_program(config, job, (request_r, reply_w))
    os.close(request_r)
    os.close(reply_w)
    verdict_r, verdict_w = os.pipe()
    harness_pid = start_harness(
        config, job, codec, (request_w, reply_r), verdict_w, (0, status_fd, verdict_r)
    )
    for fd in (request_w, reply_r, verdict_w):
        os.close(fd)
    with open(verdict_r, "rb") as pipe:
        verdict = pipe.read()
    harness_code = os.waitstatus_to_exitcode(os.waitpid(harness_pid, 0)[1])
    program.kill()
    program.wait()
    try:
        status, detail = json.loads(verdict)
    except (ValueError, TypeError):
        status, detail = "killed", f"the test harness ended without a verdict ({_ended(harness_code)})"
    if status == "killed" and "program's process ended" in detail:
        detail = f"the program ended before its tests finished ({_ended(program.returncode)})"
    os.write(status_fd, (json.dumps({"status": status, "detail": detail}) + "\n").encode())


if __name__ == "__main__":
    try:
        main()
    except BaseException as exc:  # noqa: BLE001 - say why the sandbox itself failed, on stderr
        print(f"code sandbox: {type(exc).__name__}: {exc}", file=sys.stderr)
        os._exit(3)
    os._exit(0)
