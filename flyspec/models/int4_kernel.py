"""The int4 kernel for a few rows (csrc/int4_matmul.cpp): built once per machine, called through ctypes.

The C++ source compiles with the machine's C++ compiler (`$CXX`, else `c++` or `g++`) and its own
instruction set into `$FLYSPEC_CACHE/kernels/`, keyed by a hash of the source, the flags, the compiler and
the CPU, so a new CPU or a changed source builds afresh and everything else loads the cached library.
Where it cannot be built (no compiler or a failing one, a CPU without AVX-512 VNNI, an unwritable cache),
or with `FLYSPEC_INT4_KERNEL=torch`, `library()` returns None with the reason in `unavailable_reason()`,
and int4 layers use torch's own kernel instead (slower for more than one row, same quantized weights).

Why ctypes and not a torch C++ extension: the kernel needs no torch headers, so it builds in about a
second instead of a minute, and the shared OpenMP runtime (torch's libgomp.so.1, already loaded when this
module is imported) runs its threads.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from flyspec.assets import cache_dir
from flyspec.cpuinfo import cpu_signature

BLOCK = 16
"""Output channels per block of the layout (one 512-bit vector of float32)."""

_SOURCE = Path(__file__).with_name("csrc") / "int4_matmul.cpp"
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
_log = logging.getLogger(__name__)
_failure: list[str] = []


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++"):
        if name and shutil.which(name):
            return name
    return None


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        "\0".join((_SOURCE.read_text(), " ".join(_FLAGS), version, cpu_signature())).encode()
    ).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"int4_matmul-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent processes never load a half-written library.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        command = [compiler, *_FLAGS, str(_SOURCE), "-o", str(out)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-500:]}")
        os.replace(out, target)
    return target


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernel library, or None (and a logged warning, once) where it cannot be built or
    `FLYSPEC_INT4_KERNEL=torch` asks for torch's kernel."""
    _failure.clear()
    compiler = _compiler()
    try:
        if os.environ.get("FLYSPEC_INT4_KERNEL") == "torch":
            raise RuntimeError("FLYSPEC_INT4_KERNEL=torch")
        if compiler is None:
            raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, RuntimeError) as exc:
        _failure.append(str(exc))
        _log.warning("int4: the few-row kernel is unavailable (%s); using torch's int4 kernel", exc)
        return None
    fn = lib.flyspec_int4_matmul
    fn.restype = None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, ctypes.c_int, i64, i64, ptr, ptr, i64, i64, ptr, ptr, ctypes.c_int]
    return lib


def unavailable_reason() -> str | None:
    """Why `library()` returned None (None when it did not, or was not called yet)."""
    return _failure[0] if _failure else None


def pack(codes: torch.Tensor, pairs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's layout from codes [N, K] (0..15, N a multiple of 16, K of 8) and (scale, offset) pairs
    [K / G, N, 2] with w = (code - 8) * scale + offset: packed codes uint8 [N / 16, K / 8, 64] and
    bfloat16 (scale, offset') [N / 16, K / G, 2, 16] with w = code * scale + offset'."""
    n, k = codes.shape
    # [N / 16, K / 8, 16, 2, 4]: per block, per 8 input channels, the 16 rows' low and high four codes.
    octets = codes.to(torch.uint8).view(n // BLOCK, BLOCK, k // 8, 2, 4).permute(0, 2, 1, 3, 4)
    # Two contiguous copies, then uint8 arithmetic in place (code < 16, so lo + 16 * hi < 256): about
    # 40% faster at load than shifting and or-ing the strided views.
    packed = octets[..., 0, :].contiguous().add_(octets[..., 1, :].contiguous().mul_(16))
    scale, offset = pairs[..., 0].float(), pairs[..., 1].float()
    both = torch.stack((scale, offset - 8 * scale), dim=1)  # [K / G, 2, N]
    scales = both.view(pairs.shape[0], 2, n // BLOCK, BLOCK).permute(2, 0, 1, 3).contiguous()
    return packed.view(n // BLOCK, k // 8, 64), scales.to(torch.bfloat16)


_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def matmul(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    group: int,
    n: int,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """[M, n] in `out_dtype` = x [M, K] times the packed weights, plus the float32 bias. The kernel reads
    and writes float32 and bfloat16; other dtypes are converted."""
    if x.dtype not in _DTYPES:
        x = x.to(torch.float32)
    x = x.contiguous()
    m, k = x.shape
    y = torch.empty(m, n, dtype=out_dtype if out_dtype in _DTYPES else torch.float32)
    lib.flyspec_int4_matmul(
        x.data_ptr(), _DTYPES[x.dtype], m, k, packed.data_ptr(), scales.data_ptr(), group, n,
        None if bias is None else bias.data_ptr(), y.data_ptr(), _DTYPES[y.dtype],
    )  # fmt: skip
    return y.to(out_dtype)
