"""KV block bookkeeping (flyspec/engine/kv_blocks.py): allocation as tables grow, freeing, and prefix
sharing of registered prompt blocks, on real Sequence objects."""

from __future__ import annotations

from flyspec.engine.kv_blocks import BlockManager
from flyspec.engine.sequence import Sequence
from flyspec.sampling_params import SamplingParams
from flyspec.spec_decode.metrics import SpecDecodeStats


def _seq(name: str, prompt: list[int], **params) -> Sequence:
    return Sequence(name, None, prompt, SamplingParams(**params), 0, frozenset())


def _prefilled(blocks: BlockManager, seq: Sequence) -> None:
    """What the scheduler and engine do: share what is cached, allocate the rest, compute, register."""
    seq.num_computed = blocks.share_prefix(seq)
    assert blocks.allocate(seq.block_table, seq.num_prompt_tokens)
    seq.num_computed = seq.num_prompt_tokens
    blocks.register(seq)


def test_tables_grow_block_by_block_all_or_nothing_and_lowest_ids_first() -> None:
    """allocate covers the positions asked for with whole blocks, takes the lowest free ids, and when the
    blocks are not there leaves the table as it was; free returns them for reuse. Their memory is handed
    back only once no request holds a block (a block reused before that keeps its pages)."""
    released: list[list[int]] = []
    blocks = BlockManager(5, 4)
    blocks.add_release_hook(released.append)
    a, b = [], []
    assert blocks.allocate(a, 1) and a == [0]
    assert blocks.allocate(a, 4) and a == [0]
    assert blocks.allocate(a, 9) and a == [0, 1, 2]
    assert blocks.allocate(b, 8) and b == [3, 4]
    assert not blocks.allocate(b, 9) and b == [3, 4]
    assert blocks.num_free_blocks == 0 and blocks.num_used_blocks == 5
    blocks.free(a)
    assert a == [] and released == [] and blocks.num_free_blocks == 3
    assert blocks.allocate(b, 12) and b == [3, 4, 0]
    blocks.free(b)
    assert released == [[0, 1, 2, 3, 4]] and blocks.num_free_blocks == 5


def test_identical_prompt_prefixes_share_blocks_and_the_last_token_is_always_computed() -> None:
    """A second request with the same 40-token prompt (blocks of 16) shares the first two blocks, not the
    partial third; a prompt of exactly 32 identical tokens shares only the first block (its last token
    must be computed for logits); a prompt that differs in its first block shares nothing, even where
    later blocks hold the same tokens; hits and queries are counted in tokens when counted."""
    stats = SpecDecodeStats()
    blocks = BlockManager(20, 16, prefix_caching=True, stats=stats)
    prompt = list(range(1, 41))
    first = _seq("a", prompt)
    _prefilled(blocks, first)
    second = _seq("b", prompt)
    assert blocks.share_prefix(second) == 32 and second.block_table == first.block_table[:2]
    blocks.count_lookup(second, 32)
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (40, 32)
    exact = _seq("c", prompt[:32])
    assert blocks.share_prefix(exact) == 16 and exact.block_table == first.block_table[:1]
    other = _seq("d", [99, *prompt[1:]])
    assert blocks.share_prefix(other) == 0 and other.block_table == []
    assert blocks.num_used_blocks == 3  # first's three, shared by second and exact


def test_freed_prompt_blocks_stay_findable_until_their_memory_is_needed() -> None:
    """A finished request's registered blocks are kept (not released) and found by a later request; its
    unregistered blocks are released at once; when blocks run out, cached ones are reused (evicted, no
    longer findable), least recently freed first."""
    released: list[int] = []
    blocks = BlockManager(4, 16, prefix_caching=True)
    blocks.add_release_hook(released.extend)
    seq = _seq("a", list(range(1, 41)))
    _prefilled(blocks, seq)
    assert blocks.allocate(seq.block_table, 50)  # a generated block
    blocks.free_sequence(seq)
    assert sorted(released) == [2, 3] and blocks.num_cached_blocks == 2 and blocks.num_used_blocks == 0
    again = _seq("b", list(range(1, 41)))
    assert blocks.share_prefix(again) == 32
    blocks.free_sequence(again)
    table: list[int] = []
    assert blocks.allocate(table, 64) and len(table) == 4
    assert blocks.num_cached_blocks == 0
    assert blocks.share_prefix(_seq("c", list(range(1, 41)))) == 0


def test_no_sharing_without_prefix_caching_or_for_prompt_logprobs() -> None:
    """Prefix caching off finds nothing; a request that wants prompt logprobs never shares (every
    position of its prompt must be scored) and is not counted as a query."""
    stats = SpecDecodeStats()
    off = BlockManager(8, 16)
    _prefilled(off, _seq("a", list(range(1, 41))))
    assert off.share_prefix(_seq("b", list(range(1, 41)))) == 0
    on = BlockManager(8, 16, prefix_caching=True, stats=stats)
    _prefilled(on, _seq("a", list(range(1, 41))))
    scoring = _seq("b", list(range(1, 41)), prompt_logprobs=1)
    assert on.share_prefix(scoring) == 0
    on.count_lookup(scoring, 0)
    assert stats.prefix_cache_queries == 0
