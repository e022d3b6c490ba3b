"""The int8 kernel for CPUs with AVX2 but no VNNI (csrc/int8_matmul.cpp), called through ctypes.

There oneDNN's int8 matmul (`gemm:jit`) took about twice bfloat16's time for one row (measured with
oneDNN capped to AVX2; docs/performance.md), so `Int8Linear` multiplies with this kernel instead. Where
the CPU has AVX-512 VNNI or AMX, oneDNN's int8 kernels are fast and this one is not built. Built by
flyspec/models/cpu_kernels.py (compiler output to a log file in the cache). `FLYSPEC_INT8_KERNEL=onednn`
keeps oneDNN's kernel on any CPU; where ours cannot be built, `library()` is None with the reason in
`unavailable_reason()` and oneDNN's kernel runs. One log line per process says which kernel runs.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

import torch

from flyspec.models import cpu_kernels

BLOCK = 16
"""Output channels are padded to a multiple of this (two blocks of 8, one 256-bit vector each)."""

_SOURCE = cpu_kernels.CSRC / "int8_matmul.cpp"
_log = logging.getLogger(__name__)
_failure: list[str] = []


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernel library on a CPU with AVX2 and no AVX-512 VNNI (as emulated), else None; a
    failed build logs one warning with the reason (`unavailable_reason()`)."""
    _failure.clear()
    if os.environ.get("FLYSPEC_INT8_KERNEL") == "onednn":
        _failure.append("FLYSPEC_INT8_KERNEL=onednn")
        return None
    if cpu_kernels.kernel_isa() != "avx2":
        _failure.append(f"oneDNN's int8 kernels are fast with {cpu_kernels.kernel_isa() or 'no AVX2'}")
        return None
    try:
        lib = cpu_kernels.load(_SOURCE, "avx2")
    except (OSError, RuntimeError) as exc:
        _failure.append(str(exc))
        _log.warning("int8: our AVX2 kernel is unavailable (%s); using oneDNN's int8 matmul", exc)
        return None
    fn = lib.flyspec_int8_matmul
    fn.restype = None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, ctypes.c_int, i64, i64, ptr, ptr, i64, ptr, ptr, ctypes.c_int]
    _log.info("int8: flyspec's AVX2 kernel runs (no VNNI here; oneDNN's gemm:jit is slower for few rows)")
    return lib


def describe() -> str | None:
    """'flyspec int8 kernel (avx2)' where ours runs int8 products, None where oneDNN's does."""
    return None if library() is None else "flyspec int8 kernel (avx2)"


def unavailable_reason() -> str | None:
    """Why `library()` returned None (None when it did not, or was not called yet)."""
    return _failure[0] if _failure else None


def pack(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's layout from int8 weights [N, K] (K a multiple of 4) and float32 scales [N]: codes
    int8 [N' / 8, K / 4, 32] and scales float32 [N'], N' = N rounded up to a multiple of BLOCK (zero
    rows)."""
    n, k = q.shape
    pad = -n % BLOCK
    if pad:
        q = torch.cat((q, q.new_zeros(pad, k)))
        scale = torch.cat((scale, scale.new_zeros(pad)))
    codes = q.view(-1, 8, k // 4, 4).permute(0, 2, 1, 3).contiguous()
    return codes.view(-1, k // 4, 32), scale.contiguous()


_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def matmul(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    n: int,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """[M, n] in `out_dtype` = x [M, K] (quantized to int8 per row inside) times the packed weights,
    plus the float32 bias. The kernel reads and writes float32 and bfloat16; other dtypes are converted.
    `out` ([M, n] in `out_dtype`): written and returned instead of a new tensor."""
    if x.dtype not in _DTYPES:
        x = x.to(torch.float32)
    x = x.contiguous()
    m, k = x.shape
    fits = out is not None and out.dtype == out_dtype and out.shape == (m, n) and out.is_contiguous()
    if fits and out_dtype in _DTYPES:
        y = out  # the kernel writes straight into the caller's buffer
    else:
        y = torch.empty(m, n, dtype=out_dtype if out_dtype in _DTYPES else torch.float32)
    lib.flyspec_int8_matmul(
        x.data_ptr(), _DTYPES[x.dtype], m, k, codes.data_ptr(), scales.data_ptr(), n,
        None if bias is None else bias.data_ptr(), y.data_ptr(), _DTYPES[y.dtype],
    )  # fmt: skip
    y = y.to(out_dtype)
    return y if out is None or y is out else out.copy_(y)
