"""What CPU this is: its model name and the instruction-set extensions our kernels care about.

One place for it, because kernels are chosen, built and measured per CPU, and every benchmark table
names the CPU it ran on: our machines change between AMD EPYC (AVX-512 VNNI/BF16, no AMX), Intel Xeon
(AMX) and AVX2-only CPUs, and a kernel fast on one can fall to a reference implementation on the other.
Reads /proc/cpuinfo (Linux); elsewhere it falls back to `platform`, with no flags. No torch import.

**Emulating a smaller CPU** (`FLYSPEC_CPU_ISA`). To measure on an AVX-512 machine what an AVX2-only CPU
(e.g. AMD Zen 3) runs, set `FLYSPEC_CPU_ISA=avx2` (or `avx512_vnni` for an AVX-512 VNNI CPU without
AVX-512 BF16 and AMX, e.g. Intel Ice Lake). This module then reports only the flags such a CPU has, so our
kernels are built for it (flyspec/models/int4_kernel.py) and the kernel check is cached under its own
signature; every description of the CPU says it is emulated; and importing this module sets the
libraries' own switches where they are not set already: `ONEDNN_MAX_CPU_ISA` (oneDNN),
`ATEN_CPU_CAPABILITY` (torch's vectorised kernels) and `MKL_ENABLE_INSTRUCTIONS` (MKL). Those are read
when each library first runs, so the switch must be in the environment before torch computes anything;
flyspec's loader and command line import this module first. `emulation_problems()` says where a library
did not follow.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import re
from pathlib import Path

ISA_FLAGS = (
    "avx2",
    "fma",
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

ISA_ENV = "FLYSPEC_CPU_ISA"
"""The environment variable that makes flyspec treat this CPU as a smaller one (module docstring)."""

# Per emulated ISA: the /proc/cpuinfo flags it drops (every extension newer than it) and the libraries'
# own switches that cap them to the same instruction set.
_EMULATIONS: dict[str, tuple[re.Pattern[str], dict[str, str]]] = {
    "avx2": (
        re.compile(r"avx512.*|avx10.*|avx_vnni.*|avx_ne_convert|avx_ifma|amx.*"),
        {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    ),
    "avx512_vnni": (
        re.compile(r"avx512_bf16|avx512_fp16|avx10.*|avx_vnni.*|avx_ne_convert|avx_ifma|amx.*"),
        {
            "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI",
            "ATEN_CPU_CAPABILITY": "avx512",
            "MKL_ENABLE_INSTRUCTIONS": "AVX512",
        },
    ),
}
_CHOICES = ("native", *_EMULATIONS)


def emulated_isa() -> str | None:
    """The instruction set `FLYSPEC_CPU_ISA` asks to emulate ("avx2" or "avx512_vnni"), or None for this
    CPU's own ("native" or unset). ValueError for any other value."""
    value = os.environ.get(ISA_ENV, "").strip().lower()
    if value in ("", "native"):
        return None
    if value not in _EMULATIONS:
        raise ValueError(f"{ISA_ENV}={value!r}: must be one of {', '.join(_CHOICES)}")
    return value


def emulation_env() -> dict[str, str]:
    """The libraries' own ISA switches for the emulated instruction set (empty when not emulating)."""
    isa = emulated_isa()
    return {} if isa is None else dict(_EMULATIONS[isa][1])


def _apply_emulation() -> None:
    # setdefault: a switch the user set explicitly wins.
    for key, value in emulation_env().items():
        os.environ.setdefault(key, value)


_apply_emulation()


@functools.cache
def _host() -> tuple[str, frozenset[str]]:
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


def _cpuinfo() -> tuple[str, frozenset[str]]:
    """Model name and flags, with the flags an emulated ISA lacks removed and the name marked."""
    model, flags = _host()
    isa = emulated_isa()
    if isa is None:
        return model, flags
    drop = _EMULATIONS[isa][0]
    return f"{model} [emulating {isa}: {ISA_ENV}={isa}]", frozenset(f for f in flags if not drop.fullmatch(f))


def cpu_model() -> str:
    """The CPU's model name, e.g. 'AMD EPYC' or 'Intel(R) Xeon(R) Platinum 8480+' (with '[emulating avx2:
    FLYSPEC_CPU_ISA=avx2]' appended when emulating)."""
    return _cpuinfo()[0]


def has_flags(*names: str) -> bool:
    """True when the CPU (as emulated) has every one of the /proc/cpuinfo flags `names`."""
    flags = _cpuinfo()[1]
    return all(name in flags for name in names)


def isa_flags() -> list[str]:
    """Which of `ISA_FLAGS` this CPU has (as emulated), in that order."""
    flags = _cpuinfo()[1]
    return [f for f in ISA_FLAGS if f in flags]


def has_amx() -> bool:
    """True when the CPU has AMX tiles for int8 (Intel Sapphire Rapids and later)."""
    return has_flags("amx_int8")


def describe_cpu() -> str:
    """One line for logs and tables: model name and the ISA flags that matter, e.g.
    'AMD EPYC (avx2, fma, avx512_vnni, avx512_bf16; no AMX)'."""
    flags = isa_flags()
    amx = "" if has_amx() else "; no AMX"
    return f"{cpu_model()} ({', '.join(flags) or 'no AVX2'}{amx})"


def cpu_signature() -> str:
    """A short hash of the model name and every flag (as emulated): the key under which per-CPU results
    (kernel builds, kernel checks) are cached."""
    model, flags = _cpuinfo()
    return hashlib.sha256((model + "\0" + " ".join(sorted(flags))).encode()).hexdigest()[:16]


def emulation_problems() -> list[str]:
    """Where a library runs more than the emulated ISA allows (empty when not emulating or all follow):
    its switch was set too late (after it first ran) or overridden by hand. Imports torch."""
    isa = emulated_isa()
    if isa is None:
        return []
    import torch

    problems = []
    want = _EMULATIONS[isa][1]
    for key, value in want.items():
        if os.environ.get(key, "").upper() != value.upper():
            problems.append(f"{key}={os.environ.get(key)!r} (emulating {isa} wants {value})")
    capability = torch.backends.cpu.get_cpu_capability()
    if capability.upper() != want["ATEN_CPU_CAPABILITY"].upper():
        problems.append(f"torch's kernels run {capability} (ATEN_CPU_CAPABILITY was read before it was set)")
    return problems
