"""The paged KV cache (flyspec/models/kv_cache.py): writes and reads by block table, the view fast path,
and memory that is only resident while blocks hold data."""

from __future__ import annotations

import pytest
import torch

from flyspec.models.kv_cache import PagedKVCache


def _cache(num_blocks: int = 6, block_size: int = 4, layers: int = 2) -> PagedKVCache:
    return PagedKVCache(
        num_layers=layers,
        num_kv_heads=2,
        head_dim=4,
        num_blocks=num_blocks,
        block_size=block_size,
        dtype=torch.float32,
        device="cpu",
    )


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _fill(cache: PagedKVCache, layer: int, table: list[int], length: int) -> torch.Tensor:
    """Write distinct values at positions 0..length-1 of a row with this table; return them [L, 4, 4]."""
    values = torch.arange(length * 16, dtype=torch.float32).view(length, 4, 4) + 1000 * table[0]
    slots = torch.tensor(
        [table[p // cache.block_size] * cache.block_size + p % cache.block_size for p in range(length)]
    )
    cache.write(layer, slots, values)
    return values


def test_read_follows_the_block_table_and_a_run_of_blocks_is_a_view() -> None:
    """Rows read back in position order through scattered blocks, keys (first heads) and values (last
    heads) apart; a single row whose blocks form one run is read as a view of the cache, equal to the
    gathered copy."""
    cache = _cache()
    a = _fill(cache, 1, [4, 0, 2], 10)
    b = _fill(cache, 1, [1, 3], 7)
    keys, values = cache.read(1, torch.tensor([[4, 0, 2], [1, 3, 0]]), 10)
    assert keys.shape == (2, 2, 10, 4)
    assert torch.equal(keys[0].transpose(0, 1), a[:, :2]) and torch.equal(values[0].transpose(0, 1), a[:, 2:])
    assert torch.equal(keys[1, :, :7].transpose(0, 1), b[:, :2])
    run = _fill(cache, 0, [2, 3, 4], 11)
    view, _ = cache.read(0, torch.tensor([[2, 3, 4]]), 11, first_block=2)
    gathered, _ = cache.read(0, torch.tensor([[2, 3, 4]]), 11)
    assert view.data_ptr() == cache.kv[0][2].data_ptr()
    assert torch.equal(view, gathered) and torch.equal(view[0].transpose(0, 1), run[:, :2])


def test_a_large_capacity_costs_memory_only_where_written_and_release_gives_it_back() -> None:
    """A 1 GiB cache adds almost nothing to resident memory until written; writing 64 MiB of blocks makes
    them resident; releasing those blocks gives the memory back and they read as zeros."""
    block_bytes = 2 * 16 * 2 * 8 * 64 * 4  # layers, positions, K+V heads, head_dim, float32
    before = _rss()
    cache = PagedKVCache(2, 8, 64, 2**30 // block_bytes, 16, torch.float32, "cpu")
    assert cache.memory_bytes() == 2**30 // block_bytes * block_bytes
    assert _rss() - before < 16 * 2**20
    used = list(range(100, 100 + 2**26 // block_bytes))
    slots = torch.tensor([b * 16 + p for b in used for p in range(16)])
    for layer in range(2):
        cache.write(layer, slots, torch.ones(len(slots), 16, 64))
    written = _rss()
    assert written - before > 60 * 2**20
    cache.release(used)
    assert written - _rss() > 60 * 2**20
    keys, values = cache.read(1, torch.tensor([used[:3]]), 48)
    assert not keys.any() and not values.any()


def test_release_keeps_blocks_that_share_a_page_with_a_block_in_use() -> None:
    """Blocks smaller than a page (256 bytes here, 16 per page): releasing a whole page's blocks clears
    them, releasing the neighbours of a block in use never clears its data."""
    cache = _cache(num_blocks=64, block_size=4, layers=1)
    _fill(cache, 0, [0], 4)
    kept = _fill(cache, 0, [17], 4)
    cache.release([*range(16), 16, *range(18, 32)])
    keys, _ = cache.read(0, torch.tensor([[17], [0]]), 4)
    assert torch.equal(keys[0].transpose(0, 1), kept[:, :2]) and not keys[1].any()


def test_bad_sizes_are_errors() -> None:
    """Non-positive sizes raise ValueError naming the field."""
    with pytest.raises(ValueError, match="num_blocks=0"):
        PagedKVCache(1, 1, 4, 0, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="block_size=-1"):
        PagedKVCache(1, 1, 4, 8, -1, torch.float32, "cpu")
