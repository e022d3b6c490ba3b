"""Slot-based KV cache: one row ("slot") per running sequence, per layer.

The cache stores keys and values only; it never tracks sequence lengths. The engine owns lengths, so a
rollback after rejected draft tokens is just starting the next forward at a smaller position: the stale
entries beyond it are masked out by the attention and overwritten later, with no copies.

Storage per layer is `[num_slots, num_kv_heads, capacity, head_dim]`. The length dimension grows on demand
(doubling, up to `max_len`), so a model with a 32k context does not reserve 32k positions for every slot
before a single long prompt arrives.
"""

from __future__ import annotations

import torch

# Positions allocated at first; doubling from here keeps the number of re-allocations logarithmic.
_INITIAL_CAPACITY = 256


class KVCache:
    """Keys and values of `num_slots` sequences for every layer of one model."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_slots: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        for field, value in (
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("num_slots", num_slots),
            ("max_len", max_len),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"KVCache {field}={value!r}: must be a positive integer")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_slots = num_slots
        self.max_len = max_len
        self.dtype = dtype
        self.device = torch.device(device)
        self.capacity = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.ensure_capacity(min(max_len, _INITIAL_CAPACITY))

    def ensure_capacity(self, length: int) -> None:
        """Make positions `0..length-1` addressable in every slot (grows by doubling, keeps contents)."""
        if length > self.max_len:
            raise ValueError(
                f"KV cache position {length - 1} is out of range: the cache holds max_len={self.max_len} "
                "positions per sequence"
            )
        if length <= self.capacity:
            return
        new_capacity = min(self.max_len, max(length, 2 * self.capacity))
        shape = (self.num_slots, self.num_kv_heads, new_capacity, self.head_dim)
        for store in (self.k, self.v):
            for layer in range(self.num_layers):
                grown = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if store and self.capacity:
                    grown[:, :, : self.capacity].copy_(store[layer])
                if len(store) > layer:
                    store[layer] = grown  # drop the old tensor before allocating the next layer's
                else:
                    store.append(grown)
        self.capacity = new_capacity

    def write(
        self,
        layer: int,
        slot_index: torch.Tensor,
        pos_index: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
    ) -> None:
        """Store `key`/`value` `[N, num_kv_heads, head_dim]` at (slot_index[i], pos_index[i])."""
        self.k[layer][slot_index, :, pos_index] = key
        self.v[layer][slot_index, :, pos_index] = value

    def write_span(self, layer: int, slot: int, start: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store `key`/`value` `[n, num_kv_heads, head_dim]` at positions `start .. start + n - 1` of `slot`.

        The fast path of a single-row pass (one-request decode, a prompt chunk): a plain slice copy instead
        of the scatter `write` needs for ragged rows.
        """
        n = key.shape[0]
        self.k[layer][slot, :, start : start + n] = key.transpose(0, 1)
        self.v[layer][slot, :, start : start + n] = value.transpose(0, 1)

    def read(self, layer: int, slots: torch.Tensor | slice, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values `[B, num_kv_heads, length, head_dim]` of positions `0..length-1` of `slots`.

        A `slice` of consecutive slots returns views (no copy); a tensor of slot ids gathers.
        """
        return self.k[layer][slots, :, :length], self.v[layer][slots, :, :length]

    def memory_bytes(self) -> int:
        """Bytes currently allocated for keys and values."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
