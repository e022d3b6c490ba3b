"""The slot KV cache: lazy growth, writes and reads by slot and position, bounds."""

from __future__ import annotations

import pytest
import torch

from flyspec.models.kv_cache import KVCache


def _cache(max_len: int = 1000) -> KVCache:
    return KVCache(
        num_layers=2,
        num_kv_heads=2,
        head_dim=4,
        num_slots=3,
        max_len=max_len,
        dtype=torch.float32,
        device="cpu",
    )


def test_memory_grows_on_demand_and_keeps_contents() -> None:
    """A long max_len costs nothing up front; growing doubles the length, caps at max_len, keeps data."""
    cache = _cache(max_len=1000)
    assert cache.capacity == 256 and cache.k[0].shape == (3, 2, 256, 4)
    key = torch.randn(2, 2, 4)
    cache.write(1, torch.tensor([2, 0]), torch.tensor([255, 7]), key, -key)
    cache.ensure_capacity(300)
    assert cache.capacity == 512
    cache.ensure_capacity(900)
    assert cache.capacity == 1000 and cache.k[1].shape == (3, 2, 1000, 4)
    assert torch.equal(cache.k[1][2, :, 255], key[0]) and torch.equal(cache.v[1][0, :, 7], -key[1])
    assert cache.memory_bytes() == 2 * 2 * 3 * 2 * 1000 * 4 * 4


def test_read_gathers_slots_or_returns_views() -> None:
    """Reading a tensor of slots gathers those rows in order; a slice of consecutive slots is a view."""
    cache = _cache()
    values = torch.arange(3 * 2 * 5 * 4, dtype=torch.float32).view(3, 2, 5, 4)
    for slot in range(3):
        for pos in range(5):
            cache.write(
                0,
                torch.tensor([slot]),
                torch.tensor([pos]),
                values[slot, :, pos][None],
                values[slot, :, pos][None],
            )
    keys, _ = cache.read(0, torch.tensor([2, 0]), 5)
    assert torch.equal(keys, values[[2, 0]])
    view, _ = cache.read(0, slice(1, 3), 4)
    assert view.data_ptr() == cache.k[0][1].data_ptr() and torch.equal(view, values[1:3, :, :4])


def test_bad_sizes_and_overflow_are_errors() -> None:
    """Non-positive sizes and positions past max_len raise ValueError naming the field or the limit."""
    with pytest.raises(ValueError, match="num_slots=0"):
        KVCache(1, 1, 4, 0, 8, torch.float32, "cpu")
    cache = _cache(max_len=8)
    with pytest.raises(ValueError, match="max_len=8"):
        cache.ensure_capacity(9)


def test_write_span_equals_the_scatter_write() -> None:
    """The single-row fast path stores exactly what `write` stores for the same slot and positions."""
    span, scatter = _cache(), _cache()
    key, value = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    span.write_span(1, 2, 5, key, value)
    scatter.write(1, torch.tensor([2, 2, 2]), torch.tensor([5, 6, 7]), key, value)
    for a, b in zip(span.k + span.v, scatter.k + scatter.v, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(span.k[1][2, :, 5:8].transpose(0, 1), key)
