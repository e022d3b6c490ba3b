"""What CPU this is: its model name and the instruction-set extensions our kernels care about.

One place for it, because kernels are chosen (and their measurements cached) per CPU, and every benchmark
table names the CPU it ran on: our machines change between AMD EPYC (AVX-512 VNNI/BF16, no AMX) and Intel
Xeon (AMX), and a kernel fast on one can fall to a reference implementation on the other. Reads
/proc/cpuinfo (Linux); elsewhere it falls back to `platform`, with no flags. No torch import.
"""

from __future__ import annotations

import functools
import hashlib
import platform
from pathlib import Path

ISA_FLAGS = (
    "avx2",
    "avx_vnni",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
)
"""The /proc/cpuinfo flags that decide which matmul kernels run (docs/performance.md), in this order."""


@functools.cache
def _cpuinfo() -> tuple[str, frozenset[str]]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine(), frozenset()
    model, flags = "", frozenset[str]()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
    return model or platform.processor() or platform.machine(), flags


def cpu_model() -> str:
    """The CPU's model name, e.g. 'AMD EPYC' or 'Intel(R) Xeon(R) Platinum 8480+'."""
    return _cpuinfo()[0]


def isa_flags() -> list[str]:
    """Which of `ISA_FLAGS` this CPU has, in that order."""
    flags = _cpuinfo()[1]
    return [f for f in ISA_FLAGS if f in flags]


def has_amx() -> bool:
    """True when the CPU has AMX tiles for int8 (Intel Sapphire Rapids and later)."""
    return "amx_int8" in _cpuinfo()[1]


def describe_cpu() -> str:
    """One line for logs and tables: model name and the ISA flags that matter, e.g.
    'AMD EPYC (avx2, avx512_vnni, avx512_bf16; no AMX)'."""
    flags = isa_flags()
    amx = "" if has_amx() else "; no AMX"
    return f"{cpu_model()} ({', '.join(flags) or 'no AVX2'}{amx})"


def cpu_signature() -> str:
    """A short hash of the model name and every flag: the key under which per-CPU results are cached."""
    model, flags = _cpuinfo()
    return hashlib.sha256((model + "\0" + " ".join(sorted(flags))).encode()).hexdigest()[:16]
