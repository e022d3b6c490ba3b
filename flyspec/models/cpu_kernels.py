"""Building our C++ matmul kernels (csrc/*.cpp) for this CPU's instruction set, once per machine.

Each source compiles with the machine's C++ compiler (`$CXX`, else `c++` or `g++`) for one instruction
set the CPU has (flyspec/cpuinfo.py, which honours `FLYSPEC_CPU_ISA`): AVX-512 VNNI where present, else
AVX2 with FMA; never `-march=native`, which would let the compiler use an extension an emulated CPU
lacks. The library goes to `$FLYSPEC_CACHE/kernels/`, keyed by a hash of the source, the flags, the
compiler and the CPU, so a new CPU or a changed source builds afresh and everything else loads the cached
file. The compiler's output goes to a log file beside it (`NAME-KEY.log`), never to the terminal, and a
failed build is remembered (`NAME-KEY.failed`), so later starts neither compile nor print again.

Why ctypes and not torch C++ extensions: the kernels need no torch headers, so they build in about a
second instead of a minute, and the shared OpenMP runtime (torch's libgomp.so.1, already loaded when
torch is imported) runs their threads.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from flyspec import cpuinfo
from flyspec.assets import cache_dir

CSRC = Path(__file__).with_name("csrc")
_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
ISAS = {
    "avx512_vnni": (
        ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
        ("-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"),
    ),
    "avx2": (("avx2", "fma"), ("-mavx2", "-mfma")),
}
"""The instruction sets our kernels are built for, best first: name -> (CPU flags it needs, compiler
flags that enable exactly those)."""


def kernel_isa() -> str | None:
    """The best of `ISAS` this CPU (as emulated) has, or None."""
    return next((isa for isa, (needs, _) in ISAS.items() if cpuinfo.has_flags(*needs)), None)


def compiler() -> str | None:
    """The C++ compiler to use: `$CXX`, else `c++` or `g++` on PATH, or None."""
    for name in (os.environ.get("CXX"), "c++", "g++"):
        if name and shutil.which(name):
            return name
    return None


def build(source: Path, isa: str) -> Path:
    """The shared library of `source` built for `isa` (from the cache when built before). RuntimeError
    naming the log file when there is no compiler or it fails (then, and on later calls, without
    compiling again)."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    flags = (*_FLAGS, *ISAS[isa][1])
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        "\0".join((source.read_text(), " ".join(flags), version, cpuinfo.cpu_signature())).encode()
    ).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"{source.stem}-{key}.so"
    log, failed = target.with_suffix(".log"), target.with_suffix(".failed")
    if target.is_file():
        return target
    if failed.is_file():
        raise RuntimeError(failed.read_text().strip())
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent processes never load a half-written library.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        command = [cxx, *flags, str(source), "-o", str(out)]
        with open(log, "w") as sink:
            sink.write(" ".join(command) + "\n")
            sink.flush()
            result = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        if result.returncode != 0:
            reason = f"{cxx} failed (exit {result.returncode}; its output is in {log})"
            failed.write_text(reason + "\n")
            raise RuntimeError(reason)
        os.replace(out, target)
    return target


def load(source: Path, isa: str) -> ctypes.CDLL:
    """`build` then load the library. RuntimeError or OSError where that fails."""
    return ctypes.CDLL(str(build(source, isa)))
