"""The int4 kernel for a few rows (csrc/int4_matmul.cpp): built once per machine, called through ctypes.

Built by flyspec/models/cpu_kernels.py for the best instruction set the CPU has (AVX-512 VNNI, else AVX2
with FMA), compiler output to a log file in the cache, never the terminal. Where it cannot be built (no
compiler or a failing one, a CPU without AVX2 and FMA, an unwritable cache), or with
`FLYSPEC_INT4_KERNEL=torch`, `library()` returns None with the reason in `unavailable_reason()`, and int4
layers use torch's own kernel instead (slower for more than one row, same quantized weights). One log
line per process says which kernel runs.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

import torch

from flyspec import cpuinfo
from flyspec.models import cpu_kernels

BLOCK = 16
"""Output channels per block of the layout (one 512-bit vector of float32, two 256-bit ones)."""

_SOURCE = cpu_kernels.CSRC / "int4_matmul.cpp"
_log = logging.getLogger(__name__)
_failure: list[str] = []


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernel library, or None (and a logged warning, once) where it cannot be built or
    `FLYSPEC_INT4_KERNEL=torch` asks for torch's kernel. Logs which kernel runs, once."""
    _failure.clear()
    isa = cpu_kernels.kernel_isa()
    try:
        if os.environ.get("FLYSPEC_INT4_KERNEL") == "torch":
            raise RuntimeError("FLYSPEC_INT4_KERNEL=torch")
        if isa is None:
            raise RuntimeError(f"no AVX-512 VNNI and no AVX2 with FMA on {cpuinfo.describe_cpu()}")
        lib = cpu_kernels.load(_SOURCE, isa)
    except (OSError, RuntimeError) as exc:
        _failure.append(str(exc))
        _log.warning("int4: the few-row kernel is unavailable (%s); using torch's int4 kernel", exc)
        return None
    fn = lib.flyspec_int4_matmul
    fn.restype = None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, ctypes.c_int, i64, i64, ptr, ptr, i64, i64, ptr, ptr, ctypes.c_int]
    lib.flyspec_int4_isa.restype = ctypes.c_char_p
    _log.info("int4: flyspec's few-row kernel runs, built for %s", lib.flyspec_int4_isa().decode())
    return lib


def describe() -> str:
    """Which int4 kernel runs, e.g. 'flyspec int4 kernel (avx2)' or "torch _weight_int4pack_mm_for_cpu
    (FLYSPEC_INT4_KERNEL=torch)"; builds or loads the library on first use."""
    lib = library()
    if lib is None:
        return f"torch _weight_int4pack_mm_for_cpu ({unavailable_reason()})"
    return f"flyspec int4 kernel ({lib.flyspec_int4_isa().decode()})"


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
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """[M, n] in `out_dtype` = x [M, K] times the packed weights, plus the float32 bias. The kernel reads
    and writes float32 and bfloat16; other dtypes are converted. `out` ([M, n] in `out_dtype`): written
    and returned instead of a new tensor."""
    if x.dtype not in _DTYPES:
        x = x.to(torch.float32)
    x = x.contiguous()
    m, k = x.shape
    fits = out is not None and out.dtype == out_dtype and out.shape == (m, n) and out.is_contiguous()
    if fits and out_dtype in _DTYPES:
        y = out  # the kernel writes straight into the caller's buffer
    else:
        y = torch.empty(m, n, dtype=out_dtype if out_dtype in _DTYPES else torch.float32)
    lib.flyspec_int4_matmul(
        x.data_ptr(), _DTYPES[x.dtype], m, k, packed.data_ptr(), scales.data_ptr(), group, n,
        None if bias is None else bias.data_ptr(), y.data_ptr(), _DTYPES[y.dtype],
    )  # fmt: skip
    y = y.to(out_dtype)
    return y if out is None or y is out else out.copy_(y)
