"""A [rows, width] buffer that every engine step reuses (logits, probabilities over the vocabulary).

Why: at the demo's batch (32 requests, K = 8) a verify pass has 288 rows of a 151,936-token vocabulary,
175 MB in float32. glibc serves allocations above 32 MB by a fresh memory map and unmaps them when
freed, so a new tensor of that size every step faulted in every one of its pages again: about 43,000
minor page faults per tensor and step. A buffer kept across steps faults its pages in once.

A view from `rows(n)` is valid until the next `rows` call on the same buffer: callers use it within
the step that asked for it and copy what they keep.
"""

from __future__ import annotations

import torch


class StepBuffer:
    """Rows of `width` elements of `dtype` on `device`, grown (at least doubling) when a step needs more
    rows than it holds, never shrunk. Untouched rows cost address space only, no resident memory."""

    def __init__(self, width: int, dtype: torch.dtype, device: torch.device | str) -> None:
        if width < 1:
            raise ValueError(f"StepBuffer width={width}: must be >= 1")
        self.width = width
        self._data = torch.empty((0, width), dtype=dtype, device=device)

    @property
    def capacity(self) -> int:
        """Rows held now."""
        return self._data.shape[0]

    def rows(self, n: int) -> torch.Tensor:
        """A contiguous [n, width] view of the buffer (contents unspecified)."""
        if n > self._data.shape[0]:
            # Doubling keeps reallocations (each faults its pages in anew) to a few while a batch grows.
            grown = max(n, 2 * self._data.shape[0])
            self._data = torch.empty((grown, self.width), dtype=self._data.dtype, device=self._data.device)
        return self._data[:n]
