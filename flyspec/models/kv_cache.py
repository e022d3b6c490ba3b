"""Paged KV cache: keys and values in fixed-size blocks that any sequence can own.

The cache is storage only. Which blocks hold which sequence's positions (a block table per sequence),
when blocks are handed out and freed, and which prompt blocks are shared between requests is decided by
the caller (the engine's block manager); the model receives each row's block table with every forward.
Position p of a sequence lives at offset p % block_size of block table[p // block_size]. The cache never
tracks lengths either, so a rollback after rejected draft tokens is only a smaller length: stale entries
are masked out by the attention and overwritten later, with no copies.

Layout: one tensor per layer, `[num_blocks, block_size, 2 * num_kv_heads, head_dim]` (the keys' heads,
then the values' heads), so one write stores a token's keys and values together and one gather reads
both. Block b of every layer stands for the same positions, so one block table serves all layers.

Memory: on the CPU all layers live in one anonymous memory map. Its pages are zero until first written
and the operating system only backs pages that were written, so resident memory follows the blocks in
use rather than the configured capacity; `release` hands the pages of freed blocks back (they read as
zeros again). On other devices the tensors are allocated, zeroed, at their full size. Zeros matter: the
attention multiplies masked positions' values by a zero weight, and garbage bits could be NaN.
"""

from __future__ import annotations

import mmap
import sys

import torch

from flyspec.checks import is_int

_PAGE = mmap.PAGESIZE
_MAP_NORESERVE = 0x4000 if sys.platform == "linux" else 0  # Python's mmap module does not name it


class PagedKVCache:
    """Keys and values of `num_blocks` blocks of `block_size` positions for every layer of one model."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        for field, value in (
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
        ):
            if not is_int(value, 1):
                raise ValueError(f"PagedKVCache {field}={value!r}: must be a positive integer")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        self._block_shape = (block_size, 2 * num_kv_heads, head_dim)
        self._block_numel = block_size * 2 * num_kv_heads * head_dim
        self._itemsize = torch.empty((), dtype=dtype).element_size()
        layer_numel = num_blocks * self._block_numel
        self._map: mmap.mmap | None = None
        if self.device.type == "cpu" and hasattr(mmap, "MADV_DONTNEED"):
            # Private: MADV_DONTNEED then really frees the pages (a shared mapping would keep them).
            # No swap reserved up front: pages are backed when written (Linux's MAP_NORESERVE).
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", _MAP_NORESERVE)
            size = num_layers * layer_numel * self._itemsize
            try:
                self._map = mmap.mmap(-1, size, flags=flags)
            except OSError as exc:
                raise ValueError(
                    f"cannot map {size} bytes for the KV cache ({exc}); lower kv_cache_memory_bytes"
                ) from None
            flat = torch.frombuffer(self._map, dtype=dtype)
        else:
            flat = torch.zeros(num_layers * layer_numel, dtype=dtype, device=self.device)
        self.kv: list[torch.Tensor] = [
            flat[i * layer_numel : (i + 1) * layer_numel].view(num_blocks, *self._block_shape)
            for i in range(num_layers)
        ]
        # Rows whose blocks are not one run are gathered into this buffer, reused by every layer and step
        # (a fresh allocation per call would fault its pages in each time).
        self._gather = torch.empty(0, dtype=dtype, device=self.device)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers (keys and values)."""
        return self.num_layers * self._block_numel * self._itemsize

    def memory_bytes(self) -> int:
        """Bytes the cache can hold (its capacity; on the CPU only written pages are resident)."""
        return self.num_blocks * self.block_bytes

    def write(self, layer: int, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Store `kv` `[N, 2 * num_kv_heads, head_dim]` (keys' heads, then values') at flat positions
        `slots` [N] (block * block_size + offset)."""
        self.kv[layer].view(-1, 2 * self.num_kv_heads, self.head_dim)[slots] = kv

    def read(
        self, layer: int, blocks: torch.Tensor, length: int, first_block: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values `[B, num_kv_heads, length, head_dim]` of positions `0..length-1` of B rows.

        blocks: [B, nb] block ids with nb * block_size >= length (entries past a row's own blocks may be
        any valid id: those positions are masked by the caller). first_block: set when B == 1 and the
        row's blocks are first_block, first_block + 1, ...: then the result is a view, no copy.
        """
        h = self.num_kv_heads
        store = self.kv[layer]
        if first_block is not None:
            nb = blocks.shape[1]
            rows = store[first_block : first_block + nb].view(1, nb * self.block_size, 2 * h, -1)
        else:
            bsz, nb = blocks.shape
            numel = bsz * nb * self._block_numel
            if self._gather.numel() < numel:
                # At least doubling: the rows grow a block at a time, and each new buffer faults in anew.
                grown = max(numel, 2 * self._gather.numel())
                self._gather = torch.empty(grown, dtype=self.dtype, device=self.device)
            out = self._gather[:numel].view(bsz * nb, *self._block_shape)
            torch.index_select(store, 0, blocks.reshape(-1), out=out)
            rows = out.view(bsz, nb * self.block_size, 2 * h, -1)
        rows = rows[:, :length]
        return rows[:, :, :h].transpose(1, 2), rows[:, :, h:].transpose(1, 2)

    def release(self, blocks: list[int]) -> None:
        """Give the memory of these unused blocks back to the operating system where the cache is
        memory-mapped (their pages read as zeros afterwards); elsewhere nothing happens (stale values are
        finite, and masked positions are never weighted)."""
        if self._map is None or not blocks:
            return
        block_bytes = self._block_numel * self._itemsize
        layer_bytes = self.num_blocks * block_bytes
        for first, count in _runs(sorted(blocks)):
            for layer in range(self.num_layers):
                start = layer * layer_bytes + first * block_bytes
                # Whole pages inside the run only: a page shared with a neighbouring block stays.
                lo = -(-start // _PAGE) * _PAGE
                hi = (start + count * block_bytes) // _PAGE * _PAGE
                if hi > lo:
                    self._map.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


def _runs(sorted_ids: list[int]) -> list[tuple[int, int]]:
    """Consecutive runs (first, count) of sorted ids."""
    runs: list[tuple[int, int]] = []
    for i in sorted_ids:
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs
