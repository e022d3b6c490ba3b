"""The quantized weights a decode step streams, held in memory the kernel may back with 2 MB pages.

Why: one sequence's decode step reads every weight once per token, so its speed is the memory bandwidth
the matmul kernels reach. On 4 KB pages that stream crosses a page every 4 KB (a TLB miss each time, and
the hardware prefetchers stop at page boundaries). Linux backs an anonymous mapping with 2 MB pages where
the process asks for them (`madvise(MADV_HUGEPAGE)`; transparent huge pages in their "madvise" setting,
the default of most distributions). On an AMD EPYC Zen 5 our int4 kernel read 11-23% faster from such
memory on one thread, and the whole int4 1.5B decoded 3% faster at one sequence and 18% at 32 (medians,
both layouts in one process; docs/performance.md, "One sequence").

`HugePageArena.place(t)` copies a tensor into advised memory and returns the copy; tensors are carved
from chunks of `CHUNK_BYTES` (64-byte aligned), so a model's hundreds of weight tensors do not each round
up to a 2 MB page. A chunk lives as long as any tensor placed in it. Where Linux's huge pages are off
("never"), or `madvise` is missing (not Linux), the same mappings run on normal pages; the values and
the results are the same either way. `FLYSPEC_HUGE_PAGES=0` leaves tensors where they are (to measure
the difference).
"""

from __future__ import annotations

import contextlib
import mmap
import os
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
CHUNK_BYTES = 64 << 20
_ALIGN = 64
_THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def enabled() -> bool:
    """Whether weights are placed in advised memory (`FLYSPEC_HUGE_PAGES` is not "0")."""
    return os.environ.get("FLYSPEC_HUGE_PAGES", "1") != "0"


def system_setting() -> str:
    """Linux's transparent huge page mode ("always", "madvise" or "never"), or "unavailable"."""
    try:
        text = _THP_SETTING.read_text()
    except OSError:
        return "unavailable"
    chosen = [word.strip("[]") for word in text.split() if word.startswith("[")]
    return chosen[0] if chosen else "unavailable"


def mapping(nbytes: int) -> torch.Tensor:
    """A zeroed uint8 tensor of `nbytes` (rounded up to a huge page) over its own advised mapping."""
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # A kernel built without transparent huge pages refuses the advice: normal pages then.
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            region.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(region, dtype=torch.uint8)  # keeps `region` alive


class HugePageArena:
    """Bump allocation of tensors in huge-page-advised chunks (see the module docstring)."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.chunk_bytes = chunk_bytes
        self._chunk: torch.Tensor | None = None
        self._used = 0

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of CPU `tensor` in advised memory (the tensor itself where placing is off
        or it is not on the CPU)."""
        nbytes = tensor.numel() * tensor.element_size()
        if not enabled() or tensor.device.type != "cpu" or nbytes == 0:
            return tensor
        if nbytes > self.chunk_bytes:
            out = mapping(nbytes)[:nbytes]
        else:
            if self._chunk is None or self._used + nbytes > self._chunk.numel():
                self._chunk, self._used = mapping(self.chunk_bytes), 0
            out = self._chunk[self._used : self._used + nbytes]
            self._used += -(-nbytes // _ALIGN) * _ALIGN
        placed = out.view(tensor.dtype).view(tensor.shape)
        return placed.copy_(tensor)


def place(tensor: torch.Tensor, arena: HugePageArena | None = None) -> torch.Tensor:
    """`arena.place(tensor)`, or in a mapping of its own when no arena is given."""
    return (arena or HugePageArena(chunk_bytes=0)).place(tensor)
